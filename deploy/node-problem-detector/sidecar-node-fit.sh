#!/bin/bash
# The training sidecar's node verdict as a custom-plugin check for a node-problem-detector the
# cluster already runs (the deliveryhero Helm chart: helm-values.yaml here), whose image
# (registry.k8s.io/node-problem-detector) has bash but neither the sidecar CLI, curl nor python.
# So: bash builtins only, GET /v1/status over TCP (/dev/tcp) from the sidecar's port on the node's
# address, which components/push-over-tcp publishes (bash cannot open the sidecar's Unix socket).
#
#   sidecar-node-fit.sh [PORT]   PORT: 9402; the host: $SIDECAR_HOST, else $HOST_IP (the
#                                downward API's status.hostIP); $SIDECAR_TIMEOUT: 10 (seconds)
#
# One line and node-problem-detector's exit status, as `sidecar status --check node` answers in
# components/node-problem-detector: `fit` (0: the condition False), `unfit (<reasons>): <reason>:
# <text>; ...` (1: True), `unknown: <why>` (2: Unknown).
set -u
LC_ALL=C  # JSON's ASCII; bash's string operations are much slower in a multibyte locale

unknown() {
  printf 'unknown: %s\n' "$1"
  exit 2
}

host=${SIDECAR_HOST:-${HOST_IP:-}}
port=${1:-9402}
timeout=${SIDECAR_TIMEOUT:-10}
[[ -n $host ]] || unknown "no sidecar address: set HOST_IP (the downward API's status.hostIP) or SIDECAR_HOST"
[[ $port =~ ^[0-9]+$ && $timeout =~ ^[0-9]+$ ]] || unknown "bad port or timeout: ${port@Q} ${timeout@Q}"
at="$host:$port"

# node-problem-detector's rule timeout ends a connect that hangs (the kernel's own is minutes).
{ exec 3<>"/dev/tcp/$host/$port"; } 2>/dev/null || unknown "no sidecar at $at"
printf 'GET /v1/status HTTP/1.0\r\nHost: %s\r\nAccept: application/json\r\nConnection: close\r\n\r\n' "$at" >&3
IFS= read -r -d '' -t "$timeout" answer <&3
(($? > 128)) && unknown "no answer from the sidecar at $at within ${timeout}s"
exec 3<&-

[[ $answer =~ ^HTTP/[0-9.]+\ ([0-9]+) ]] || unknown "no HTTP answer from $at"
[[ ${BASH_REMATCH[1]} == 200 ]] || unknown "the sidecar at $at answered HTTP ${BASH_REMATCH[1]} to GET /v1/status"

# /v1/status is JSON with ASCII escapes (no control or non-ASCII character is sent raw); its
# "fitness" object is {"fit": BOOL, "reasons": [NAME, ...], "findings": [{"reason": NAME,
# "text": STRING, "pids": [INT, ...]}, ...]} (sidecar/fitness.py).
s='[[:space:]]*'
one='[{]'$s'"reason"'$s:$s'"([a-z_]*)"'$s,$s'"text"'$s:$s'"(([\].|[^"\])*)"'$s,$s'"pids"'$s:$s'[[][^]]*[]]'$s'[}]'
fitness='"fitness"'$s:$s'[{]'$s'"fit"'$s:$s'(true|false)'$s,$s'"reasons"'$s:$s'[[]([^]]*)[]]'$s,$s
fitness+='"findings"'$s:$s'[[]'$s'(('$one"$s,?$s"')*)[]]'
[[ $answer =~ $fitness ]] || unknown "no node verdict in the answer of the sidecar at $at"
fit=${BASH_REMATCH[1]}
reasons=${BASH_REMATCH[2]//[\"[:space:]]/}
reasons=${reasons//,/, }
findings=${BASH_REMATCH[3]}

# A finding's text unescaped as the CLI prints it: a control character as \xNN (safetext.printable),
# any other non-ASCII character left as its JSON escape \uNNNN (the CLI prints it, or \uNNNN).
bs=\\
control='[\]u00([01][0-9a-f]|7f|[89][0-9a-f])'
unfit=()
while [[ $findings =~ ^$one$s,?$s ]]; do
  reason=${BASH_REMATCH[1]} text=${BASH_REMATCH[2]//"$bs$bs"/$'\x01'}
  findings=${findings:${#BASH_REMATCH[0]}}
  text=${text//"$bs\""/\"}
  text=${text//"$bs/"/\/}
  text=${text//"${bs}b"/"${bs}x08"} text=${text//"${bs}t"/"${bs}x09"} text=${text//"${bs}n"/"${bs}x0a"}
  text=${text//"${bs}f"/"${bs}x0c"} text=${text//"${bs}r"/"${bs}x0d"}
  while [[ $text =~ $control ]]; do text=${text//"${BASH_REMATCH[0]}"/"${bs}x${BASH_REMATCH[1]}"}; done
  unfit+=("$reason: ${text//$'\x01'/$bs}")
done
if ((${#unfit[@]} == 0)); then
  [[ $fit == true ]] && { echo fit; exit 0; }
  unfit=("${reasons:-unfit, no reason given}")
fi

line="unfit (${reasons:-?}): ${unfit[0]}"
for u in "${unfit[@]:1}"; do line+="; $u"; done
# Runs of spaces as one (JSON sends every other whitespace character escaped).
while [[ $line == *"  "* ]]; do line=${line//"  "/ }; done
line=${line%" "}
printf '%s\n' "${line:0:512}"
exit 1
