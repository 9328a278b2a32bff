"""The bundled trainer in a worker of `python -m sidecar_trainer.launch`: torchrun's agent runs
this file as a function (`--run-path`) in a process forked from the launcher's warm server, so it
returns (or raises SystemExit with a failure's status) instead of leaving the process itself:
the agent collects each worker's result before the process exits.

multiprocessing's forkserver runs this file while it prepares its child, and that preparation sets
the child's default start method to forkserver: any process the trainer starts (a DataLoader's
workers, data.num_workers > 0) would go through it mid-bootstrap and fail. The worker gets a fresh
interpreter's default instead (fork on Linux), as under plain torchrun."""

import sys

from sidecar_trainer.__main__ import main
from trainer_hooks.warm import fresh_start_method

fresh_start_method()
code = main(sys.argv[1:])
if code:
    raise SystemExit(code)
