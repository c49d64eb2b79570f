#!/usr/bin/env bash
# Instructions per proxied request, counted by callgrind, for nm-gateway `serve` (default
# settings), `dataplane` alone (records shipped over gRPC to a controlplane outside callgrind)
# and the minimal forwarder, for JSON and streamed answers, and the gateway's ratios to the
# forwarder: the yardstick of the hot path's cost (bench/README.md, "Counting instructions").
#
#   cargo build --profile dist -p nm-gateway -p nm-bench --bin nm-gateway --bin nm-bench
#   bench/ratios.sh
#
# Takes about 6 minutes (six callgrind runs of SECS seconds each, default 15). BIN_DIR,
# GATEWAY_BIN and gateway settings (NM_LOG, TRACED=1, ...) pass through to bench/callgrind.sh.
# Prints one table; the targets are those of issue 31: serve at most 2.0x the forwarder,
# dataplane alone at most 1.6x, both with the default settings: so no budget unless BUDGETS=N
# says otherwise (callgrind.sh alone sets one by default).
set -euo pipefail
cd "$(dirname "$0")/.."
export BUDGETS="${BUDGETS:-0}"

count() {  # target stream -> instructions per request
  local out
  out=$(STREAM=$2 bench/callgrind.sh "$1" 2>&1) || { echo "$out" >&2; exit 1; }
  echo "$out" | awk '/instructions per request/ {for (i = 1; i <= NF; i++) if ($(i+1) == "instructions") print $i}'
}

declare -A n
for stream in 0 1; do
  for target in forwarder gateway dataplane; do
    n[$target.$stream]=$(count "$target" "$stream")
    echo "ratios.sh: $target $([ "$stream" = 1 ] && echo streamed || echo JSON): ${n[$target.$stream]} instructions per request" >&2
  done
done

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; }
printf '\n%-22s %12s %7s %12s %7s %8s\n' "target" "JSON" "ratio" "streamed" "ratio" "aim"
for target in forwarder gateway dataplane; do
  aim=$(case $target in gateway) echo "<= 2.0" ;; dataplane) echo "<= 1.6" ;; *) echo "" ;; esac)
  name=$(case $target in gateway) echo "nm-gateway serve" ;; dataplane) echo "nm-gateway dataplane" ;; *) echo "minimal forwarder" ;; esac)
  printf '%-22s %12s %7s %12s %7s %8s\n' "$name" "${n[$target.0]}" "$(ratio "${n[$target.0]}" "${n[forwarder.0]}")" \
    "${n[$target.1]}" "$(ratio "${n[$target.1]}" "${n[forwarder.1]}")" "$aim"
done
echo "(user-space instructions per request, all threads; ratios against the forwarder on the same harness)"
