"""The daemon (`sidecar run`): the aiohttp application and its handlers, what `/metrics` answers,
the `/v1/status` document, and the metrics reference of everything the daemon exports.

The top room: it assembles every other concern (ranks, collectors, watchdog, exits) and may
import any of them; nothing imports it but the command line.
"""
