#!/usr/bin/env bash
# Installs the Debian packages the tests start (Prometheus, promtool, Alertmanager, amtool,
# node_exporter, and victoria-metrics with vmagent and vmalert for the cluster-scale stack) and a C compiler (harness/node_clock.c: a simulated node's own wall clock) when any is missing. `make test`, `make demo` and `.ci/run` call it, so the
# README's commands set up a fresh machine by themselves. Without root (and no passwordless
# sudo) it stops with one line naming what to install instead of letting tests fail.
set -euo pipefail
bins=(/usr/bin/prometheus /usr/bin/promtool /usr/bin/prometheus-alertmanager /usr/bin/amtool
  /usr/bin/victoria-metrics /usr/bin/vmagent /usr/bin/vmalert)
pkgs=(prometheus prometheus-alertmanager prometheus-node-exporter victoria-metrics)
missing=0
for bin in "${bins[@]}"; do [ -x "$bin" ] || missing=1; done
command -v cc >/dev/null || { pkgs+=(gcc libc6-dev); missing=1; }
[ "$missing" = 0 ] && exit 0

if [ "$(id -u)" = 0 ]; then
  sudo=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  sudo=(sudo -n)
else
  echo "system-deps: missing ${bins[*]}; install them as root: apt-get install ${pkgs[*]}" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null; then
  echo "system-deps: no apt-get here; install Prometheus, promtool, Alertmanager, amtool and VictoriaMetrics (victoria-metrics, vmagent, vmalert) so that ${bins[*]} exist" >&2
  exit 1
fi
echo "system-deps: installing ${pkgs[*]} (Debian packages the tests start)" >&2
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
# The packages start their services on install; the tests start their own on free ports.
"${sudo[@]}" systemctl stop prometheus prometheus-alertmanager prometheus-node-exporter victoria-metrics 2>/dev/null || true
for bin in "${bins[@]}"; do
  [ -x "$bin" ] || { echo "system-deps: $bin still missing after apt-get install ${pkgs[*]}" >&2; exit 1; }
done
