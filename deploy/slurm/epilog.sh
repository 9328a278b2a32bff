#!/bin/sh
# Slurm Epilog: after a job, is anything of it left on this node? (docs/slurm.md)
#
#   slurm.conf:  Epilog=/etc/slurm/epilog.d/sidecar-epilog.sh
#   install -m 0755 deploy/slurm/epilog.sh /etc/slurm/epilog.d/sidecar-epilog.sh
#
# slurmd runs it as root with no PATH, after it has killed the job's processes, with SLURM_JOB_ID,
# SLURM_JOB_USER, SLURMD_NODENAME, SLURM_JOB_GPUS, ... set. It asks the node's sidecar
# (`python -m sidecar.commands.slurm`, reading /v1/status) for what outlived the job, waiting a few
# seconds for the sidecar to see the processes go:
#   - a rank in the job's cgroup (job_<SLURM_JOB_ID>), or registered under the job's id (SLURM_JOB_ID, or SLURM_JOB_ID.<suffix>: the sbatch
#     example's torchrun --rdzv-id, the hooks' job id) whose process, running as the job's user
#     (SLURM_JOB_UID), is still alive: another user's process registered under the id is not the job's;
#   - GPU memory above the budget on a GPU of the job (SLURM_JOB_GPUS);
#   - processes that outlived SIGKILL, or left-over processes holding GPU memory (the node verdict's
#     `unkillable` and `gpu_held`).
# Any of these exits 1, which makes Slurm DRAIN the node ("Epilog error"): the next job would find
# its GPUs taken or its ranks' ports in use. The lines naming what is left go to stderr and syslog
# (tag sidecar-epilog).
#
# Exit status: 0 nothing of the job is left (or the sidecar could not be asked, see
# SIDECAR_EPILOG_UNREACHABLE), 1 something is left (named), 2 the sidecar could not be asked and
# SIDECAR_EPILOG_UNREACHABLE=drain, or no job id.
#
# Settings (from the environment, after /etc/sidecar/sidecar.env, the unit's own settings file):
#   SIDECAR_ENV_FILE            the settings file to read (default /etc/sidecar/sidecar.env)
#   SIDECAR_BIN                 the sidecar command (default: `sidecar` on PATH, /opt/sidecar/bin first)
#   SIDECAR_PYTHON              the sidecar's interpreter (default: the one SIDECAR_BIN's first line names)
#   SIDECAR_EPILOG_WAIT         seconds to wait for the job's processes to go (default 10)
#   SIDECAR_EPILOG_TIMEOUT      seconds the whole check may take (default 30)
#   SIDECAR_EPILOG_GPUS         the job's GPUs by index (default SLURM_JOB_GPUS, then
#                               CUDA_VISIBLE_DEVICES; "all" on whole-node clusters without GPU gres)
#   SIDECAR_EPILOG_GPU_MEMORY_BUDGET_MIB  memory a GPU of the job may still hold (default 1024)
#   SIDECAR_EPILOG_UNREACHABLE  pass (default): no sidecar answering is logged, not a reason to
#                               drain (the health check reports it); drain: exit 2
#   SIDECAR_SLURM_SYSLOG        0: do not write to syslog (default 1)
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

tag="sidecar-epilog"
job="${SLURM_JOB_ID:-}"
node="${SLURMD_NODENAME:-$(hostname)}"

log() {
  echo "$tag: job ${job:-none} on $node: $*" >&2
  if [ "${SIDECAR_SLURM_SYSLOG:-1}" != 0 ] && command -v logger >/dev/null 2>&1; then
    logger -t "$tag" -p daemon.err -- "job ${job:-none} on $node: $*" 2>/dev/null || true
  fi
}

unreachable() {
  if [ "${SIDECAR_EPILOG_UNREACHABLE:-pass}" = drain ]; then
    log "could not ask the sidecar: $*"
    exit 2
  fi
  log "could not ask the sidecar, not checked: $*"
  exit 0
}

if [ -z "$job" ]; then
  log "no SLURM_JOB_ID: run me as slurmd does"
  exit 2
fi

sidecar="${SIDECAR_BIN:-$(command -v sidecar || true)}"
python="${SIDECAR_PYTHON:-}"
if [ -z "$python" ] && [ -n "$sidecar" ] && [ -r "$sidecar" ]; then
  # A console script's first line names its interpreter: #!/opt/sidecar/bin/python3
  python=$(sed -n '1s/^#![[:space:]]*\([^[:space:]]*\).*/\1/p' "$sidecar")
  case "$python" in
    */python*) ;;
    *) python="$(dirname "$sidecar")/python" ;;
  esac
fi
if [ -z "$python" ] || [ ! -x "$python" ]; then
  unreachable "no sidecar installed (set SIDECAR_BIN or SIDECAR_PYTHON)"
fi

limit="${SIDECAR_EPILOG_TIMEOUT:-30}"
set -- -m sidecar.commands.slurm --job "$job" --uid "${SLURM_JOB_UID:-}" \
  --gpus "${SIDECAR_EPILOG_GPUS:-${SLURM_JOB_GPUS:-${CUDA_VISIBLE_DEVICES:-}}}" \
  --wait "${SIDECAR_EPILOG_WAIT:-10}" \
  --gpu-memory-budget-mib "${SIDECAR_EPILOG_GPU_MEMORY_BUDGET_MIB:-1024}"
if command -v timeout >/dev/null 2>&1; then
  output=$(timeout -k 5 "$limit" "$python" "$@" 2>&1)
else
  output=$("$python" "$@" 2>&1)
fi
rc=$?

case "$rc" in
  0)
    echo "$tag: $output"
    exit 0
    ;;
  1)
    printf '%s\n' "$output" | while IFS= read -r line; do log "left behind: $line"; done
    exit 1
    ;;
  124 | 137) unreachable "no answer within ${limit}s" ;;
  *) unreachable "$(printf '%s\n' "$output" | tail -n 1)" ;;
esac
