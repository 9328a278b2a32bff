"""Processes that outlive SIGKILL, made with real kernel behaviour: a rank (or a worker of its
group) in a frozen cgroup v1 freezer handles no signal until it is thawed. Remediation reports
`unkillable` (it used to say `failed` and nothing more), names each process with what the kernel
says of it, keeps the node unfit while it lives, and records when it finally goes."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from sidecar.fitness import Reason
from sidecar.host import stuck
from sidecar.ranks.registry import Registry
from sidecar.watchdog.machine import Watchdog
from tests.support import ROOT, freezer, make_settings, wait_until
from tests.watchdog.helpers import WATCHDOG, register_hung
from tests.watchdog.test_outcomes import GROUP_WITH_STUBBORN_WORKER, register
from tests.watchdog.test_remediation import events, finish, stall

needs_freezer = pytest.mark.skipif(not freezer.available(), reason="needs a writable cgroup v1 freezer hierarchy")

QUICK = {
    "remediation.dump_wait_seconds": 0.2,
    "remediation.grace_seconds": 0.2,
    "remediation.kill_wait_seconds": 0.5,
}


def record_of(dog: Watchdog) -> dict:
    return json.loads(Path(dog.incidents()[0]["path"]).read_text())


@pytest.mark.asyncio
@needs_freezer
async def test_a_frozen_rank_is_unkillable_named_with_its_state_and_the_node_unfit_until_it_goes(
    tmp_path, clock, hung_rank
):
    s = make_settings(tmp_path, WATCHDOG, QUICK)
    registry = Registry(s)
    dog = Watchdog(s, registry, clock=clock)
    proc, stacks = hung_rank()
    r = register_hung(registry, proc, stacks)
    with freezer.frozen_cgroup() as cg:
        cg.add(proc.pid)
        cg.freeze()
        await stall(dog, registry, clock, [r])
        await finish(dog)
        record = record_of(dog)
        assert record["outcome"] == "unkillable", record["timeline"]
        assert events(record)[-3:] == ["sigkill", "still_running", "unkillable"]
        (stuck,) = record["unkillable"]
        assert (stuck["pid"], stuck["who"]) == (proc.pid, "rank 0")
        assert stuck["state"] == "D (uninterruptible sleep)"
        assert stuck["freezer"] == f"FROZEN in {cg.path}"
        assert "SIGKILL" in stuck["pending_signals"] and stuck["wchan"]
        assert stuck["kernel_stack"] and stuck["kernel_stack_error"] is None  # root reads it here
        assert "freezer cgroup is FROZEN" in stuck["why"]
        assert f"rank 0 (pid {proc.pid}, python" in Path(record["path"]).with_suffix(".txt").read_text()
        assert dog.counters.remediations[("job", "unkillable")] == 1
        (finding,) = dog.remediator.unkillable.findings()
        assert finding.reason is Reason.UNKILLABLE and finding.pids == (proc.pid,)
        dog.tick()
        assert dog.remediator.unkillable.findings(), "still unfit while the process lives"

        cg.thaw()  # the pending SIGKILL is delivered
        assert proc.wait(timeout=10) == -signal.SIGKILL
        dog.tick()
        assert dog.remediator.unkillable.findings() == [], "fit again once it is gone"
        record = record_of(dog)  # saved again, saying when
        gone = record["timeline"][-1]
        assert gone["event"] == "unkillable_gone" and gone["pids"] == [proc.pid]
        assert gone["gone_after_seconds"] >= 0 and record["outcome"] == "unkillable"


@pytest.mark.asyncio
@needs_freezer
async def test_a_frozen_worker_of_a_rank_that_died_is_unkillable_as_a_member_of_its_group(tmp_path, clock):
    s = make_settings(tmp_path, WATCHDOG, QUICK)
    registry = Registry(s)
    dog = Watchdog(s, registry, clock=clock)
    rank = subprocess.Popen(
        [sys.executable, "-c", GROUP_WITH_STUBBORN_WORKER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    worker = psutil.Process(int(rank.stdout.readline()))
    try:
        with freezer.frozen_cgroup() as cg:
            cg.add(worker.pid)
            cg.freeze()
            r = register(registry, rank.pid, with_pidfd=True)
            await stall(dog, registry, clock, [r])
            await finish(dog)
            assert rank.wait(timeout=10) == -signal.SIGTERM, "the rank itself died"
            record = record_of(dog)
            assert record["outcome"] == "unkillable"
            (stuck,) = record["unkillable"]
            assert (stuck["pid"], stuck["who"]) == (worker.pid, f"pid {worker.pid} of rank 0's group")
            assert stuck["freezer"].startswith("FROZEN")
            cg.thaw()
            wait_until(
                lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, 10, what="worker gone"
            )
            dog.tick()
            assert dog.remediator.unkillable.findings() == []
            assert events(record_of(dog))[-1] == "unkillable_gone"
    finally:
        rank.kill()
        rank.wait()


DESCRIBE = (
    "import json, sys; from sidecar.host.stuck import describe; print(json.dumps(describe(int(sys.argv[1])).as_dict()))"
)


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv")
def test_with_only_the_daemonset_s_capabilities_the_kernel_stack_is_unreadable_and_the_record_says_so(spawn):
    """The DaemonSet's sidecar is root with KILL and SYS_PTRACE only: /proc/<pid>/stack needs
    CAP_SYS_ADMIN, the rest (state, wait channel, descriptors) does not."""
    daemonset = yaml.safe_load((ROOT / "deploy/kubernetes/base/daemonset.yaml").read_text())
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    caps = ",".join("+" + c.lower() for c in container["securityContext"]["capabilities"]["add"])
    target = spawn(["sleep", "600"])
    wait_until(lambda: psutil.Process(target.pid).name() == "sleep", 10)
    out = subprocess.run(
        ["setpriv", "--inh-caps=-all", f"--bounding-set=-all,{caps}", sys.executable, "-c", DESCRIBE, str(target.pid)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout)
    assert facts["kernel_stack"] == [] and "needs root with CAP_SYS_ADMIN" in facts["kernel_stack_error"]
    assert facts["state"] == "S (sleeping)" and facts["wchan"] and facts["name"] == "sleep"
    assert facts["freezer"] is None, "the root freezer cgroup (no freezer.state) freezes nothing"


def test_the_facts_name_the_gpu_device_files_held_and_escape_the_process_s_own_name(tmp_path):
    """Read from a procfs fixture tree (procfs_root is configurable, as node_exporter's)."""
    proc = tmp_path / "4242"
    (proc / "fd").mkdir(parents=True)
    (proc / "stat").write_text("4242 (evil)\x1b[2J name) D 1 4242 4242 0 -1 4194560\n")
    (proc / "status").write_text("Name:\tevil\nTracerPid:\t0\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000000100\n")
    (proc / "wchan").write_text("nv_wait_for_gpu")
    for fd, target in {"0": "/dev/null", "3": "/dev/nvidia0", "4": "/dev/nvidiactl", "5": "socket:[77]"}.items():
        (proc / "fd" / fd).symlink_to(target)
    facts = stuck.describe(4242, procfs=str(tmp_path))
    assert facts.gpu_files == ["/dev/nvidia0", "/dev/nvidiactl"]
    assert facts.name == "evil)\\x1b[2J name" and facts.state == "D (uninterruptible sleep)" and facts.ppid == 1
    assert facts.pending_signals == ["SIGKILL"] and facts.wchan == "nv_wait_for_gpu"
    assert facts.kernel_stack == [] and facts.kernel_stack_error.startswith("unreadable")
    assert facts.why() == "D (uninterruptible sleep), waiting in nv_wait_for_gpu, SIGKILL pending"
