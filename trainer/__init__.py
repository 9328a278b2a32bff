"""The bundled distributed trainer: DDP or FSDP2 under torchrun, atomic checkpoints, exact resume,
fault injection for the watchdog's tests. Entry point: `python -m trainer` (see trainer/__main__.py)."""
