"""bench_field_pauses: healthy jobs with the pauses real jobs have, and real hangs, under a real sidecar.

`loop.py` is the user's side (a DDP training loop that pauses and hangs as jobs in the field do),
`train_*.py` the scripts of each integration (HF and Lightning pause in their own evaluation),
`environment.py` the slow storage and the cgroups, `job.py` runs one job next to a sidecar and reads
what the watchdog did.
"""
