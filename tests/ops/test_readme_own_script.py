"""README.md's "Your own script in three commands", run as written by a user without root.

The section's ```sh block is the script: every line of it runs unchanged, with bash, as a
throw-away unprivileged user (tests/support/unpriv.py) whose HOME is a fresh directory and whose working
directory is a checkout (what the commands read of one: examples/own_script.py). One line is
substituted: `pip install ...` would need the network and minutes, so it becomes a no-op, and the
user's PATH starts with a virtual environment that already holds what that install gives:
/usr/bin/python3 (the dev venv's interpreter lives under /root, which the user cannot enter), this
checkout's packages copied into its site-packages as pip copies them, the dev venv's dependencies
(torch, aiohttp, ...) through a .pth file, and the `sidecar` console script. The sidecar's TCP
port is a free one, through SIDECAR_LISTEN: the README's line keeps the default 9402, which the
sidecar of a test beside this one may hold.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import psutil
import pytest

from tests.support import ROOT, free_port, kill_tree, wait_until
from tests.support.unpriv import UNPRIV_PYTHON, User, run_as, run_as_sync, unprivileged_user, world_dir

HEADING = "## Your own script in three commands"
EXAMPLE = "examples/own_script.py"
TIMEOUT = 240  # a hang at exit (torch 2.13, gloo) is killed by the sidecar after 30 s and restarted


def section() -> str:
    text = (ROOT / "README.md").read_text()
    assert f"\n{HEADING}\n" in text, f"README.md has no section {HEADING!r}"
    return text.split(f"\n{HEADING}\n", 1)[1].split("\n## ", 1)[0]


def block(language: str) -> str:
    """The first fenced block of `language` in the section."""
    found = re.search(rf"^```{language}\n(.*?)^```$", section(), re.S | re.M)
    assert found, f"no ```{language} block under {HEADING!r}"
    return found[1]


def commands() -> str:
    """The section's shell lines, the install line made a no-op (`:`), every other one unchanged."""
    lines = block("sh").splitlines()
    installs = [i for i, line in enumerate(lines) if line.startswith("pip install ")]
    assert len(installs) == 1, f"one `pip install` line expected, got {len(installs)}"
    assert re.match(r"pip install '?\.[\[']", lines[installs[0]]), "the install is of the checkout (`pip install .`)"
    lines[installs[0]] = ": " + lines[installs[0]]
    return "\n".join(lines) + "\n"


def code(line: str) -> str:
    """A Python line without its indentation and its comment (the README's may say more)."""
    return line.split("  #", 1)[0].strip()


def test_the_sections_commands_run_the_example_and_its_python_lines_are_the_examples_own():
    script = commands()
    assert EXAMPLE in script and (ROOT / EXAMPLE).is_file()
    for needed in ("sidecar run", "-m trainer_hooks.launch", "-m trainer_hooks.attach", "sidecar status"):
        assert needed in script, needed
    example = {code(line) for line in (ROOT / EXAMPLE).read_text().splitlines()}
    shown = [code(line) for line in block("python").splitlines() if code(line) not in ("", "...")]
    assert shown and [line for line in shown if line not in example] == []


# ---------------------------------------------------------------- the run


def installed(home: Path) -> Path:
    """A virtual environment standing in for `pip install '.[trainer]'`; returns it."""
    venv = home / "venv"
    subprocess.run([UNPRIV_PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    found = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    site = Path(found.stdout.strip())
    skip = shutil.ignore_patterns("__pycache__")
    for package in ("sidecar", "trainer_hooks", "sidecar_trainer"):  # sidecar/assets' links followed, as pip does
        shutil.copytree(ROOT / package, site / package, ignore=skip)
    dev = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "dev-dependencies.pth").write_text("".join(f"{path}\n" for path in dev))
    console = venv / "bin" / "sidecar"
    console.write_text(f"#!{venv}/bin/python\nimport sys\nfrom sidecar.cli import main\n\nsys.exit(main())\n")
    console.chmod(0o755)
    return venv


def rank_rows(status: str) -> dict[int, dict[str, str]]:
    """`sidecar status`'s Ranks table: rank -> {column: value} for its first five columns."""
    lines = status.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("Ranks:"))
    header = lines[at + 1].split()
    assert header[:5] == ["JOB", "RANK", "PID", "STATE", "STEP"], f"no ranks:\n{lines[at]}\n{lines[at + 1]}"
    rows = {}
    for line in lines[at + 2 :]:
        if not line.strip():
            break
        values = dict(zip(header[:5], line.split()[:5], strict=True))
        rows[int(values["RANK"])] = values
    return rows


def processes_of(user: User) -> list[psutil.Process]:
    """The throw-away user's live processes: only this test starts any (the README's lines)."""
    return [
        p
        for p in psutil.process_iter(["uids", "status"])
        if p.info["uids"] and p.info["uids"].real == user.uid and p.info["status"] != psutil.STATUS_ZOMBIE
    ]


def stop(proc: subprocess.Popen, user: User) -> None:
    """The script's tree, then what left it (the background sidecar, once bash has exited)."""
    kill_tree(proc)
    for leftover in processes_of(user):
        with contextlib.suppress(psutil.Error):
            leftover.kill()


@pytest.mark.slow
def test_the_readme_commands_train_an_unmodified_script_as_a_user_and_status_shows_its_ranks():
    user = unprivileged_user("own")
    same = f"import sys; sys.exit(sys.version_info[:2] != {sys.version_info[:2]})"
    if subprocess.run([UNPRIV_PYTHON, "-c", same]).returncode:
        pytest.skip(f"{UNPRIV_PYTHON} is not Python {sys.version_info[0]}.{sys.version_info[1]}, the dev venv's")
    home = world_dir()
    proc = None
    try:
        venv = installed(home)
        checkout = home / "checkout"
        (checkout / EXAMPLE).parent.mkdir(parents=True)
        shutil.copy(ROOT / EXAMPLE, checkout / EXAMPLE)
        script = home / "readme.sh"
        script.write_text(commands())
        subprocess.run(["chown", "-R", f"{user.uid}:{user.gid}", str(home)], check=True)
        env = {"PATH": f"{venv}/bin:/usr/local/bin:/usr/bin:/bin", "HOME": str(home)}
        probe = run_as_sync(user, [f"{venv}/bin/python", "-c", "import torch"], env=env)
        if probe.returncode:
            pytest.skip(f"the dev venv's packages cannot be read by another user: {probe.stderr.strip()[-300:]}")

        env["SIDECAR_LISTEN"] = f"127.0.0.1:{free_port()}"
        started = time.monotonic()
        proc = run_as(
            user,
            ["bash", "-e", "-x", str(script)],
            env=env,
            cwd=checkout,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            out, err = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            stop(proc, user)
            out, err = proc.communicate()
            pytest.fail(f"the README's commands ran past {TIMEOUT}s\nstdout:\n{out[-6000:]}\nstderr:\n{err[-6000:]}")
        said = f"stdout:\n{out[-6000:]}\nstderr:\n{err[-6000:]}"
        assert proc.returncode == 0, said

        # the two ranks share torchrun's stdout: one's line may run into the other's (make test-under-load)
        trained = dict(re.findall(r"rank (\d+): trained (\d+) steps", out))
        assert sorted(trained) == ["0", "1"], said
        steps = int(trained["0"])
        assert steps > 0 and int(trained["1"]) == steps, said
        ranks = rank_rows(out)
        assert sorted(ranks) == [0, 1], said
        assert {r["STEP"] for r in ranks.values()} == {str(steps)}, said  # the sidecar saw every step
        assert len({r["JOB"] for r in ranks.values()}) == 1, said
        # The README's last line stopped the sidecar: it removed its socket, no process of the user is left.
        assert not (home / ".sidecar" / "sidecar.sock").exists(), said
        assert (home / ".sidecar" / "diag").is_dir()
        wait_until(lambda: processes_of(user) == [], timeout=10, what="the user's processes to end")
        print(f"README commands ran in {time.monotonic() - started:.1f}s")
    finally:
        if proc is not None:
            stop(proc, user)
        shutil.rmtree(home, ignore_errors=True)


def test_rank_rows_reads_the_status_table():
    status = (
        "Ranks:\n"
        "JOB   RANK  PID   STATE  STEP  STEP TIME  IT/S\n"
        "j-1   0     2303  gone   300   0.00s      1.09e+03\n"
        "j-1   1     2304  gone   299   0.00s      1.48e+03\n"
        "\n"
        "Jobs across nodes:\n"
    )
    assert rank_rows(status) == {
        0: {"JOB": "j-1", "RANK": "0", "PID": "2303", "STATE": "gone", "STEP": "300"},
        1: {"JOB": "j-1", "RANK": "1", "PID": "2304", "STATE": "gone", "STEP": "299"},
    }
