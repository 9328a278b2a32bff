"""The registered ranks: the wire's validation (protocol; push, the push's typed decoder; refusal,
what every parser of the wire shares; pod labels), the `Rank` model and what each pushed item
does to it, the registry table, its admission rules and refusals, and the per-rank step
counters; and how late each rank enters its groups' collectives (lateness.py: a straggler,
judged among the ranks of a job on this node).

May import `sidecar.host`, the shared top-level modules (config, metric) and the hooks' wire
contract (`trainer_hooks.wire`); never the watchdog, the exits, the collectors or the daemon.
"""
