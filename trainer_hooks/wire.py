"""The wire contract between the hooks and the sidecar (docs/architecture/wire-protocol.md, "the wire
protocol"): names, patterns and limits both sides must agree on, defined once.

The hooks shape what they send with these (`records.py`, `exits.py`, `environment.py`); the
sidecar refuses what breaks them (`sidecar/ranks/protocol.py`, `sidecar/ranks/podlabels.py`,
`sidecar/ranks/registry.py`). Standard library only: the hooks are also shipped alone, as the
`training-sidecar-hooks` distribution, and import this without the daemon's dependencies.

Changing anything here changes the contract: bump PROTOCOL_VERSION, and pin the new
fingerprint in tests/hooks/test_wire_contract.py (the test says so when they disagree).
"""

from __future__ import annotations

import re

# 9: a registration's optional `slurm` (SLURM_LABEL_RULES: the account and partition its environment
# names; a sidecar of 8 ignores it); 8: the optional `end` of a registration's or a push's answer (END,
# CRASH_LOOP_EXIT: the job was ended for a crash loop; hooks of 7 ignore it and train on until the
# launcher gives up), a deregistration's optional `exit.time` (when the hooks reported the exception,
# the host's wall clock); 7: a collective
# record group's optional `recent` (COLLECTIVES_MAX_RECENT; a sidecar of 6 ignores
# it); 6: the job view offer's and the `job_coordinator` event's `key` (JOB_KEY_CHARS hex digits: the
# job's own key, sidecar/jobview/auth.py), STEP_GAP_SEND_SECONDS, a registration's optional
# `observe_only` (OBSERVE_ONLY); 5: a push's optional `collectives` and `fr_dump` (the
# rank's Flight Recorder, COLLECTIVES_*), a push answer's optional `want` (WANTS),
# KEEPALIVE_SECONDS, COLLECTIVES_EVERY_SECONDS; 4: a registration's optional `restart_safe`
# (RESTART_SAFE), WELL_KNOWN_EVENTS and CHECKPOINT_SOURCES; 3: the `job_coordinator` event (the
# job view); 2: a registration's optional `launcher` (LAUNCHERS). Registrations of earlier
# versions stay valid.
PROTOCOL_VERSION = 9

# ---------------------------------------------------------------- names

# Job ids, metric, phase and event names: at most MAX_NAME characters. Metric, phase and event
# names become label values, so they are letters, digits and _.:/-, starting with a letter or _;
# the sidecar refuses a whole batch over one bad name.
MAX_NAME = 128
NAME_PATTERN = r"[A-Za-z_][A-Za-z0-9_.:/-]{0,127}\Z"
NAME_RE = re.compile(NAME_PATTERN)
NAME_BAD_CHARS_RE = re.compile(r"[^A-Za-z0-9_.:/-]")

# Step metric keys with their own series (`samples` and `tokens` also feed the per-rank
# counters); any other key is a custom metric, bounded per job.
WELL_KNOWN_METRICS = frozenset(
    {
        "loss",
        "grad_norm",
        "lr",
        "step_time_seconds",
        "samples",
        "tokens",
        "iterations_per_second",
        "samples_per_second",
        "tokens_per_second",
    }
)
# Phase names that never count against a job's phase-name limit.
WELL_KNOWN_PHASES = frozenset({"startup", "checkpoint_save", "checkpoint_load", "eval", "compile", "data_load"})
# Event names whose fields mean something to the sidecar: `checkpoint_saved` (step, path) for the
# rollback hint; the milestones of a (re)start (sidecar_trainer/startup.py) for where recovery
# time goes: `process_group_formed` (the process's start and imports as `process_started_time`,
# `imports_done_time`), `model_built`, `checkpoint_loaded` (step, source: CHECKPOINT_SOURCES),
# `first_step` (step); and `rendezvous_done`, `data_loaded`.
WELL_KNOWN_EVENTS = frozenset(
    {
        "checkpoint_saved",
        "checkpoint_loaded",
        "rendezvous_done",
        "data_loaded",
        "process_group_formed",
        "model_built",
        "first_step",
    }
)
CHECKPOINT_SOURCES = ("memory", "disk")  # where `checkpoint_loaded` read the state from

# ---------------------------------------------------------------- limits

# Custom metric names per job: the sidecar's default `limits.max_custom_metrics` (429 beyond,
# which would lose the whole batch); the hooks stop adding new names at this bound instead.
MAX_CUSTOM_METRICS = 32
MAX_PHASES = 16  # the sidecar's default `limits.max_phases`: distinct phase names per job
MAX_EVENT_FIELDS = 16  # fields of one event (400 beyond)
MAX_FIELD_CHARS = 1024  # an event field's text, as the hooks cut it
MAX_VERSIONS = 32  # entries of a registration's `versions`
MAX_PID = 1 << 22  # Linux's pid_max ceiling
MAX_RANK = 1 << 24  # ranks and world sizes
MAX_COUNT = (1 << 63) - 1  # steps and counters: what an int64 (and a float, roughly) holds
MAX_SESSION_CHARS = 128  # the session string the registration returns
MAX_TIMEOUT_SECONDS = 1e9  # a phase's declared budget (at registration too): a number in (0, this)
MAX_TIME = 1e12  # item times: Unix seconds, well past year 30000
STACK_SIGNAL_RANGE = (1, 64)  # a registration's `stack_dump.signal`
NONFINITE_VALUES = ("nan", "inf", "+inf", "-inf")  # how a non-finite metric value travels (strict JSON)
ITEM_TYPES = ("step", "phase", "event")
PHASE_ACTIONS = ("start", "end")
RESERVED_JOB_IDS = frozenset({"incidents"})  # names of the diag directory's own subdirectories
# A registration's `launcher.name`: what restarts the rank's worker group once it is killed.
# "torchrun": torchrun's elastic agent, with its restart budget (`launcher.max_restarts`: its
# --max-restarts, TORCHELASTIC_MAX_RESTARTS) against the top-level `restart_count`; "none": no
# launcher (no TORCHELASTIC_RUN_ID), nothing restarts it. Absent (hooks of protocol 1): unknown.
LAUNCHERS = ("torchrun", "none")
# A registration's optional `restart_safe` (trainer_hooks.distributed.restart_safety): true when the
# rank's process group comes back after a torchrun restart; false when torchrun shares its store
# across attempts (TORCHELASTIC_USE_AGENT_STORE=True) and no per-attempt namespace covers the group,
# so a restarted attempt may die in init_process_group; null or absent: no torchrun, or hooks of
# protocol 1 or 2.
RESTART_SAFE = "restart_safe"
# A registration's optional `observe_only` (protocol 6; the hooks' SIDECAR_OBSERVE_ONLY): true asks that
# the job's stalls be detected, counted and reported, never killed (the sidecar honours it while its
# `watchdog.allow_job_observe_only`, and answers what it did in the registration's `observe_only`);
# false, null or absent: the sidecar's own mode.
OBSERVE_ONLY = "observe_only"
# The optional `end` of an answer to a registration or a push: {"exit_code": CRASH_LOOP_EXIT, "reason",
# "job_incident"}: the job is in a crash loop (the same verdict at the same step after restarts;
# sidecar/jobview/crashloop.py) and is ended on purpose: the hooks exit with that status at once, and
# `python -m trainer_hooks.launch` exits with it too (a scheduler's "do not requeue"). Absent: go on.
END = "end"
CRASH_LOOP_EXIT = 93

# A push's optional `collectives` (trainer_hooks/collectives.py): {"time": the rank's wall clock when
# it read its Flight Recorder, "groups": [{"pg", "desc", "size", "ranks", "enqueued", "started",
# "completed", "pending": [{"seq", "op", "sizes", "created", "state"}], "recent": [[seq, created], ...]}]}:
# per process group the last collective sequence enqueued, started and completed, its members (global
# ranks) when at most COLLECTIVES_MAX_GROUP_RANKS, its oldest collectives still in flight, and (optional)
# when the rank entered each of its most recent collectives (at most COLLECTIVES_MAX_RECENT, ascending
# sequences, Unix seconds): what a straggler's lateness is measured from (sidecar/ranks/lateness.py).
COLLECTIVES_MAX_GROUPS = 16
COLLECTIVES_MAX_PENDING = 4
COLLECTIVES_MAX_RECENT = 32
COLLECTIVES_MAX_SIZES = 4  # input shapes of one collective (each at most 8 dimensions)
COLLECTIVES_MAX_GROUP_RANKS = 64
# With nothing to send for this long, the hooks push an empty batch (a hung or waiting rank still
# re-registers with a restarted sidecar, and still sends its collective record): a live rank is
# heard from at least every max(flush interval, KEEPALIVE_SECONDS).
KEEPALIVE_SECONDS = 2.0
# A step this long after the previous one (the first step after a pause), and every phase start and
# end, is sent at once, not at the next flush: the sidecar measures a pause from the rank's own
# last progress, and must see a pause end as soon as it ends (sidecar/watchdog/timeouts.py).
STEP_GAP_SEND_SECONDS = 1.0
# A rank's collective record goes with a push at most this often while healthy; a rank with nothing
# else to send (waiting in a collective, hung) pushes for it alone this often: a live rank's record
# is at most max(flush interval, COLLECTIVES_EVERY_SECONDS) old when the sidecar reads it.
COLLECTIVES_EVERY_SECONDS = 1.0
# What a push answer's `want` may ask of the rank's hooks at once (the sidecar's side of a suspect
# rank): "collectives", a fresh record with the next push; "fr_dump", its whole Flight Recorder
# record written to the rank's dump file (an incident keeps it).
WANTS = ("collectives", "fr_dump")

# ---------------------------------------------------------------- pod labels

# A rank's pod labels (`kubernetes` of a registration), by Kubernetes' own name rules:
# key -> (pattern, most characters, what it is).
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
POD_LABEL_KEYS = ("namespace", "pod", "container")
POD_LABEL_RULES: dict[str, tuple[re.Pattern, int, str]] = {
    "namespace": (re.compile(_DNS_LABEL + r"\Z"), 63, "a DNS-1123 label"),
    "pod": (re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*\Z"), 253, "a DNS-1123 subdomain"),
    "container": (re.compile(_DNS_LABEL + r"\Z"), 63, "a DNS-1123 label"),
}

# ---------------------------------------------------------------- Slurm labels

# A rank's Slurm job as its environment names it (`slurm` of a registration, protocol 9: the hooks send
# it where SLURM_JOB_ID is set, with each key whose variable is set and well-formed: SLURM_JOB_ACCOUNT,
# SLURM_JOB_PARTITION): key -> (pattern, most characters, what it is). Slurm's account and partition
# names are words of letters, digits, '_', '.' and '-'. No `user`: the sidecar names the uid of the
# process it verified, never a name the rank sends (sidecar/ranks/slurmjob.py).
_SLURM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}\Z")
SLURM_LABEL_KEYS = ("account", "partition")
SLURM_LABEL_RULES: dict[str, tuple[re.Pattern, int, str]] = {
    "account": (_SLURM_NAME, 64, "a Slurm account name"),
    "partition": (_SLURM_NAME, 64, "a Slurm partition name"),
}

# ---------------------------------------------------------------- the exit report

# The `exit` object of a deregistration: the exception a rank dies of. Longer text is cut, not
# refused (the report matters more than its tail).
EXIT_MAX_TYPES = 16  # the type and its bases, most derived first
EXIT_MAX_FRAMES = 12  # the innermost frames of the traceback
EXIT_MAX_TEXT = 512  # each text: type names, the message's first line, a frame, the thread name
JOB_COORDINATOR_EVENT = "job_coordinator"  # fields url, node: where the job's coordinating sidecar is; key
JOB_KEY_CHARS = 64  # the job's key (`key` of the offer and the event), lowercase hex
THREAD_EXCEPTION_EVENT = "thread_exception"  # the event an exception that ends another thread is sent as


def contract() -> dict[str, object]:
    """The contract as plain, comparable values (patterns by their text, sets sorted): what
    tests/hooks/test_wire_contract.py fingerprints."""

    def plain(value: object) -> object:
        if isinstance(value, re.Pattern):
            return value.pattern
        if isinstance(value, (frozenset, set)):
            return sorted(value)
        if isinstance(value, dict):
            return {k: plain(v) for k, v in sorted(value.items())}
        if isinstance(value, (tuple, list)):
            return [plain(v) for v in value]
        return value

    return {k: plain(v) for k, v in sorted(globals().items()) if k.isupper() and not k.startswith("_")}
