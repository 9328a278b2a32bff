"""Whether killing a hung rank leads anywhere: its launcher restarts the worker group (torchrun
with restarts left), or nothing does (no launcher, or torchrun's --max-restarts used up), and
the kill would turn a hang into a failed job without saying so.

The rank says which at registration (the `launcher` of the wire protocol, from torchrun's
TORCHELASTIC_* variables). What it cannot see, it does not claim: a rank of hooks that do not
say (protocol 1) or a torchrun that did not give its budget counts as restartable, as before.
A pod restart policy above torchrun (PyTorchJob `restartPolicy: OnFailure`, JobSet
`maxRestarts`) is invisible to the rank: `remediation.kill_without_restart` is the operator's
switch for that, and for those who want a hung job to fail fast and free its GPUs.
"""

from __future__ import annotations

from collections.abc import Iterable

from sidecar.ranks.model import Rank

# The remediation outcome of a stall the watchdog left alive because nothing would restart it.
NOT_KILLED_NO_RESTART = "not_killed_no_restart"


def no_restart_reason(rank: Rank) -> str | None:
    """Why nothing restarts this rank once killed, or None when its launcher will (or it did not say)."""
    launcher = rank.launcher
    if launcher is None:
        return None
    if launcher.name == "none":
        return f"rank {rank.rank} was not started by a launcher that restarts it (no torchrun)"
    if launcher.max_restarts is not None and rank.restart_count >= launcher.max_restarts:
        return (
            f"rank {rank.rank}'s torchrun has no restart left (restart {rank.restart_count}, "
            f"--max-restarts {launcher.max_restarts})"
        )
    return None


def no_restart_reasons(ranks: Iterable[Rank]) -> list[str]:
    """The reasons of the ranks a kill would end for good (their worker group dies together)."""
    return [why for r in ranks if (why := no_restart_reason(r)) is not None]


def no_restart_note(reasons: list[str], killing: bool) -> str:
    """The incident's note: which ranks nothing restarts, and what the watchdog did about it."""
    then = (
        "killing anyway (remediation.kill_without_restart)"
        if killing
        else "not killing; stacks dumped (remediation.kill_without_restart: true kills to free the GPUs)"
    )
    return f"nothing would restart the ranks once killed: {'; '.join(reasons)}; {then}"
