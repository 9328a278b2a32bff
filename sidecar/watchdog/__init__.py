"""The progress watchdog: the per-rank state machine (`machine.py`, its states `states.py`), one
stall's episode from blame to its end (`episode.py`; how it opens and which way it goes:
`episode_course.py`), stack probes and this node's report of a job
(`probes.py`), the timeout policy, who is blamed for a stall, the storm cap, and remediation (stack
dumps, then SIGTERM and SIGKILL of the hung worker group; what outlives the SIGKILL is
`unkillable.py`'s).

May import `sidecar.ranks`, `sidecar.incidents`, `sidecar.host` and the shared top-level modules;
never the exits (the daemon wires the two together through a callback) or the daemon.
"""
