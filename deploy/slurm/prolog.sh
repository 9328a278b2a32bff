#!/bin/sh
# Slurm Prolog: `sidecar preflight` on this node before a job starts on it (docs/slurm.md).
#
#   slurm.conf:  Prolog=/etc/slurm/prolog.d/sidecar-prolog.sh
#   install -m 0755 deploy/slurm/prolog.sh /etc/slurm/prolog.d/sidecar-prolog.sh
#
# slurmd runs it as root with no PATH and SLURM_JOB_ID, SLURM_JOB_USER, SLURMD_NODENAME, ... set.
# A non-zero exit makes Slurm DRAIN the node and requeue the job held; the reason Slurm records is
# "Prolog error", so the FAIL lines go to syslog (tag sidecar-prolog) and stderr as well.
#
# Exit status: 0 preflight passed (warnings allowed), 1 a check FAILed, 2 preflight could not run
# (no sidecar installed, a bad setting or argument), 124 preflight did not finish in time.
#
# Settings (from the environment, after /etc/sidecar/sidecar.env, the unit's own settings file):
#   SIDECAR_ENV_FILE        the settings file to read (default /etc/sidecar/sidecar.env)
#   SIDECAR_BIN             the sidecar command (default: `sidecar` on PATH, /opt/sidecar/bin first)
#   SIDECAR_PROLOG_TIMEOUT  seconds preflight may take, in all (default 60)
#   SIDECAR_PROLOG_PYTHON   the training environment's interpreter, for the torch/CUDA/NCCL check
#                           (default: the sidecar's own interpreter)
#   SIDECAR_PROLOG_TORCH    0: skip the torch/CUDA/NCCL check (importing torch takes seconds per job
#                           and node; default 1)
#   SIDECAR_PROLOG_ARGS     more preflight flags, e.g. "--shared-dir /mnt/shared --min-free-gb 200"
#                           or "--strict" (a WARN fails too)
#   SIDECAR_SLURM_SYSLOG    0: do not write to syslog (default 1)
set -u
PATH="${PATH:+$PATH:}/opt/sidecar/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
export PATH

env_file="${SIDECAR_ENV_FILE:-/etc/sidecar/sidecar.env}"
if [ -r "$env_file" ]; then
  set -a
  # shellcheck source=/dev/null
  . "$env_file"
  set +a
fi

tag="sidecar-prolog"
job="${SLURM_JOB_ID:-none}"
node="${SLURMD_NODENAME:-$(hostname)}"

log() {
  echo "$tag: job $job on $node: $*" >&2
  if [ "${SIDECAR_SLURM_SYSLOG:-1}" != 0 ] && command -v logger >/dev/null 2>&1; then
    logger -t "$tag" -p daemon.err -- "job $job on $node: $*" 2>/dev/null || true
  fi
}

# preflight's lines of one outcome, joined by "; " (for one syslog line).
lines_of() {
  printf '%s\n' "$output" | grep "^$1 " | tr -s ' ' | awk 'NR > 1 { printf "; " } { printf "%s", $0 }'
}

limit="${SIDECAR_PROLOG_TIMEOUT:-60}"
case "$limit" in
  '' | *[!0-9]* | 0) log "SIDECAR_PROLOG_TIMEOUT must be a positive number of seconds, got '$limit'"; exit 2 ;;
esac

sidecar="${SIDECAR_BIN:-$(command -v sidecar || true)}"
if [ -z "$sidecar" ] || [ ! -x "$sidecar" ]; then
  log "FAIL: no sidecar command (install it in /opt/sidecar or set SIDECAR_BIN)"
  exit 2
fi

set -- preflight
if [ "${SIDECAR_PROLOG_TORCH:-1}" = 0 ]; then
  set -- "$@" --skip-torch
elif [ -n "${SIDECAR_PROLOG_PYTHON:-}" ]; then
  # torch's import gets half the budget: the other checks run beside it.
  set -- "$@" --python "$SIDECAR_PROLOG_PYTHON" --torch-timeout "$((limit / 2 + 1))"
fi
# shellcheck disable=SC2086  # word splitting of SIDECAR_PROLOG_ARGS is intended
set -- "$@" ${SIDECAR_PROLOG_ARGS:-}

# timeout(1) signals its whole process group: preflight and the interpreter it starts for torch.
if command -v timeout >/dev/null 2>&1; then
  output=$(timeout -k 5 "$limit" "$sidecar" "$@" 2>&1)
else
  output=$("$sidecar" "$@" 2>&1)
fi
rc=$?

case "$rc" in
  0)
    echo "$tag: job $job on $node: $(printf '%s\n' "$output" | tail -n 1)"
    exit 0
    ;;
  1)
    printf '%s\n' "$output" >&2
    # The FAIL lines; with --strict, the WARN lines when nothing FAILed.
    failed=$(lines_of FAIL)
    [ -n "$failed" ] || failed=$(lines_of WARN)
    log "preflight failed: ${failed:-see the output above}"
    exit 1
    ;;
  124 | 137)
    printf '%s\n' "$output" >&2
    log "preflight did not finish within ${limit}s (a hung driver or mount?)"
    exit 124
    ;;
  *)
    printf '%s\n' "$output" >&2
    log "preflight could not run (exit $rc): $(printf '%s\n' "$output" | tail -n 1)"
    exit 2
    ;;
esac
