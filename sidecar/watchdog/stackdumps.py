"""Stack dumps of hung ranks: asking a rank for its Python stacks (faulthandler through the
hooks, py-spy run by the sidecar itself), and reading what they show (the main thread, the
first lines, whether the rank waits in a collective). Attribution (`sidecar/watchdog/attribution.py`)
and the incident records (`sidecar/incidents/store.py`) use what this module reads."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import shutil
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from sidecar.host.signals import Target, send
from sidecar.host.stackfiles import MAX_STACK_BYTES, StackFile
from sidecar.incidents.store import STACK_HEAD_LINES
from sidecar.watchdog.frames import Frames, first, label, matches, parse

# Frames of a rank that waits for its peers: inside torch.distributed (faulthandler:
# `File ".../torch/distributed/x.py"`, py-spy: `all_reduce (torch/distributed/x.py:12)`), and
# autograd's backward, where DDP waits for its gradient all-reduce. Only the innermost run of
# torch's own frames counts (what the rank is blocked in): torchrun's launcher and elastic's
# `@record` wrapper sit at the bottom of every rank's stack (a worker forked by
# `sidecar_trainer.launch` runs the script from torch/distributed/run.py), and say nothing.
COLLECTIVE_FRAME = re.compile(r"torch[/\\]distributed[/\\]|_engine_run_backward")
LAUNCHER_FRAME = re.compile(r"torch[/\\]distributed[/\\](elastic[/\\]|run\.py|launch\.py)")
TORCH_FRAME = re.compile(r"(^|[/\\])torch[/\\]")

# A thread's part of a dump begins at one of these: faulthandler's headers (the hooks' dump of the
# thread the signal landed on, the main thread: "Stack (most recent call first):"; of every thread:
# "Current thread 0x..." and "Thread 0x...") and py-spy's ("Thread 123 (idle): "MainThread"").
# A file read from its size before a look can hold more than one dump: each starts a part.
_THREAD_START = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+|^Thread \d+ |^Stack \(most recent call first\)", re.M)
_MAIN_THREAD = re.compile(r'^Current thread 0x|^Thread \d+ .*"MainThread"|^Stack \(most recent call first\)', re.M)


def main_thread(text: str) -> str:
    """The main thread's part of a stack dump (the whole text when it cannot be told)."""
    found = _MAIN_THREAD.search(text)
    if not found:
        return text
    following = _THREAD_START.search(text, found.end())
    return text[found.start() : following.start() if following else len(text)]


def stack_head(text: str, lines: int = STACK_HEAD_LINES) -> list[str]:
    """The first lines of a dump, main thread first: that is where a hang shows. Split on line
    feeds only: a carriage return or form feed the rank wrote stays inside its line (and is
    escaped when printed), never starts a line of the incident."""
    main = main_thread(text)
    ordered = main + ("\n" + text.replace(main, "", 1) if main != text else "")
    return [line.rstrip() for line in ordered.split("\n") if line.strip()][:lines]


def frames(text: str) -> list[str]:
    """Each frame of a dump (faulthandler's or py-spy's) as `file func`, innermost first."""
    return [f"{m['file']} {m['func']}" for m in matches(text)]


def main_frames(text: str) -> Frames:
    """The main thread's frames of a dump as (file, function, line), innermost first (empty
    without a dump or frames): what tells whether a rank's stack moved between two looks
    (liveness.py)."""
    return parse(main_thread(text)) if text.strip() else ()


def stack_top(text: str) -> str | None:
    """The innermost frame of the main thread, as `func (file:line)`; None without a dump. Both
    faulthandler and py-spy list the most recent call first."""
    top = first(main_thread(text)) if text.strip() else None
    return None if top is None else label(*top)


def in_collective(text: str) -> bool | None:
    """Whether a stack dump shows the rank's main thread waiting for its peers (inside
    torch.distributed or DDP's backward); None without a dump."""
    if not text.strip():
        return None
    main = main_thread(text)
    listed = frames(main)
    if not listed:  # a format without frames we can read: anything torch.distributed's
        return bool(COLLECTIVE_FRAME.search(main))
    innermost = itertools.takewhile(TORCH_FRAME.search, listed)
    return any(COLLECTIVE_FRAME.search(f) and not LAUNCHER_FRAME.search(f) for f in innermost)


def file_size(stack_file: StackFile | None) -> int:
    return stack_file.size() if stack_file is not None else 0


def file_sizes(targets: list[Target]) -> list[int]:
    """The dump file size of each target, in one executor call however many there are."""
    return [file_size(t.stack_file) for t in targets]


def py_spy_path() -> str | None:
    """py-spy on PATH or next to this Python (a virtual environment's bin/)."""
    found = shutil.which("py-spy")
    if found:
        return found
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else None


async def py_spy_dump(pid: int, timeout: float, nonblocking: bool) -> str:
    """`py-spy dump --pid`: its output, or one line saying why there is none."""
    exe = py_spy_path()
    if exe is None:
        return ""
    cmd = [exe, "dump", "--pid", str(pid)] + (["--nonblocking"] if nonblocking else [])
    try:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
    except OSError as e:
        return f"py-spy could not start: {e}"
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return f"py-spy gave no answer within {timeout:.0f}s"
    text = out.decode(errors="replace")[:MAX_STACK_BYTES]
    return text if proc.returncode == 0 else f"py-spy failed (exit {proc.returncode}): {text.strip()[:300]}"


def ask_for_stacks(target: Target, stack_signal: int, stopped: bool) -> None:
    send(target, stack_signal, "process")
    if stopped:  # a stopped process runs no handler: continue it; stop_again_after_dump() stops it again
        send(target, signal.SIGCONT, "process")


async def wait_until_written(
    files: Sequence[StackFile | None],
    sizes_before: Sequence[int],
    *,
    still_for: float,
    at_most: float,
    poll: float,
    writers_at_rest: Callable[[], bool] | None = None,
) -> bool:
    """Wait until every file has grown past its size before and then kept one size for
    `still_for` seconds (its writer is done), or `at_most` seconds. With `writers_at_rest`,
    one poll of the same size is enough when it says the writers are idle (`procs.at_rest`): no
    handler is still writing. True when they settled."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + at_most
    last: list[int] | None = None
    still_since: float | None = None

    def look() -> tuple[list[int], bool]:  # one executor hop for the sizes and the writers
        sizes = [file_size(f) for f in files]
        return sizes, writers_at_rest is not None and sizes == last and writers_at_rest()

    while loop.time() < deadline:
        sizes, resting = await loop.run_in_executor(None, look)
        grown = all(size > before for size, before in zip(sizes, sizes_before, strict=True))
        if grown and sizes == last:
            if still_since is None:
                still_since = loop.time()
            if resting or loop.time() - still_since >= still_for:
                return True
        else:
            still_since = None
        last = sizes
        await asyncio.sleep(poll)
    return False


# A stopped rank is continued only until its dump is written: faulthandler writes the whole
# dump from inside its signal handler, so the file growing and then holding still for a few
# milliseconds means the handler has returned (or is about to), and the rank is stopped again
# after at most STOPPED_RUN_MAX_SECONDS of running.
STOPPED_DUMP_STILL_SECONDS = 0.02
STOPPED_RUN_MAX_SECONDS = 1.0


async def stop_again_after_dump(target: Target, size_before: int) -> None:
    """SIGSTOP a rank that was stopped before and continued for its dump, once the dump is written."""
    await wait_until_written(
        [target.stack_file],
        [size_before],
        still_for=STOPPED_DUMP_STILL_SECONDS,
        at_most=STOPPED_RUN_MAX_SECONDS,
        poll=0.005,
    )
    await asyncio.get_running_loop().run_in_executor(None, send, target, signal.SIGSTOP, "process")
