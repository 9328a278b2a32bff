"""The diagnostics directory's rules (sidecar/host/diagfiles.py, sidecar/host/stackfiles.py): private
directories, writes that never follow a symlink, dump files read back only when they are the
file the sidecar created. The attacks themselves, as another user, are tests/security."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from sidecar.config import ConfigError, load_settings
from sidecar.host import diagfiles, stackfiles
from sidecar.incidents.store import IncidentStore


@pytest.mark.parametrize(
    "job_id, name",
    [
        ("run-42", "run-42"),
        ("a/b c", "a_b_c"),
        ("incidents", "_incidents"),
        ("INCIDENTS", "_INCIDENTS"),
        (".x", "_.x"),
        ("..", "_.."),
        ("", "_"),
    ],
)
def test_a_job_directory_name_is_never_reserved_nor_a_path(job_id, name):
    assert diagfiles.job_dir_name(job_id) == name


def test_a_directory_left_writable_by_others_is_closed(tmp_path):
    (tmp_path / "diag" / "job").mkdir(parents=True)
    (tmp_path / "diag").chmod(0o777)
    (tmp_path / "diag" / "job").chmod(0o777)
    with diagfiles.opened(tmp_path / "diag", "job"):
        pass
    assert (tmp_path / "diag").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "diag" / "job").stat().st_mode & 0o777 == 0o755


def test_a_symlinked_or_foreign_directory_is_refused(tmp_path):
    (tmp_path / "diag").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "diag" / "job").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(diagfiles.UnsafeDirectory):
        with diagfiles.opened(tmp_path / "diag", "job"):
            pass
    if os.geteuid() == 0:
        (tmp_path / "diag" / "other").mkdir()
        os.chown(tmp_path / "diag" / "other", 65534, 65534)
        with pytest.raises(diagfiles.UnsafeDirectory, match="owned by uid 65534"):
            with diagfiles.opened(tmp_path / "diag", "other"):
                pass


def test_an_atomic_write_replaces_a_planted_symlink_and_never_follows_it(tmp_path):
    target = tmp_path / "target"
    target.write_text("precious")
    d = tmp_path / "d"
    d.mkdir()
    (d / "record.json").symlink_to(target)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        diagfiles.write_atomic(fd, "record.json", b"new", 0o600)
    finally:
        os.close(fd)
    assert target.read_text() == "precious"
    assert not (d / "record.json").is_symlink() and (d / "record.json").read_text() == "new"
    assert (d / "record.json").stat().st_mode & 0o777 == 0o600
    assert os.listdir(d) == ["record.json"]  # no temporary left behind


def test_incident_files_get_the_configured_mode(tmp_path):
    settings = load_settings(overrides={"diag_dir": str(tmp_path / "diag"), "incident_file_mode": "0640"}, environ={})
    store = IncidentStore.for_settings(settings)
    store.open("job", blamed_rank=0, blame_reason="x", timeout_seconds=1.0, observe_only=True, ranks=[])
    files = list((tmp_path / "diag" / "incidents").iterdir())
    assert len(files) == 2 and all(p.stat().st_mode & 0o777 == 0o640 for p in files)
    assert (tmp_path / "diag" / "incidents").stat().st_mode & 0o022 == 0


@pytest.mark.parametrize("mode", ["0666", "0660", "0700", "0604x", "1777"])
def test_an_incident_mode_others_could_write_or_execute_is_refused(mode):
    with pytest.raises(ConfigError, match="incident_file_mode"):
        load_settings(overrides={"incident_file_mode": mode}, environ={})


def test_a_dump_file_is_read_only_while_it_is_the_file_the_sidecar_created(tmp_path):
    f = stackfiles.create(tmp_path / "diag", "job", 0, 123, os.geteuid())
    assert Path(f.path).parent == tmp_path / "diag" / "job" and Path(f.path).stat().st_mode & 0o777 == 0o600
    Path(f.path).write_text("Current thread 0x1\n")
    assert f.size() == 19 and f.read_from(8) == "thread 0x1\n"
    assert f.read_from(0, limit=7) == "Current"
    secret = tmp_path / "secret"
    secret.write_text("s3cret")
    os.unlink(f.path)
    os.symlink(secret, f.path)  # what a rank cannot do (the directory is not its), and still
    assert (f.size(), f.read_from(0)) == (0, "")
    os.unlink(f.path)
    os.link(secret, f.path)  # a different inode under the same name
    assert (f.size(), f.read_from(0)) == (0, "")


def test_a_fifo_under_the_dump_name_is_never_waited_for(tmp_path):
    f = stackfiles.create(tmp_path / "diag", "job", 0, 123, os.geteuid())
    os.unlink(f.path)
    os.mkfifo(f.path)
    start = time.monotonic()
    assert (f.size(), f.read_from(0)) == (0, "")
    assert time.monotonic() - start < 1


def test_prune_removes_only_old_empty_files_no_rank_holds(tmp_path):
    diag = tmp_path / "diag"
    held = stackfiles.create(diag, "job", 0, 1, os.geteuid())
    empty = stackfiles.create(diag, "job", 1, 2, os.geteuid())
    full = stackfiles.create(diag, "job", 2, 3, os.geteuid())
    Path(full.path).write_text("stacks")
    fresh = stackfiles.create(diag, "job", 3, 4, os.geteuid())
    old = time.time() - 2 * stackfiles.PRUNE_AFTER_SECONDS
    for f in (held, empty, full):
        os.utime(f.path, (old, old))
    assert stackfiles.prune(diag, [held.path]) == 1
    assert [os.path.exists(f.path) for f in (held, empty, full, fresh)] == [True, False, True, True]
    (diag / "incidents").mkdir()
    (diag / "gone").mkdir()
    os.utime(diag / "gone", (old, old))
    stackfiles.prune(diag, [])
    assert not (diag / "gone").exists() and (diag / "incidents").exists()
