"""Issue 44, item 1: the kill at Pod Security `baseline`.

A training pod without hostNetwork, hostPID or a hostPath pushes to its node's sidecar over TCP
(`status.hostIP`). Its connection's client end lives in the pod's own network namespace, where the
sidecar's own `/proc/net/tcp` cannot see it: every such rank used to be recorded *unverified*
(never signalled, no stacks, its pid the number inside the pod shown as if it were the host's).
The sidecar now finds the process in the pod's namespace (sidecar/host/podnet.py) and maps the
claimed pid through it as for the Unix socket.

The "pods" here are real: a network namespace with a veth to the host (`ip netns`), and a pid
namespace of their own (`unshare --pid --mount-proc`); the sidecar listens on the host end's
address with a bearer token, as components/push-over-tcp publishes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.security.rig import CLIENT, next_result
from tests.support import PYTHON, ROOT, Sidecar, kill_tree, spawned, tail, wait_until
from tests.support.unpriv import UNPRIV_PYTHON, User, stage_hooks, unprivileged_user, world_dir

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("unshare") and shutil.which("setpriv")),
    reason="needs root, ip, unshare and setpriv to make a pod's namespaces",
)

TOKEN = "pod-tcp-test-token"
WATCH = (
    "watchdog.startup_timeout_seconds=30",
    "watchdog.floor_seconds=3",
    "watchdog.check_interval_seconds=0.25",
    "hooks_flush_interval_seconds=0.5",
    "remediation.grace_seconds=2",
)


@dataclass
class Pod:
    netns: str
    host_ip: str  # the node's end of the pod's veth: where the pod reaches the sidecar
    ip: str

    def command(self, argv: list[str], user: User | None = None) -> list[str]:
        """`argv` in the pod: its network namespace, a pid namespace of its own (pid 1 is
        unshare's child, as a container's init), as root or as `user`."""
        who = ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups", "--"] if user else []
        return ["ip", "netns", "exec", self.netns, "unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
                *who, *argv]  # fmt: skip


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def pod_network(tag: str) -> Iterator[Pod]:
    """A network namespace joined to the host by a veth pair, on a /30 no interface here holds."""
    name = f"sjpod{os.getpid():x}{tag}"
    used = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    third = next(n for n in random.sample(range(256), 256) if f"10.219.{n}." not in used)
    host_ip, pod_ip = f"10.219.{third}.1", f"10.219.{third}.2"
    outside, inside = f"{name}h"[-15:], f"{name}p"[-15:]
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    subprocess.run(["ip", "link", "del", outside], capture_output=True)
    try:
        _ip("netns", "add", name)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", name)
        _ip("addr", "add", f"{host_ip}/30", "dev", outside)
        _ip("link", "set", outside, "up")
        _ip("-n", name, "addr", "add", f"{pod_ip}/30", "dev", inside)
        _ip("-n", name, "link", "set", inside, "up")
        _ip("-n", name, "link", "set", "lo", "up")
        yield Pod(name, host_ip, pod_ip)
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", outside], capture_output=True)


class NodeSidecar(Sidecar):
    """The sidecar listening on every address of the node, with the push API's bearer token."""

    def command(self) -> list[str]:
        cmd = super().command()
        cmd[cmd.index("--listen") + 1] = f"0.0.0.0:{self.port}"
        return cmd


@contextlib.contextmanager
def node_sidecar(workdir: Path, *settings: str) -> Iterator[Sidecar]:
    with NodeSidecar(workdir, *settings, env={"SIDECAR_TOKEN": TOKEN}) as sidecar:
        yield sidecar


def incidents(sidecar: Sidecar) -> list[dict]:
    directory = sidecar.workdir / "diag" / "incidents"
    found = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        with contextlib.suppress(OSError, ValueError):
            found.append(json.loads(path.read_text()))
    return [r for r in found if r.get("kind", "stall") == "stall"]


def netns_of(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


@pytest.mark.slow
def test_a_hung_rank_in_a_pod_pushing_over_tcp_is_verified_dumped_and_killed_and_the_job_restarts(tmp_path):
    """2 ranks under torchrun in the pod, rank 1 SIGSTOPs itself at step 20: the stall is the
    sidecar's to act on (outcome not `unverified`), rank 1's stack is dumped by py-spy through the
    pod's namespaces, the rank killed, and torchrun's restart trains to the end. While it trains,
    `/v1/status` shows the ranks by their host pids (in the pod's network namespace, not ours)."""
    log = tmp_path / "cycle.jsonl"
    with pod_network("a") as pod, node_sidecar(tmp_path / "sidecar", *WATCH) as sidecar:
        env = {
            "PATH": os.environ["PATH"],
            "PYTHONPATH": str(ROOT),
            "SIDECAR_URL": f"http://{pod.host_ip}:{sidecar.port}",
            "SIDECAR_TOKEN": TOKEN,
            "CYCLE_LOG": str(log),
            "CYCLE_HANGS": "1",
            "CYCLE_HANG_STEP": "20",
            "CYCLE_HANG_RANK": "1",
            "CYCLE_HANG_MODE": "stop",
            "FAULT_SHAPE": "sync",
        }
        argv = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                str(ROOT / "bench" / "cycles" / "train_faults.py")]  # fmt: skip
        out = tmp_path / "torchrun.log"
        with spawned(pod.command(argv), out, env=env) as job:
            wait_until(lambda: len([r for r in sidecar.status()["ranks"] if r["uid"] == 0]) >= 2, 120,
                       what="two verified ranks", interval=0.2)  # fmt: skip
            pids = {r["rank"]: r["pid"] for r in sidecar.status()["ranks"] if r["uid"] == 0}
            for pid in pids.values():  # the host's pid of a process in the pod's namespaces
                assert netns_of(pid) != netns_of(os.getpid()), pids
            assert job.wait(timeout=240) == 0, tail(out)
        records = [json.loads(line) for line in log.read_text().splitlines()]
        assert {r["attempt"] for r in records if r["kind"] == "first_step"} == {0, 1}, records
        assert any(r["kind"] == "done" for r in records), tail(out)
        (incident,) = incidents(sidecar)
        assert incident["blamed_rank"] == 1, incident["summary"]
        assert incident["outcome"] == "killed", incident["summary"]  # was `unverified`: never signalled
        (sigterm,) = [e for e in incident["timeline"] if e["event"] == "sigterm"]
        assert -pids[1] in sigterm["pids"], (pids, sigterm)  # the host pid (its process group), not the pod's
        (hung,) = [r for r in incident["ranks"] if r["rank"] == 1]
        assert "Chaos.step" in (hung.get("py_spy") or ""), hung  # its stack, read through the pod's namespaces


# Run in a pod as a local user: register a rank over TCP to the node's sidecar, then keep pushing.
VICTIM = """
import json, os, sys, time
from trainer_hooks import Monitor
mon = Monitor(job_id="victim", rank=0, world_size=2, flush_interval=0.2)
for step in range(1, 100000):
    mon.step(step, loss=1.0)
    if step == 3:
        print("RESULT " + json.dumps({"pid": os.getpid()}), flush=True)
    time.sleep(0.1)
"""

ATTACK = """
import urllib.request
URL, TOKEN = os.environ["SIDECAR_URL"], os.environ["SIDECAR_TOKEN"]

def over_tcp(path, body):
    req = urllib.request.Request(URL + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer " + TOKEN})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")

out = {}
own = sleeper()
for name, pid, job, rank in (("their_pod_pid", VICTIM_POD_PID, "mine", 0),
                             ("their_host_pid", VICTIM_HOST_PID, "mine", 0), ("join_their_job", own.pid, "victim", 1)):
    status, body = over_tcp("/v1/register", registration(pid, job, rank=rank, world_size=2))
    out[name] = [status, body.get("code") if isinstance(body, dict) else None]
status, body = over_tcp("/v1/push", {"job_id": "victim", "rank": 0, "pid": VICTIM_POD_PID,
                                     "items": [{"type": "step", "step": 10**6, "time": time.time()}]})
out["push_to_theirs"] = [status, body.get("code") if isinstance(body, dict) else None]
report(**out)
"""


@pytest.mark.slow
def test_another_pods_user_can_neither_claim_nor_join_nor_push_to_a_verified_pods_rank(tmp_path):
    """Alice's rank in pod A is verified as her process (her uid, its host pid). Mallory, in pod B,
    names it by its pod pid and by its host pid, joins its job with a process of her own, and
    pushes to it without its session: all refused, and Alice's rank stays hers."""
    alice, mallory = unprivileged_user("a"), unprivileged_user("m")
    shared = world_dir(tmp_path)
    hooks = stage_hooks(shared)
    with pod_network("v") as pod_a, pod_network("m") as pod_b, node_sidecar(tmp_path / "sidecar", *WATCH) as sidecar:

        def env(pod: Pod) -> dict:
            return {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(hooks), "HOME": "/tmp", "PYTHONUNBUFFERED": "1",
                    "SIDECAR_URL": f"http://{pod.host_ip}:{sidecar.port}", "SIDECAR_TOKEN": TOKEN}  # fmt: skip

        argv = ["sh", "-c", '"$@"; exit $?', "init", UNPRIV_PYTHON, "-c", VICTIM]  # the rank is not the pod's pid 1
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        victim = subprocess.Popen(pod_a.command(argv, alice), env=env(pod_a), start_new_session=True, **pipes)
        try:
            pod_pid = next_result(victim, 60)["pid"]
            wait_until(lambda: any(r["job_id"] == "victim" for r in sidecar.status()["ranks"]), 30, what="the victim")
            (theirs,) = [r for r in sidecar.status()["ranks"] if r["job_id"] == "victim"]
            assert pod_pid != 1 and netns_of(theirs["pid"]) != netns_of(os.getpid()), (pod_pid, theirs)
            assert theirs["uid"] == alice.uid and theirs["pid"] != pod_pid, theirs  # verified, by its host pid
            code = CLIENT + ATTACK.replace("VICTIM_POD_PID", str(pod_pid))
            code = code.replace("VICTIM_HOST_PID", str(theirs["pid"]))
            attack = subprocess.run(pod_b.command([UNPRIV_PYTHON, "-c", code], mallory), env=env(pod_b),
                                    capture_output=True, text=True, timeout=60)  # fmt: skip
            line = next((x for x in attack.stdout.splitlines() if x.startswith("RESULT ")), None)
            assert line is not None, attack.stdout + attack.stderr
            said = json.loads(line[len("RESULT ") :])
            # The victim's pod pid names, in Mallory's pod, a process of her own (or none): never Alice's.
            assert said["their_pod_pid"][0] in (200, 403) and said["their_host_pid"] == [403, "pid_mismatch"], said
            assert said["join_their_job"] == [403, "job_owned"], said
            assert said["push_to_theirs"] == [409, "unknown_rank"], said  # no session: it is not hers
            ranks = sidecar.status()["ranks"]
            assert {r["uid"] for r in ranks if r["job_id"] == "mine"} <= {mallory.uid}, ranks
            assert [r["pid"] for r in ranks if r["uid"] == alice.uid] == [theirs["pid"]], ranks
            (after,) = [r for r in ranks if r["job_id"] == "victim"]
            assert (after["uid"], after["pid"]) == (alice.uid, theirs["pid"]) and after["step"] < 10**6, after
        finally:
            kill_tree(victim)
