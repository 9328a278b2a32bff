"""Trainer hooks: push a rank's progress and metrics to the node's sidecar.

Standard library only; never imports torch. See `Monitor`, and `trainer_hooks.hf` /
`trainer_hooks.lightning` for Hugging Face and Lightning callbacks.
"""
from trainer_hooks.monitor import Monitor, Phase
from trainer_hooks.sender import HOOKS_VERSION as __version__

__all__ = ["Monitor", "Phase", "__version__"]
