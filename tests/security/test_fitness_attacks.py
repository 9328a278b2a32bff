"""Security issue 28, row 3: the node verdict from an unverified registration.

The GPU side of the node verdict (sidecar/collectors/gpu_fitness.py) calls a process *left over*
when it held GPU memory while in a live rank's process tree and still holds it once no live
rank's tree contains it: `gpu_held`, and node-problem-detector (`sidecar status --check node`,
exit 1) drains the node, the finding naming that pid. An unverified TCP registration (sent, then
the connection closed before the sidecar looked for its process: tests/security/test_tcp_identity.py)
names whatever pid it likes. Mallory named alice's GPU process, then re-registered the slot with
another pid: alice's process "outlived its rank", the node was drained and alice's pid blamed, for
as long as her process ran. GPU ownership now comes from verified ranks only: an unverified claim
neither makes a process a member nor covers a real left-over (which would hide one), and it is
attributed no GPU memory (`sidecar_gpu_process_memory_bytes`).

The real sidecar runs as root over the fake NVML library (its spec file re-read when it changes);
`sidecar status --check node` is the real CLI; the attacks run as unprivileged users.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.ops.helpers import run_cli
from tests.security.rig import attack, open_sidecar, ranks_of, start_as
from tests.support import Sidecar, kill_tree, wait_until
from tests.support.unpriv import User, run_as, unprivileged_user

GIB = 1 << 30
SETTINGS = (
    "collectors.nvml_module=sidecar.testing.fake_nvml_lib",
    "collectors.gpu_held_grace_seconds=0",  # the verdict on the first round that sees a left-over
    "collectors.interval_seconds=0.5",
)

# A registration over TCP whose caller is gone before the sidecar looks for it (the last byte
# held back by TCP_CORK, sent by the kernel when the process exits): recorded unverified.
UNVERIFIED = """
    def unverified(port, body):
        body = json.dumps(body).encode()
        head = (f"POST /v1/register HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json\\r\\n"
                f"Content-Length: {{len(body)}}\\r\\nConnection: close\\r\\n\\r\\n").encode()
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(head + body[:-1])
        time.sleep(0.2)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
        s.send(body[-1:])
        os._exit(0)

    child = os.fork()
    if child == 0:
        unverified({port}, registration({pid}, {job!r}, world_size=1, restart_count={restart}))
    os.waitpid(child, 0)
    report(done=True)
"""

# Alice's verified rank: registers itself over the Unix socket, with a data-loader worker that
# will hold GPU memory.
ALICE_RANK = """
    worker = sleeper()
    status, answer = request("/v1/register", registration(os.getpid(), "alice-job", world_size=1))
    report(rank=os.getpid(), worker=worker.pid, status=status)
    time.sleep(600)
"""


def register_unverified(user: User, sidecar: Sidecar, pid: int, job: str, restart: int = 0) -> None:
    """`user` registers rank 0 of `job` naming `pid`, unverified; back once the sidecar holds it."""
    attack(user, sidecar, UNVERIFIED.format(port=sidecar.port, pid=pid, job=job, restart=restart))
    wait_until(
        lambda: ranks_of(sidecar, job).get(0, {}).get("pid") == pid,
        30,
        what=f"the unverified registration of rank 0 of {job} naming pid {pid}",
    )


def sample(sidecar: Sidecar, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(sidecar.metrics()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


class FakeGpus:
    """The fake NVML's spec file: two GPUs and their compute processes. `round` rewrites it with
    a new temperature and waits until /metrics shows it: a GPU collector round that began after
    everything before the call (it reads the GPUs first, then the ranks) has finished."""

    def __init__(self, path: Path):
        self.path, self.processes, self.temperature = path, {"0": [], "1": []}, 40
        self._write()

    def env(self) -> dict[str, str]:
        return {"SIDECAR_FAKE_NVML": str(self.path)}

    def hold(self, gpu: str, pid: int, used: int) -> None:
        self.processes[gpu].append({"pid": pid, "used_memory_bytes": used})
        self._write()

    def _write(self) -> None:
        spec = {
            "gpu_count": 2,
            "gpu": {"temperature_celsius": self.temperature},
            "gpus": {gpu: {"processes": procs} for gpu, procs in self.processes.items()},
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(spec))
        os.replace(tmp, self.path)

    def round(self, sidecar: Sidecar) -> None:
        self.temperature += 1
        self._write()
        wait_until(
            lambda: sample(sidecar, "sidecar_gpu_temperature_celsius", gpu="0") == self.temperature,
            30,
            interval=0.2,
            what="a GPU collector round after the change",
        )


def names(text: str, pid: int) -> bool:
    return re.search(rf"\bpid {pid}\b", text) is not None


def check_node(sidecar: Sidecar):
    """node-problem-detector's check: the real CLI against the real sidecar."""
    return run_cli("status", "--socket", sidecar.socket, "--check", "node")


def test_row3_an_unverified_registration_naming_another_users_gpu_process_never_drains_the_node(tmp_path):
    """Mallory names alice's GPU process as rank 0 of "blame" (unverified), lets a GPU round see
    it, then re-registers the slot with her own process: alice's process looks "left over". The
    node stays fit and alice's pid is named nowhere (before: `--check node` exit 1, "unfit
    (gpu_held) ... pid <alice's>", for as long as alice's process ran)."""
    mallory, alice = unprivileged_user("mallory"), unprivileged_user("alice")
    gpus = FakeGpus(tmp_path / "nvml.json")
    victim = run_as(alice, ["sleep", "600"])  # alice's training process (no sidecar hooks) on GPU 0
    decoy = run_as(mallory, ["sleep", "600"])  # what mallory re-registers the slot with
    gpus.hold("0", victim.pid, 6 * GIB)
    try:
        with open_sidecar(*SETTINGS, env=gpus.env()) as sidecar:
            gpus.round(sidecar)
            assert check_node(sidecar).returncode == 0  # alice's process was never in a rank's tree

            register_unverified(mallory, sidecar, victim.pid, "blame")
            gpus.round(sidecar)  # seen in a round while "its rank" lives
            register_unverified(mallory, sidecar, decoy.pid, "blame", restart=1)
            gpus.round(sidecar)
            gpus.round(sidecar)

            check = check_node(sidecar)
            assert (check.returncode, check.stdout) == (0, "fit\n"), (
                f"--check node under the attack: exit {check.returncode}: {check.stdout}{check.stderr}"
            )
            assert sidecar.status()["fitness"] == {"fit": True, "reasons": [], "findings": []}
            assert sample(sidecar, "sidecar_node_fit") == 1
            assert sample(sidecar, "sidecar_node_unfit_reason", reason="gpu_held") == 0
            assert not names(check.stdout, victim.pid)
            assert "gpu_held" not in run_cli("status", "--socket", sidecar.socket).stdout
    finally:
        kill_tree(victim)
        kill_tree(decoy)


def test_row3_an_unverified_rank_is_attributed_no_gpu_memory(tmp_path):
    """Per-rank GPU memory (`sidecar_gpu_process_memory_bytes`, and the GPUs the exit tracker
    takes a rank's to be) comes from verified ranks only: mallory's claim of alice's process
    shows none of alice's memory under mallory's job."""
    mallory, alice = unprivileged_user("mallory"), unprivileged_user("alice")
    gpus = FakeGpus(tmp_path / "nvml.json")
    victim = run_as(alice, ["sleep", "600"])
    gpus.hold("0", victim.pid, 6 * GIB)
    try:
        with open_sidecar(*SETTINGS, env=gpus.env()) as sidecar:
            register_unverified(mallory, sidecar, victim.pid, "blame")
            gpus.round(sidecar)
            gpus.round(sidecar)
            assert sample(sidecar, "sidecar_gpu_process_memory_bytes", job_id="blame") is None, (
                "alice's GPU memory was attributed to mallory's unverified rank"
            )
    finally:
        kill_tree(victim)


def test_row3_a_verified_ranks_left_over_still_drains_the_node_and_no_unverified_claim_hides_it(tmp_path):
    """The check still fires: alice's verified rank (registered over the Unix socket) has a worker
    holding GPU 1; the rank dies, the worker lives on: unfit (gpu_held), naming the worker. Mallory
    claiming the worker as her unverified rank (so that it looks in a live rank's tree) does not
    cover it."""
    mallory, alice = unprivileged_user("mallory"), unprivileged_user("alice")
    gpus = FakeGpus(tmp_path / "nvml.json")
    bystander = run_as(alice, ["sleep", "600"])  # another of alice's GPU processes, in no rank's tree
    gpus.hold("0", bystander.pid, 6 * GIB)
    started, worker = [bystander], None
    try:
        with open_sidecar(*SETTINGS, env=gpus.env()) as sidecar:
            rank, seen = start_as(alice, sidecar, ALICE_RANK)
            started.append(rank)
            assert seen["status"] == 200, seen
            worker = seen["worker"]
            gpus.hold("1", worker, 5 * GIB)
            wait_until(
                lambda: (
                    sample(sidecar, "sidecar_gpu_process_memory_bytes", gpu="1", job_id="alice-job", rank="0")
                    == 5 * GIB
                ),
                30,
                what="the worker's GPU memory attributed to alice's verified rank",
            )
            assert check_node(sidecar).returncode == 0

            register_unverified(mallory, sidecar, worker, "cover")
            gpus.round(sidecar)
            os.kill(seen["rank"], signal.SIGKILL)
            wait_until(
                lambda: sample(sidecar, "sidecar_node_fit") == 0, 30, what="the node unfit for the left-over worker"
            )
            (finding,) = sidecar.status()["fitness"]["findings"]
            assert finding["reason"] == "gpu_held" and finding["pids"] == [worker], finding
            assert f"pid {worker} (was in rank 0 of job alice-job's tree) 5.0 GiB on GPU 1" in finding["text"]
            check = check_node(sidecar)
            assert check.returncode == 1 and check.stdout.startswith("unfit (gpu_held)"), check.stdout
            assert names(check.stdout, worker) and not names(check.stdout, bystander.pid), check.stdout
    finally:
        for proc in started:
            kill_tree(proc)
        if worker is not None:  # reparented when its rank was killed
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
