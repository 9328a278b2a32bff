"""Warm ranks for the suite's warm torchrun agents: workers forked from a process that imported torch.

A rank started as torchrun starts it (`python -u script.py ...`, a new interpreter) spends about
2.4 CPU-s importing torch before its script does anything, and the suite starts hundreds
(CONTRIBUTING.md, "The suite"). A torchrun agent forked by `harness/zygote.py` has torch imported already; before
torchrun's code runs (one thread, nothing of torchrun's own started), `install` forks it into a
rank server (`zygote.serve`, the agent its owner) and routes torchrun's worker start
(`SubprocessHandler._popen`, where torchrun calls `subprocess.Popen`) there. For each worker the
server forks a child that becomes the worker: a session of its own as torchrun asks
(`start_new_session`), the output files torchrun opened for it (or the agent's), the agent's
directory, torchrun's environment for the worker, `sys.path` as `python script.py` (or `-m
module`) makes it, unbuffered output as `-u` makes it, signals as a new interpreter has them, and
then the script run as `__main__`; it ends as an interpreter ends (non-daemon threads joined,
`atexit` run, output flushed) with the exit status a new interpreter would give. Everything around
it is torchrun's own: the worker's pid, process group, signals, exit status, failure and the
restart of the group (the rank is the agent's grandchild, as under torchrun's `forkserver` start
method).

What differs from a cold worker: torch and torchrun's modules were imported once, with the
server's environment, so a worker whose environment differs in what is read at import
(`PYTHON*` but PYTHONPATH, `TORCH*`/`PYTORCH*` but the variables below that torch reads when it
uses them, the thread and log settings) is started cold, as is one whose PYTHONPATH holds a
`sitecustomize` or `usercustomize` (they run at an interpreter's start: zero-code attach), one
run by another executable (PYTHON_EXEC) or without `-u`. Also different, and read by nothing the
suite runs: the worker's command line and `/proc/<pid>/environ` are the server's; its parent is the
rank server, not the agent (both end together); str hashes use the server's secret; a stack dump
shows the server's frames under the script's; and at its end the worker skips the interpreter's
last step, freeing its modules (no `__del__`, and a buffered file left open in a global is not
flushed), since that step is where a DDP model's gloo threads would deadlock outside finalization.
`SIDECAR_TEST_COLD_RANKS=1` in an agent's environment starts its workers cold;
`tests/test_warm_agents.py` compares the two.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import importlib.machinery
import io
import os
import runpy
import signal
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from harness import zygote

COLD_ENV = "SIDECAR_TEST_COLD_RANKS"
# Read by torch or torchrun when used, not at import: torchrun's worker environment and the suite's.
LAZY = ("TORCHELASTIC_", "TORCH_FR_", "TORCH_NCCL_", "PYTORCH_NVML_BASED_CUDA_CHECK")  # the last: Lightning sets it
# Read at import, applied to the forked worker as torch would have at import: OMP_NUM_THREADS (torchrun
# sets it to 1 for more than one worker a node) becomes torch's intra-op thread count.
THREADS = "OMP_NUM_THREADS"
# Read at import (by torch, its OpenMP runtime, Python itself), or when the process starts (the dynamic
# loader's LD_PRELOAD, harness/node_clock.c's offset): a worker whose value differs starts cold.
AT_IMPORT = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "GOMP_", "LOGLEVEL", "LD_", "NODE_CLOCK_")
CUSTOMIZE = ("sitecustomize.py", "usercustomize.py")


def install(directory: str) -> None:
    """In a warm agent before torchrun runs: fork its rank server, and start torchrun's workers there."""
    if os.environ.get(COLD_ENV, "") not in ("", "0"):
        return
    path, server = start_server(directory)
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    handler = subprocess_handler.SubprocessHandler
    cold = handler._popen

    def _popen(self: Any, args: tuple, env: dict[str, str]) -> Any:
        why = refusal(args, env)
        if why is None:
            files = {name: getattr(f, "name", None) for name, f in (("stdout", self._stdout), ("stderr", self._stderr))}
            proc = spawn(path, args, env, files, alive=lambda: not ended(server))
            if proc is not None:
                return proc
            why = "the rank server did not answer"
        print(f"harness.zygote_ranks: worker {self.local_rank_id} started cold: {why}", file=sys.stderr, flush=True)
        return cold(self, args, env)

    handler._popen = _popen  # type: ignore[method-assign]


def start_server(directory: str) -> tuple[str, int]:
    """Fork this process's rank server (in a session of its own: a signal to this process's group
    is not for it; it ends with this process): the path of its socket, its pid."""
    path = os.path.join(directory, f"ranks-{os.getpid()}.sock")
    pid = os.fork()
    if pid == 0:
        os.setsid()
        request = zygote.serve(path, (), lambda r: None, keep=True)  # the agent asks only after refusal()
        run(request)
    return path, pid


def ended(pid: int) -> bool:
    """Whether this process's child `pid` has ended (and is reaped now)."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:
        return True


def refusal(args: Sequence[str], env: dict[str, str]) -> str | None:
    """Why this worker must start as a new interpreter, else None."""
    args = list(args)
    if len(args) < 3 or args[0] != sys.executable or args[1] != "-u" or (args[2] == "-m" and len(args) < 4):
        return f"not `{sys.executable} -u SCRIPT|-m MODULE`"
    if args[2].startswith("-") and args[2] != "-m":
        return f"interpreter option {args[2]}"
    imported = zygote.IMPORTED_WITH
    keys = {k for k in (*env, *imported) if k.startswith(AT_IMPORT) and not k.startswith(LAZY)}
    keys -= {"PYTHONPATH", "PYTHONUNBUFFERED", THREADS}
    if not env.get(THREADS, "1").isdigit() or int(env.get(THREADS, "1")) < 1:
        return f"{THREADS}={env[THREADS]!r}"
    set_by_import = zygote.SET_BY_IMPORT  # what a new interpreter's imports would set too
    differ = sorted(
        k
        for k in keys
        if env.get(k) != imported.get(k)
        and not (k in set_by_import and env.get(k, set_by_import[k]) == set_by_import[k])
    )
    if differ:
        return f"read at import: {','.join(differ)}"
    for entry in env.get("PYTHONPATH", "").split(os.pathsep):
        if entry and any(os.path.exists(os.path.join(entry, name)) for name in CUSTOMIZE):
            return f"{entry} holds a site customisation (run at an interpreter's start)"
    return None


def spawn(
    path: str, args: Sequence[str], env: dict[str, str], files: dict[str, str | None], alive: Callable[[], bool]
) -> Any:
    """The worker forked by the rank server at `path` (while it is `alive`), or None if it did not answer."""
    sock = zygote.connect(path, 10, alive)
    if sock is None:
        return None
    return zygote.ask(sock, {"argv": list(args), "env": dict(env), "cwd": os.getcwd(), **files})


def run(request: dict) -> NoReturn:
    """In the forked worker: become it, run its script or module as `__main__`, end as an interpreter ends."""
    for fd, key in ((1, "stdout"), (2, "stderr")):
        if request.get(key):
            out = os.open(request[key], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(out, fd)
            os.close(out)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in zygote.SET_BY_IMPORT.items():  # as the imports of a new interpreter set them
        os.environ.setdefault(key, value)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)  # a new interpreter's: nothing of the server's or the agent's
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get(THREADS) != zygote.IMPORTED_WITH.get(THREADS):
        import torch

        torch.set_num_threads(int(os.environ.get(THREADS) or os.cpu_count() or 1))
    std_out, std_err = sys.__stdout__, sys.__stderr__  # the server's: the same locale and PYTHONIOENCODING
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False),
        encoding=getattr(std_out, "encoding", None),
        errors=getattr(std_out, "errors", None),
        write_through=True,
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False),
        encoding=getattr(std_err, "encoding", None),
        errors="backslashreplace",
        write_through=True,
    )
    if "numpy" in sys.modules:  # numpy seeds its global generator at import; a fork shares the server's
        sys.modules["numpy"].random.seed()
    argv = request["argv"]
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    # The code runs in a new `__main__` module that stays until the process ends, as in an interpreter:
    # runpy's run_path/run_module free their temporary module on return, and with it a DDP model,
    # whose gloo group's destructor then waits, holding the GIL, for a thread that needs it.
    sys.modules["__main__"] = main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    code = 0
    try:
        if argv[2] == "-m":
            sys.path[:] = [os.getcwd(), *extra, *zygote.BASE_PATH]
            sys.argv = [argv[3], *argv[4:]]
            runpy._run_module_as_main(argv[3], alter_argv=True)  # type: ignore[attr-defined]  # what `python -m` runs
        else:
            sys.path[:] = [os.path.dirname(os.path.realpath(argv[2])), *extra, *zygote.BASE_PATH]
            sys.argv = list(argv[2:])
            _run_script(main, argv[2])
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException as error:
        _excepthook(error)
        code = 1
        if isinstance(error, KeyboardInterrupt):  # as CPython: die of the signal (130 if it is blocked)
            _finish()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
            code = 130
    _finish()
    os._exit(code)


def _excepthook(error: BaseException) -> None:
    """The uncaught exception printed as an interpreter prints it: the traceback from the script on."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    try:
        sys.excepthook(type(error), error, tb)
    except BaseException:  # a script's own hook that fails: the interpreter's default
        sys.__excepthook__(type(error), error, tb)


def _run_script(main: types.ModuleType, script: str) -> None:
    """`python script`: the file's code run in `__main__`, with its absolute `__file__` and a source
    loader, compiled with none of this module's `__future__` flags (`dont_inherit`)."""
    path = os.path.abspath(script)
    try:
        with io.open_code(path) as f:
            source = f.read()
    except OSError as e:
        print(f"{sys.executable}: can't open file {path!r}: [Errno {e.errno}] {e.strerror}", file=sys.stderr)
        raise SystemExit(2) from None
    loader = importlib.machinery.SourceFileLoader("__main__", path)
    main.__dict__.update(__file__=path, __cached__=None, __loader__=loader, __spec__=None, __package__=None)
    exec(compile(source, path, "exec", dont_inherit=True), main.__dict__)


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    with contextlib.suppress(Exception):
        print(value, file=sys.stderr)
    return 1


def _finish() -> None:
    """What an interpreter does at its end: join non-daemon threads, run atexit, flush output."""
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
