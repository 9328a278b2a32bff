"""The hardware collectors (gpu, nic, process, node): one module per collector, each defining
`NAME`, `METRICS` and `build(context)`; `config.COLLECTORS` is the one list of them, which the
settings, `factory.py` (builds the enabled ones) and the metrics reference read; `base.py` the
interface and the background runner that samples them.

May import `sidecar.host` and the shared top-level modules (config, metric); never the ranks, the
watchdog, the exits or the daemon: a collector learns what it needs of the ranks through the
functions its `BuildContext` hands it.
"""
