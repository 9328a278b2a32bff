"""Hang -> kill -> restart cycles on real torchrun: user-shaped training scripts (plain, Hugging
Face Trainer, Lightning) that hang on purpose, and the driver that runs them next to a sidecar
(`runner.py`). Used by `bench/bench_cycles.py` and `tests/recovery/`."""
