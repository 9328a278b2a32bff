#!/bin/sh
# Slurm HealthCheckProgram: `sidecar status --check node`, NHC-style (docs/slurm.md).
#
#   slurm.conf:  HealthCheckProgram=/etc/slurm/sidecar-healthcheck.sh
#                HealthCheckInterval=60
#                HealthCheckNodeState=ANY
#   install -m 0755 deploy/slurm/healthcheck.sh /etc/slurm/sidecar-healthcheck.sh
#
# slurmd runs it as root, periodically and when it starts, and kills it after 60 seconds; Slurm
# does nothing with its exit status: as NHC does, the program drains the node itself. So:
#   - unfit (something outlives the jobs: unkillable processes, GPU memory held, GPUs missing, no
#     NVML where GPUs are expected): `scontrol update NodeName=... State=DRAIN Reason="sidecar: ..."`;
#   - no sidecar answering (asked twice, SIDECAR_HC_RETRY_DELAY apart: a restart takes seconds):
#     the same, unless SIDECAR_HC_UNREACHABLE=ignore, as the node runs jobs unwatched;
#   - fit: a node drained with a reason starting "sidecar:" is resumed (SIDECAR_HC_RESUME=0: not);
#     a node drained for another reason (an admin's, NHC's) is never resumed nor re-labelled.
# The reason is also printed, with the sidecar's one line.
#
# Run by NHC (an NHC check calling this script; NHC exports NHC_PID to its checks: `nhc`'s
# nhcmain_init_env), it never drains nor resumes: it prints the reason and exits 1, and NHC, which
# owns the node's state then, drains it with its own reason. deploy/slurm/nhc/sidecar.nhc is that check.
#
# Exit status: 0 fit, 1 unfit or no sidecar (the node is drained), 2 a bad setting.
#
# Settings (from the environment, after /etc/sidecar/sidecar.env, the unit's own settings file):
#   SIDECAR_ENV_FILE        the settings file to read (default /etc/sidecar/sidecar.env)
#   SIDECAR_BIN             the sidecar command (default: `sidecar` on PATH, /opt/sidecar/bin first)
#   SIDECAR_HC_NODENAME     this node's Slurm NodeName (default SLURMD_NODENAME, else `hostname -s`)
#   SIDECAR_HC_TIMEOUT      seconds to wait for the sidecar's answer (default 5)
#   SIDECAR_HC_RETRY_DELAY  seconds before asking again when no sidecar answered (default 5)
#   SIDECAR_HC_UNREACHABLE  drain (default) or ignore
#   SIDECAR_HC_RESUME       1 (default): resume the node once fit if this check drained it
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

tag="sidecar-healthcheck"
node="${SIDECAR_HC_NODENAME:-${SLURMD_NODENAME:-$(hostname -s)}}"
wait_s="${SIDECAR_HC_TIMEOUT:-5}"
retry_s="${SIDECAR_HC_RETRY_DELAY:-5}"
for value in "$wait_s" "$retry_s"; do
  case "$value" in
    '' | *[!0-9]*) echo "$tag: SIDECAR_HC_TIMEOUT and SIDECAR_HC_RETRY_DELAY are whole seconds, got '$value'" >&2; exit 2 ;;
  esac
done

have_scontrol() { command -v scontrol >/dev/null 2>&1; }

# The node's State= and Reason= as `scontrol -o show node` prints them (Reason= runs to the end
# of the line and may carry "[user@time]" and later fields: only its start is compared).
node_state() {
  have_scontrol || return 0
  scontrol -o show node "$node" 2>/dev/null | sed -n 's/.* State=\([^ ]*\).*/\1/p' | sed -n 1p
}
node_reason() {
  have_scontrol || return 0
  scontrol -o show node "$node" 2>/dev/null | sed -n 's/.* Reason=\(.*\)$/\1/p' | sed -n 1p
}

drain() {
  reason=$(printf 'sidecar: %.240s' "$1")
  echo "$tag: $node: $reason"
  if [ -n "${NHC_PID:-}" ]; then exit 1; fi  # NHC drains (see above)
  if ! have_scontrol; then
    echo "$tag: no scontrol on PATH: $node not drained" >&2
    exit 1
  fi
  case "$(node_state)" in
    *DRAIN*)
      case "$(node_reason)" in
        sidecar:*) ;;
        *) echo "$tag: $node is drained already for another reason: left as it is"; exit 1 ;;
      esac
      ;;
  esac
  scontrol update NodeName="$node" State=DRAIN Reason="$reason" || echo "$tag: scontrol update failed" >&2
  exit 1
}

resume_if_ours() {
  if [ "${SIDECAR_HC_RESUME:-1}" = 0 ] || [ -n "${NHC_PID:-}" ] || ! have_scontrol; then return 0; fi
  case "$(node_state)" in *DRAIN*) ;; *) return 0 ;; esac
  case "$(node_reason)" in
    sidecar:*)
      echo "$tag: $node is fit again: resuming it (it was drained by this check)"
      scontrol update NodeName="$node" State=RESUME || echo "$tag: scontrol update failed" >&2
      ;;
  esac
}

sidecar="${SIDECAR_BIN:-$(command -v sidecar || true)}"
if [ -z "$sidecar" ] || [ ! -x "$sidecar" ]; then
  if [ "${SIDECAR_HC_UNREACHABLE:-drain}" = ignore ]; then echo "$tag: no sidecar installed (ignored)"; exit 0; fi
  drain "unknown: no sidecar command installed"
fi

check() {
  if command -v timeout >/dev/null 2>&1; then
    line=$(timeout -k 2 "$((wait_s + 5))" "$sidecar" status --check node --timeout "$wait_s" 2>&1)
  else
    line=$("$sidecar" status --check node --timeout "$wait_s" 2>&1)
  fi
  rc=$?
  line=$(printf '%s\n' "$line" | tail -n 1)
}

check
case "$rc" in
  0 | 1) ;;
  *) sleep "$retry_s"; check ;;
esac

case "$rc" in
  0)
    echo "$tag: $node: $line"
    resume_if_ours
    exit 0
    ;;
  1) drain "$line" ;;
  *)
    [ -n "$line" ] || line="unknown: sidecar status --check node exited $rc"
    if [ "${SIDECAR_HC_UNREACHABLE:-drain}" = ignore ]; then
      echo "$tag: $node: $line (ignored: SIDECAR_HC_UNREACHABLE=ignore)"
      exit 0
    fi
    drain "$line"
    ;;
esac
