"""The bundled trainer in a worker of `python -m sidecar_trainer.launch`: torchrun's agent runs
this file as a function (`--run-path`) in a process forked from the launcher's warm server, so it
returns (or raises SystemExit with a failure's status) instead of leaving the process itself:
the agent collects each worker's result before the process exits."""

import sys

from sidecar_trainer.__main__ import main
from trainer_hooks.warm import fresh_start_method

fresh_start_method()  # its DataLoader's workers fork from it, as under plain torchrun
code = main(sys.argv[1:])
if code:
    raise SystemExit(code)
