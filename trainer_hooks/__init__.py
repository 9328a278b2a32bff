"""Trainer hooks: push a rank's progress and metrics to the node's sidecar.

    from trainer_hooks import Monitor
    mon = Monitor()              # identity from torchrun's environment, sidecar from SIDECAR_SOCKET
    mon.step(step, loss=loss.detach(), grad_norm=gn, lr=lr, samples=64, tokens=32768, step_time_seconds=dt)
    with mon.phase("checkpoint_save", timeout=600):
        save()
    mon.event("checkpoint_saved", step=step, path=path)
    mon.close()

Standard library only; never imports torch. A call costs the training thread about a
microsecond and never blocks or raises, whatever the sidecar does. `trainer_hooks.hf`,
`trainer_hooks.lightning` and `trainer_hooks.accelerate` hold Hugging Face, Lightning and
Accelerate integrations; `trainer_hooks.distributed` forms a process group that comes back after
torchrun restarts; `python -m trainer_hooks.attach script.py` watches an unmodified script;
`environment.py` lists the environment variables.

Under torchrun, importing the hooks makes the process group that the script forms next come back
after a restart (`trainer_hooks.distributed`; `SIDECAR_ATTEMPT_STORE=0` turns it off), and turns
PyTorch's Flight Recorder on (`trainer_hooks.collectives`; `SIDECAR_COLLECTIVES=0` leaves it off).
"""

import os as _os

from trainer_hooks import collectives as _collectives
from trainer_hooks.distributed import install_when_torch_is_imported
from trainer_hooks.monitor import Monitor, Phase
from trainer_hooks.sender import HOOKS_VERSION as __version__

__all__ = ["Monitor", "Phase", "__version__"]

install_when_torch_is_imported()
if _os.environ.get("TORCHELASTIC_RUN_ID") and _os.environ.get("SIDECAR_HOOKS_DISABLED", "") in ("", "0"):
    _collectives.enable()  # the Flight Recorder on before the group forms (the user's own setting wins)
