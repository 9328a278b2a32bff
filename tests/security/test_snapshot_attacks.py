"""Issue 28, rows 4 and 12: another local user against the bundled trainer's memory snapshots,
which live in a directory every user shares (`checkpoint.memory_dir`, /dev/shm). Each attack runs
as a throw-away user (tests/support/unpriv.py, standard library only); the victim is a real 2-rank
torchrun job of the trainer (root's, as the tests run) whose rank 1 is SIGKILLed at step 13 and
restarted, and it must train to its end and resume as it would without the attacker.
docs/security.md, "The bundled trainer's memory snapshots"."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.unpriv import UNPRIV_PYTHON, run_as_sync, unprivileged_user, world_dir
from tests.trainer.helpers import Run, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("trainer_torchrun")]

KILL_RANK1_AT_13 = ("faults.kind=sigkill", "faults.rank=1", "faults.at_step=13")
# A snapshot of this model is ~0.94 MB per rank: two ranks' do not fit in 1 MiB.
WIDE = "model.kwargs={hidden: 256}"
DISK_ONLY = "checkpoint.memory_every_steps=0"


def loaded(run: Run) -> tuple[int, str, str]:
    """(step, source, where) of the resume, from rank 0's `checkpoint loaded` line."""
    found = re.findall(r"checkpoint loaded: step=(\d+) source=(\w+) (?:dir|path)=(\S+)", run.log)
    assert len(found) == 1, run.log[-3000:]
    return int(found[0][0]), found[0][1], found[0][2]


@contextlib.contextmanager
def small_tmpfs(size_mib: int) -> Iterator[Path]:
    """A tmpfs of `size_mib` MiB that every user may write, sticky (mode 1777, as /dev/shm), on a
    path every user can reach; unmounted and removed on exit, the test failed or not."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    top = Path(tempfile.mkdtemp(prefix="sidecar-shm-", dir="/tmp"))
    top.chmod(0o755)
    mount = top / "shm"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=1777", "sidecar-test-shm", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        shutil.rmtree(top, ignore_errors=True)
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
        shutil.rmtree(top, ignore_errors=True)


@contextlib.contextmanager
def shared_dir() -> Iterator[Path]:
    """A directory like /dev/shm: root's, mode 1777; removed on exit."""
    top = world_dir()
    shm = top / "shm"
    shm.mkdir()
    shm.chmod(0o1777)
    try:
        yield shm
    finally:
        shutil.rmtree(top, ignore_errors=True)


# ---------------------------------------------------------------- row 4: /dev/shm filled up

# The attacker fills the shared tmpfs to `left` bytes free with a file of its own.
FILL = r"""
import os, sys
shm, left = sys.argv[1], int(sys.argv[2])
st = os.statvfs(shm)
with open(os.path.join(shm, "filler"), "wb") as f:
    f.write(b"\xa5" * (st.f_bavail * st.f_frsize - left))
st = os.statvfs(shm)
print(st.f_bavail * st.f_frsize)
"""


def test_row4_a_tmpfs_filled_by_another_user_skips_the_snapshots_and_training_goes_on(tmp_path):
    """Before: the first snapshot that did not fit raised out of torch.save (RuntimeError
    'unexpected pos', after the short write) on the memory lane, re-raised on the training
    thread at the next step: rank died at step 2, and every restart died the same way (the next
    one at its start, writing owner.json into a tmpfs its predecessor's debris had filled)."""
    mallory = unprivileged_user("shm-fill")
    with small_tmpfs(4) as shm:
        filled = run_as_sync(mallory, [UNPRIV_PYTHON, "-c", FILL, str(shm), str(1 << 20)])
        assert filled.returncode == 0, filled.stderr
        assert int(filled.stdout) == 1 << 20
        filler = (shm / "filler").stat()

        run = torchrun(tmp_path / "attacked", f"checkpoint.memory_dir={shm}", WIDE, *KILL_RANK1_AT_13)

        assert run.returncode == 0, run.log[-4000:]
        assert "training finished: step=30 " in run.log
        assert "fault injection: sigkill on rank 1 at step 13" in run.log and "restart_count=1" in run.log
        # Each process says once that a snapshot failed, and once that it stopped taking them.
        failed = re.findall(
            r"trainer\[rank(\d)\] WARNING memory snapshot of step \d+ failed \((.*)\): not taken", run.log
        )
        off = re.findall(r"trainer\[rank(\d)\] WARNING memory snapshots off for this process: 3 failed", run.log)
        assert 1 <= len(failed) <= 4 and 1 <= len(off) <= 4, run.log[-4000:]
        assert all("MiB free in " + str(shm) in why for _, why in failed), failed
        # No snapshot every rank holds: the disk checkpoint, step 10 (5 if 10 was still being written).
        step, source, _ = loaded(run)
        assert (step, source) in ((10, "disk"), (5, "disk"))
        # Nothing of the victim's is left behind (the finished job removed its files, failed
        # writes their partial ones), and the attacker's file is as it was.
        left = [p for p in shm.rglob("*") if p.is_file() and p.name != "filler"]
        assert left == [], left
        assert (shm / "filler").stat().st_size == filler.st_size and (shm / "filler").stat().st_uid == mallory.uid
        assert os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize == 1 << 20

    # The resume is exact: the same parameters as the same job uninterrupted, without snapshots.
    twin = torchrun(tmp_path / "uninterrupted", WIDE, DISK_ONLY)
    assert twin.returncode == 0, twin.log[-3000:]
    assert run.digest == twin.digest


# ---------------------------------------------------------------- row 12: the user's directory taken first

# The attacker takes the victim's old fixed name (a directory of its own that everyone may write,
# or a symlink to one) and, for good measure, two names of the new form.
SQUAT = r"""
import json, os, sys
shm, uid, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
trap = os.path.join(shm, "trap")
os.mkdir(trap)
os.chmod(trap, 0o777)
old = os.path.join(shm, f"sidecar-trainer-{uid}")
if kind == "symlink":
    os.symlink(trap, old)
else:
    os.mkdir(old)
    os.chmod(old, 0o777)
guessed = os.path.join(shm, f"sidecar-trainer-{uid}." + "0" * 16)
os.mkdir(guessed)
os.chmod(guessed, 0o777)
os.symlink(trap, os.path.join(shm, f"sidecar-trainer-{uid}." + "f" * 16))
print(json.dumps(sorted(os.listdir(shm))))
"""


@pytest.mark.parametrize(
    ("squat", "launcher"), [("directory", "torch.distributed.run"), ("symlink", "sidecar_trainer.launch")]
)
def test_row12_the_users_snapshot_directory_taken_first_by_another_user_neither_disables_nor_receives_them(
    tmp_path, squat, launcher
):
    """Before: `sidecar-trainer-<uid>` was refused (another user's directory, or a symlink), memory
    snapshots were off for the job, and the restart resumed from the disk's step 10 instead of 12."""
    mallory = unprivileged_user("shm-squat")
    with shared_dir() as shm:
        squatted = run_as_sync(mallory, [UNPRIV_PYTHON, "-c", SQUAT, str(shm), str(os.geteuid()), squat])
        assert squatted.returncode == 0, squatted.stderr
        planted = set(json.loads(squatted.stdout))

        run = torchrun(tmp_path, f"checkpoint.memory_dir={shm}", *KILL_RANK1_AT_13, launcher=launcher)

        assert run.returncode == 0, run.log[-4000:]
        assert "fault injection: sigkill on rank 1 at step 13" in run.log and "restart_count=1" in run.log
        assert "memory snapshots off" not in run.log
        # From memory, newer than the disk's step 10: 12, or 11 if rank 1 died before sealing 12.
        step, source, where = loaded(run)
        assert (step, source) in ((12, "memory"), (11, "memory")), run.log[-4000:]
        user_dir = Path(where).parent
        assert user_dir.parent == shm and user_dir.name not in planted
        assert re.fullmatch(rf"sidecar-trainer-{os.geteuid()}\.[0-9a-f]{{16}}", user_dir.name)
        st = os.lstat(user_dir)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
        # Nothing of the victim's went into what the attacker planted.
        for name in planted:
            path = shm / name
            assert path.is_symlink() or os.lstat(path).st_uid == mallory.uid
            if path.is_dir() and not path.is_symlink():
                assert list(path.iterdir()) == [], (name, list(path.iterdir()))
