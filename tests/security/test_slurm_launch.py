"""Security round 4, row 1 (issue 43): the shipped Slurm launch cannot be captured by a local user.

`deploy/slurm/train.sbatch` runs one torchrun agent per node in a c10d rendezvous on the job's first
node. torch's c10d backend, when it cannot bind the rendezvous port and was not told it is the host,
quietly becomes a client of whatever listens there: a local user who listens first on the port gets
the victim's agents into her own store. The port was `20000 + SLURM_JOB_ID % 10000`, which anyone
computes from `squeue`.

Here the batch script runs for real on this machine as the first node of a one-node job, its `srun`
a stand-in that runs the step as srun would (SLURM_NODEID of the node), its torchrun the real one
with a real training script. An unprivileged user listens on the port the launch will use (given
to the script as RDZV_PORT, as if she had learnt it): the first node's agent fails the job, and her
listener is never connected to. Without RDZV_PORT the port is drawn from the kernel's random source
and differs for the same job id."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.processes import free_port
from tests.support import ROOT, kill_tree
from tests.support.unpriv import UNPRIV_PYTHON, run_as, unprivileged_user

pytestmark = pytest.mark.slow

SBATCH = ROOT / "deploy" / "slurm" / "train.sbatch"

# srun's stand-in: the step on this node, as srun would start it (its options dropped).
FAKE_SRUN = """#!/bin/sh
while [ "$#" -gt 0 ]; do
  case "$1" in --*) shift ;; *) break ;; esac
done
exec "$@"
"""
FAKE_SCONTROL = """#!/bin/sh
[ "$1 $2" = "show hostnames" ] && echo localhost
"""

# The attacker's listener: counts the connections it accepts, one line each, until killed.
LISTENER = r"""
import socket, sys
s = socket.socket(socket.AF_INET6)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
s.bind(("::", int(sys.argv[1])))
s.listen(16)
print("listening", flush=True)
while True:
    conn, peer = s.accept()
    print("accepted", peer[0], flush=True)
"""

TRAIN = """
import os
print("TRAINED rank", os.environ.get("RANK"), "run", os.environ.get("TORCHELASTIC_RUN_ID"), flush=True)
"""


def batch_env(tmp_path: Path, **extra: str) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NODEID": "0",
        "NPROC_PER_NODE": "1",
        "MAX_RESTARTS": "1",
        "PYTHON": sys.executable,
        "SIDECAR_SOCKET": str(tmp_path / "no-sidecar.sock"),
        "SIDECAR_HOOKS_DISABLED": "1",
        "PYTHONPATH": str(ROOT),
    }
    env.update(extra)
    return env


def sbatch(env: dict, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([str(SBATCH), *args], env=env, cwd="/", stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, err = proc.communicate()
        pytest.fail(f"train.sbatch did not end within {timeout}s:\n{out}\n{err[-3000:]}")
    finally:
        kill_tree(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_local_user_listening_first_on_the_rendezvous_port_gets_no_agent_and_the_job_fails(tmp_path):
    mallory = unprivileged_user("mallory")
    port = free_port()
    listener = run_as(mallory, [UNPRIV_PYTHON, "-c", LISTENER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout is not None and listener.stdout.readline().strip() == "listening"
        (tmp_path / "train.py").write_text(TRAIN)
        started = time.monotonic()
        out = sbatch(batch_env(tmp_path, RDZV_PORT=str(port)), str(tmp_path / "train.py"), timeout=60)
        took = time.monotonic() - started
    finally:
        kill_tree(listener)
    accepted = [ln for ln in (listener.stdout.read() if listener.stdout else "").splitlines() if "accepted" in ln]
    assert accepted == [], (accepted, out.stderr[-3000:])  # the victim's agent never joined her store
    assert out.returncode != 0 and "TRAINED" not in out.stdout, (out.stdout, out.stderr[-3000:])
    assert "is_host=true" in out.stderr or "address already in use" in out.stderr.lower(), out.stderr[-3000:]
    print(f"\ncaptured port: the first node's agent failed the job in {took:.1f}s, rc {out.returncode}")


def test_the_same_launch_trains_when_nobody_holds_the_port_and_draws_an_unpredictable_port(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    out = sbatch(batch_env(tmp_path), str(tmp_path / "train.py"))
    assert out.returncode == 0 and "TRAINED rank 0 run 4242" in out.stdout, (out.stdout, out.stderr[-3000:])
    ports = set()
    env = batch_env(tmp_path)
    env["PATH"] = env["PATH"].replace(str(tmp_path / "bin"), str(tmp_path / "echo"))
    (tmp_path / "echo").mkdir()
    (tmp_path / "echo" / "srun").write_text('#!/bin/sh\necho "$PET_RDZV_ENDPOINT"\n')
    (tmp_path / "echo" / "srun").chmod(0o755)
    shutil.copy(tmp_path / "bin" / "scontrol", tmp_path / "echo" / "scontrol")
    for _ in range(5):
        said = subprocess.run([str(SBATCH)], env={**env, "CONFIG": "x.yaml"}, capture_output=True, text=True,
                              timeout=30, check=True).stdout.splitlines()  # fmt: skip
        endpoint = said[0]  # torchrun's PET_RDZV_ENDPOINT: not on any command line
        host, port = endpoint.rsplit(":", 1)
        assert host == "localhost" and 20000 <= int(port) < 32768, endpoint
        ports.add(int(port))
    assert len(ports) >= 4, ports  # five draws of 12,768 ports: a repeat is rare, four alike never


def test_the_port_check_is_real_a_listener_on_another_port_changes_nothing(tmp_path):
    """Control: the refusal above is the port's, not the listener's existence."""
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::", 0))
        s.listen(1)
        (tmp_path / "train.py").write_text(TRAIN)
        out = sbatch(batch_env(tmp_path, RDZV_PORT=str(free_port())), str(tmp_path / "train.py"))
    assert out.returncode == 0 and "TRAINED" in out.stdout, out.stderr[-3000:]
    assert os.path.exists(SBATCH)


# ---------------------------------------------------------------- row 4: the next job's id

SQUATTER = """
    rank = sleeper()
    status, body = request("/v1/register", registration(rank.pid, os.environ["NEXT_JOB"], world_size=1))
    report(status=status, pid=rank.pid)
    time.sleep(600)
"""


def test_a_user_who_registers_the_next_jobs_id_first_neither_blocks_it_nor_gets_its_node_drained(tmp_path):
    """Slurm's job ids are sequential and public. Mallory registers the next one (4243) on the node
    before its job starts. The job's ranks register under train.sbatch's id, 4243.<random suffix>,
    which she could not know: accepted. At the job's end the epilog (SLURM_JOB_UID: alice's) counts
    only ranks running as alice: Mallory's squatter does not make it fail and drain the node.
    Before: the job's own id was 4243 (409 for the job's ranks: unwatched), and the epilog named
    Mallory's rank "left behind" (exit 1: Slurm drains the node, blamed on alice's job)."""
    import textwrap

    from tests.security.rig import attack, open_sidecar, run_as_user_background
    from tests.security.rig import next_result as result

    mallory, alice = unprivileged_user("mallory"), unprivileged_user("alice")
    with open_sidecar() as sidecar:
        squatter = run_as_user_background(
            mallory, sidecar, "os.environ['NEXT_JOB'] = '4243'\n" + textwrap.dedent(SQUATTER)
        )
        try:
            held = result(squatter, 60)
            assert held["status"] == 200, held  # the id is hers on this node
            ours = attack(alice, sidecar, """
                rank = sleeper()
                job = "4243." + os.urandom(8).hex()
                status, body = request("/v1/register", registration(rank.pid, job, world_size=1))
                rank.kill()
                report(status=status, job=job)
            """)  # fmt: skip
            assert ours["status"] == 200, ours  # the job's ranks are watched
            epilog = subprocess.run(
                [sys.executable, "-m", "sidecar.commands.slurm", "--job", "4243", "--uid", str(alice.uid),
                 "--socket", sidecar.socket, "--wait", "3", "--gpus", ""],
                capture_output=True, text=True, timeout=60, cwd=ROOT,
            )  # fmt: skip
            assert epilog.returncode == 0, (epilog.stdout, epilog.stderr)
            assert "job 4243: nothing left" in epilog.stdout and str(held["pid"]) not in epilog.stdout
            # without the job's uid (an epilog of before), her squatter would be named and drain the node
            old = subprocess.run(
                [sys.executable, "-m", "sidecar.commands.slurm", "--job", "4243", "--uid", "",
                 "--socket", sidecar.socket, "--wait", "0", "--gpus", ""],
                capture_output=True, text=True, timeout=60, cwd=ROOT,
            )  # fmt: skip
            assert old.returncode == 1 and str(held["pid"]) in old.stdout, (old.stdout, old.stderr)
        finally:
            kill_tree(squatter)
