"""The command-line tools beside the daemon: `sidecar status` (its HTTP client and the verdict),
`sidecar incidents`, `sidecar provision` (Grafana, and the payloads it sends), `sidecar
deploy-gen`, `sidecar config-doc`, and the generated-file helpers they share.

May import the shared top-level modules, `sidecar.incidents` and `sidecar.assets`; never the
daemon, so that a command never pays for the server's imports.
"""
