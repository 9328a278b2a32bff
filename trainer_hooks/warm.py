"""Warm restarts for any script (issue 32, item 3): `python -m trainer_hooks.launch --warm`.

torchrun starts every worker of every attempt as a new interpreter, which imports torch (and,
at the first optimizer step, torch._dynamo) again: seconds of every restart. In warm mode the
launcher runs torchrun with `--run-path --start-method forkserver` and this file as the script:
multiprocessing's forkserver imports PRELOAD (and `--preload`) once, when the first attempt
starts, and every worker of every attempt is a fork of it that runs the user's script as
`python script.py` would (`run_worker`):

- a new process per worker and attempt, so fresh globals and module state: the script runs as a
  new `__main__` module (`__name__`, `__file__` absolute, `__spec__` None), `sys.argv` =
  [script as given, *args], `sys.path[0]` = the script's directory (`-m module`: the working
  directory), `python -m module` semantics through `runpy.run_module`;
- the environment torchrun gives the worker (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT,
  TORCHELASTIC_RESTART_COUNT, ...), set by torch's agent before the script starts; what
  `import trainer_hooks` does with it (the per-attempt store, the Flight Recorder) is done again
  per worker, as the server imported the hooks without it; so every worker gets it, also one
  whose script never imports the hooks (its restarted group forms: under plain torchrun about
  half do not; SIDECAR_ATTEMPT_STORE=0 and SIDECAR_COLLECTIVES=0 turn them off);
- multiprocessing's default start method a fresh interpreter has (`fresh_start_method`), not the
  server's: a DataLoader's workers fork from the worker as under plain torchrun;
- the exit: an exception or `sys.exit(n)` (n != 0) fails the worker as under plain torchrun (the
  traceback on stderr, exit status 1 or n); `sys.exit()` / `sys.exit(0)` is a success (torch's
  `--run-path` alone would hang its agent on `sys.exit()`); atexit handlers run at the end;
- CUDA never initialised before the fork: the server only imports; a worker forked from a server
  in which a preloaded module initialised CUDA refuses to run (exit 1, naming the cause). A
  module that calls `torch.cuda.is_available()` at import initialises the driver without torch
  knowing (set PYTORCH_NVML_BASED_CUDA_CHECK=1, or leave it out of `--preload`).

What differs from a fresh interpreter: the preloaded modules were imported once, with the
environment of torchrun's agent (a module that reads a worker's variable at import time reads
the agent's), and the worker's stdin is /dev/null (the forkserver closes it).
"""

from __future__ import annotations

import atexit
import builtins
import importlib.machinery
import importlib.util
import io
import os
import runpy
import sys
import traceback
import types
from pathlib import Path

PRELOAD = ["torch", "torch._dynamo", "torch.nn.parallel", "trainer_hooks", "trainer_hooks.warm"]
WORKER = str(Path(__file__).resolve())  # torchrun's `--run-path` script in every worker
ENV = "SIDECAR_WARM"  # 1: warm mode without the option


def env_on(environ: dict[str, str] | None = None) -> bool:
    value = (os.environ if environ is None else environ).get(ENV, "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


def preload_list(extra: list[str]) -> list[str]:
    """PRELOAD and the comma-separated names of `--preload` (each once, in order)."""
    names = [*PRELOAD]
    for item in extra:
        names += [n.strip() for n in item.split(",") if n.strip()]
    return list(dict.fromkeys(names))


def missing_module(names: list[str]) -> str | None:
    """The first of `names` that cannot be imported here (not found), else None."""
    for name in names:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except (ImportError, ValueError):
            return name
    return None


def interpreter_problem(version: tuple | None = None, platform: str | None = None) -> str | None:
    """Why warm workers must not be forked from this interpreter, else None. CPython 3.9.0-3.9.15
    and 3.10.0-3.10.8 on Linux bind multiprocessing's forkserver to an abstract Unix socket, which
    any local user can connect to and have run code in the job (CVE-2022-42919)."""
    platform = sys.platform if platform is None else platform
    major, minor, micro = (tuple(sys.version_info if version is None else version) + (0, 0, 0))[:3]
    fixed = {(3, 9): 16, (3, 10): 9}.get((major, minor))
    if platform.startswith("linux") and fixed is not None and micro < fixed:
        return (
            f"--warm refused on Python {major}.{minor}.{micro}: its forkserver listens on an abstract socket "
            f"any local user can use (CVE-2022-42919); use {major}.{minor}.{fixed} or later, or start without --warm"
        )
    return None


def target_problem(module: bool, script: str) -> str | None:
    """Why the script (or `-m` module) cannot be run, else None."""
    if module:
        return None if missing_module([script]) is None else f"no module named {script!r}"
    if not os.path.isfile(script):
        return f"no such script: {script}" + (" (a directory: name its file)" if os.path.isdir(script) else "")
    return None


def run_worker(target: list[str]) -> None:
    """A worker's whole life: `target` is [script, *args] or ["-m", module, *args]."""
    torch = sys.modules.get("torch")
    bad_fork = getattr(getattr(torch, "cuda", None), "_is_in_bad_fork", None)
    if bad_fork is not None and bad_fork():
        raise SystemExit(
            "trainer_hooks.launch --warm: CUDA was initialised in the warm server before the fork "
            "(by a --preload module?); workers cannot use it: preload modules that do not touch the GPU"
        )
    _replay_hooks_import()
    fresh_start_method()
    try:
        if target[0] in ("-m", "--module"):
            module, args = target[1], target[2:]
            sys.argv = [module, *args]
            if not getattr(sys.flags, "safe_path", False):
                sys.path[0] = os.getcwd()
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            _run_file(target[0], target[1:])
    except SystemExit as e:
        if e.code is not None and e.code != 0:
            raise
    except BaseException:
        traceback.print_exc()  # as the interpreter prints an uncaught exception
        raise
    finally:
        sys.stdout.flush()
        atexit._run_exitfuncs()


def fresh_start_method() -> None:
    """multiprocessing's default start method as a fresh interpreter has it. The forkserver's child
    inherits `forkserver` as its default, so a DataLoader's workers would start through the server
    and import the script again as `__mp_main__`: its top-level code runs in every data worker, and
    a script without an `if __name__ == "__main__"` guard fails there."""
    import multiprocessing

    multiprocessing.set_start_method(None, force=True)


def _run_file(script: str, args: list[str]) -> None:
    path = os.path.abspath(script)
    if not getattr(sys.flags, "safe_path", False):
        sys.path[0] = os.path.dirname(path)
    sys.argv = [script, *args]
    main = types.ModuleType("__main__")  # as the interpreter makes it for `python script.py`
    loader = importlib.machinery.SourceFileLoader("__main__", path)
    main.__dict__.update(__file__=path, __cached__=None, __loader__=loader, __builtins__=builtins)
    sys.modules["__main__"] = main
    with io.open_code(path) as f:
        # PEP 263 coding cookies as the interpreter reads them; none of this module's __future__ flags
        code = compile(f.read(), path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def _replay_hooks_import() -> None:
    """What `import trainer_hooks` does under torchrun (trainer_hooks/__init__.py), now that the
    worker has torchrun's environment: the server imported the hooks without it."""
    if "trainer_hooks" not in sys.modules:
        return
    from trainer_hooks import collectives, distributed

    distributed.install_when_torch_is_imported()
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("SIDECAR_HOOKS_DISABLED", "") in ("", "0"):
        collectives.enable()


if __name__ == "__main__":  # run by torchrun's `--run-path` in a worker forked from the server
    from trainer_hooks.warm import run_worker as _run

    _run(sys.argv[1:])
