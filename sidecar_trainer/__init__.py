"""The bundled distributed trainer: DDP or FSDP2 under torchrun, atomic checkpoints, exact resume,
fault injection for the watchdog's tests. Entry point: `python -m sidecar_trainer` (see sidecar_trainer/__main__.py)."""
