#!/usr/bin/env bash
# Start the bundled trainer on this node of a multi-node job, under torchrun with a c10d
# rendezvous and in-place restarts. Run the same command on every node; settings come from
# the environment:
#
#   NNODES          nodes in the job: N, or MIN:MAX for an elastic job          (required)
#   RDZV_ENDPOINT   HOST:PORT of the c10d rendezvous store, one of the nodes    (required)
#   CONFIG          the trainer's YAML configuration                            (required)
#   NPROC_PER_NODE  ranks per node (default: gpu, one per GPU)
#   RDZV_ID         the job's id, the same on every node (default: training). A job id belongs to
#                   the uid that registers it first on a node: give each run an id no other user
#                   can guess, e.g. RDZV_ID=train-$(od -An -N8 -tx8 /dev/urandom | tr -d ' ')
#   RDZV_IS_HOST    auto (default): when RDZV_ENDPOINT's host is one of this node's names or
#                   addresses, torchrun is told it hosts the rendezvous store (--rdzv-conf
#                   is_host=true): it then fails the job when another process (another local user)
#                   already listens on the port, instead of joining it; elsewhere torch guesses as
#                   before. 1 or 0: say so on every node (0 on all but the host)
#   MAX_RESTARTS    worker-group restarts torchrun allows (default: 3)
#   SIDECAR_SOCKET  the node sidecar's socket (default: /run/sidecar/sidecar.sock)
#   TORCH_DISABLE_SHARE_RDZV_TCP_STORE  1 (default): each restart attempt gets a fresh store,
#                   torch's own switch that lets a restarted group form again (pytorch#135712)
#   PYTHON          the training environment's interpreter (default: python3)
#   PREFLIGHT       1 (default): run `sidecar preflight` first and stop if it fails; 0: skip
#   EXPECT_GPUS     passed to preflight's --expect-gpus when set
#   PREFLIGHT_ARGS  more preflight flags, e.g. "--shared-dir /mnt/shared --min-free-gb 200"
#   LEAVE_IF_UNFIT  1: do not join when `sidecar status --check node` says this node is unfit (for
#                   example marked for exclusion: a straggler with a hardware cause, the sidecar's
#                   job_view.straggler_exclude_after_seconds); with NNODES=MIN:MAX the other nodes
#                   form the job without it. Exits 0 with the reason. Default 0 (always join)
#   DRY_RUN         1: print the commands instead of running them
#
# Extra arguments are passed to the trainer, e.g. `--set train.steps=1000`.
set -euo pipefail

die() { echo "torchrun-launch: $*" >&2; exit 2; }
[ -n "${NNODES:-}" ] || die "set NNODES (the number of nodes, or MIN:MAX)"
[ -n "${RDZV_ENDPOINT:-}" ] || die "set RDZV_ENDPOINT (HOST:PORT of the rendezvous, one of the nodes)"
[ -n "${CONFIG:-}" ] || die "set CONFIG (the trainer's YAML configuration)"
[[ "$RDZV_ENDPOINT" =~ ^[^:]+:[0-9]+$ ]] || die "RDZV_ENDPOINT must be HOST:PORT, got '$RDZV_ENDPOINT'"
NPROC_PER_NODE="${NPROC_PER_NODE:-gpu}"
RDZV_ID="${RDZV_ID:-training}"
MAX_RESTARTS="${MAX_RESTARTS:-3}"
[[ "$MAX_RESTARTS" =~ ^[1-9][0-9]*$ ]] || die "MAX_RESTARTS must be >= 1 (restarts are how a hung group heals), got '$MAX_RESTARTS'"
PYTHON="${PYTHON:-python3}"
rdzv_host="${RDZV_ENDPOINT%:*}"
rdzv_host="${rdzv_host#[}"
rdzv_host="${rdzv_host%]}"
rdzv_host="${rdzv_host,,}"
case "${RDZV_IS_HOST:-auto}" in
  1 | true) is_host=(--rdzv-conf is_host=true) ;;
  0 | false) is_host=(--rdzv-conf is_host=false) ;;
  auto)
    is_host=()
    mine=" localhost $(hostname 2>/dev/null) $(hostname -f 2>/dev/null) $(hostname -s 2>/dev/null) $(hostname -I 2>/dev/null) "
    mine="${mine,,}"
    found=0
    [[ "$rdzv_host" =~ ^127\.|^::1$ ]] && found=1
    [[ "$mine" == *" $rdzv_host "* ]] && found=1
    if [ "$found" = 0 ] && command -v getent >/dev/null 2>&1; then
      for addr in $(getent ahosts "$rdzv_host" 2>/dev/null | awk '{print $1}' | sort -u); do
        [[ "$mine" == *" $addr "* || "$addr" =~ ^127\.|^::1$ ]] && found=1
      done
    fi
    [ "$found" = 1 ] && is_host=(--rdzv-conf is_host=true)
    ;;
  *) die "RDZV_IS_HOST must be auto, 1 or 0, got '$RDZV_IS_HOST'" ;;
esac
# The hooks in every rank find the node's sidecar through this.
export SIDECAR_SOCKET="${SIDECAR_SOCKET:-/run/sidecar/sidecar.sock}"

run() {
  if [ "${DRY_RUN:-0}" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}

if [ "${PREFLIGHT:-1}" = 1 ]; then
  if command -v sidecar >/dev/null 2>&1; then
    preflight=(sidecar preflight --python "$PYTHON" --rdzv-endpoint "$RDZV_ENDPOINT")
    [ -z "${EXPECT_GPUS:-}" ] || preflight+=(--expect-gpus "$EXPECT_GPUS")
    # shellcheck disable=SC2206  # word splitting of PREFLIGHT_ARGS is intended
    [ -z "${PREFLIGHT_ARGS:-}" ] || preflight+=(${PREFLIGHT_ARGS})
    run "${preflight[@]}" || die "preflight failed on $(hostname); fix the FAIL lines above (PREFLIGHT=0 skips it)"
  else
    echo "torchrun-launch: sidecar not on PATH, preflight skipped" >&2
  fi
fi

if [ "${LEAVE_IF_UNFIT:-0}" = 1 ]; then
  if command -v sidecar >/dev/null 2>&1; then
    verdict=0
    line=$(sidecar status --check node --socket "$SIDECAR_SOCKET") || verdict=$?
    if [ "$verdict" = 1 ]; then
      echo "torchrun-launch: $(hostname) leaves the job: sidecar says $line" >&2
      echo "torchrun-launch: with NNODES=MIN:MAX ($NNODES) the other nodes form the job without it" >&2
      exit 0
    elif [ "$verdict" != 0 ]; then
      echo "torchrun-launch: no node verdict from the sidecar ($line); joining" >&2
    fi
  else
    echo "torchrun-launch: sidecar not on PATH, LEAVE_IF_UNFIT not checked" >&2
  fi
fi

# torchrun reads it: the workers of each restart attempt get a store of their own instead of
# sharing the agent's, whose keys outlive the attempt (docs/architecture/restarts.md, "Restarts").
cmd=(env "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}" "$PYTHON" -m torch.distributed.run
  --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE"
  --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID" "${is_host[@]}"
  --max-restarts "$MAX_RESTARTS"
  -m sidecar_trainer --config "$CONFIG" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then run "${cmd[@]}"; else exec "${cmd[@]}"; fi
