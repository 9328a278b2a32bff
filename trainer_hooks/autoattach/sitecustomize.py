"""Zero-code attach by environment: with this directory on PYTHONPATH and SIDECAR_ATTACH=1, every
torchrun worker (a process with TORCHELASTIC_RUN_ID and RANK) is attached at interpreter start,
as `python -m trainer_hooks.attach` would attach it; every other process is left alone.

    export SIDECAR_ATTACH=1 PYTHONPATH="$(python -m trainer_hooks.attach --pythonpath)${PYTHONPATH:+:$PYTHONPATH}"
    torchrun --standalone --nproc-per-node 8 --max-restarts 3 train.py

Python imports one `sitecustomize` module; the next one on sys.path (a distribution's own) runs
after this one. Processes the worker starts (DataLoader workers) inherit the environment but do
not attach again (SIDECAR_ATTACHED_PID names the attached process).
"""

import importlib.machinery
import importlib.util
import os
import sys


def _attach() -> None:
    env = os.environ
    if (
        env.get("SIDECAR_ATTACH", "").strip().lower() not in ("1", "true", "yes", "on")
        or "TORCHELASTIC_RUN_ID" not in env
        or "RANK" not in env
        or env.get("SIDECAR_ATTACHED_PID")
    ):
        return
    env["SIDECAR_ATTACHED_PID"] = str(os.getpid())
    try:
        from trainer_hooks.attach import attach

        attach()
    except Exception as e:  # never in the way of training
        print(f"trainer_hooks: SIDECAR_ATTACH: not attached ({type(e).__name__}: {e})", file=sys.stderr)


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or os.curdir) == here:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            # changes: sitecustomize (docs/changes-to-others.md)
            spec.loader.exec_module(module)
            return


_attach()
_chain()
