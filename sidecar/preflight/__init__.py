"""`sidecar preflight`: check a node before a training job starts on it.

`facts` reads the node, `gpu_checks` and `node_checks` judge it, `peers` compares versions
with other nodes' sidecars, `results` holds what a check returns, `cli` runs them all.

Beside the daemon at the top of the layers: may import the commands (the HTTP client and the
verdict, to ask peers), the rooms below them and the shared top-level modules; never the daemon.
"""
