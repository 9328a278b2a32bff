"""Incident records on disk: what the watchdog saw and did about a stall, and which exits a job
suffered, as JSON plus a summary for people, written so that no rank can redirect the write.

May import `sidecar.host` and the shared top-level modules only: the watchdog and the exit
tracker both write incidents, and `sidecar incidents` reads them.
"""
