"""The job seen across nodes. A job's ranks live on many nodes and each node's sidecar sees only
its own; the job view gives every node the job's picture during a hang, without a new central
service: one sidecar of the job (the one on rank 0's node, which rank 0's hooks name through the
job's own c10d store) aggregates small per-node reports, judges who holds the job up, and hands
every node the same verdict and job incident id.

`report.py` the per-node report and the verdict on the wire, `judge.py` the culprit rule,
`coordinator.py` the aggregating side (its books, what it holds of each job and within which bounds:
`ledger.py`), `reporter.py` the reporting side (the peer HTTP client),
`auth.py` how sidecars prove themselves to each other (HMAC with the push token, which never
leaves the node).

May import `sidecar.ranks`, `sidecar.incidents`, `sidecar.host` and the shared top-level
modules; the watchdog and the exit tracker consult it, the daemon wires it.
"""
