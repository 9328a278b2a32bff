"""A rank's watchdog states and the only transitions between them:

    STARTING --first step--> HEALTHY <--progress--> SUSPECT --timeout--> STALLED
        any watched state --remediation starts--> REMEDIATING --process exits--> GONE
        any state --process gone / deregistered / replaced--> GONE

machine.py moves each rank between them, in one place (`Watchdog._transition`) that checks ALLOWED.
"""

from __future__ import annotations

import enum


class RankState(enum.Enum):
    STARTING = "starting"  # registered, no step yet
    HEALTHY = "healthy"  # progressing within its timeout
    SUSPECT = "suspect"  # past suspect_ratio of its timeout
    STALLED = "stalled"  # past its timeout
    REMEDIATING = "remediating"  # its worker group is being dumped and killed
    GONE = "gone"  # exited, deregistered or replaced by a new registration


WATCHING = frozenset({RankState.STARTING, RankState.HEALTHY, RankState.SUSPECT, RankState.STALLED})
# The only transitions there are. Progress may bring a suspect or stalled rank back (a rank
# re-registered without a step goes back to STARTING); a failed remediation leaves its
# ranks STALLED; GONE is final (a new registration is a new rank).
ALLOWED: dict[RankState, frozenset[RankState]] = {
    RankState.STARTING: frozenset(
        {RankState.HEALTHY, RankState.SUSPECT, RankState.STALLED, RankState.REMEDIATING, RankState.GONE}
    ),
    RankState.HEALTHY: frozenset({RankState.SUSPECT, RankState.STALLED, RankState.REMEDIATING, RankState.GONE}),
    RankState.SUSPECT: frozenset(
        {RankState.STARTING, RankState.HEALTHY, RankState.STALLED, RankState.REMEDIATING, RankState.GONE}
    ),
    RankState.STALLED: frozenset(
        {RankState.STARTING, RankState.HEALTHY, RankState.SUSPECT, RankState.REMEDIATING, RankState.GONE}
    ),
    RankState.REMEDIATING: frozenset({RankState.STALLED, RankState.GONE}),
    RankState.GONE: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A transition outside ALLOWED: a bug in the watchdog, never a rank's doing."""
