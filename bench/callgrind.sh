#!/usr/bin/env bash
# Instructions per proxied request, counted by callgrind: a measure of hot-path cost that does not
# move with the machine's noise (see bench/README.md, "Counting instructions instead of seconds").
#
#   cargo build --profile dist -p nm-gateway -p nm-bench --bin nm-gateway --bin nm-bench
#   bench/callgrind.sh            # nm-gateway serve (default settings: metered, budget path on,
#                                 # the access log at INFO)
#   bench/callgrind.sh dataplane  # nm-gateway dataplane alone, records shipped over gRPC to a
#                                 # controlplane that runs outside callgrind
#   bench/callgrind.sh forwarder  # the minimal hyper forwarder, for comparison
#   bench/ratios.sh               # all of them, JSON and streamed, as ratios to the forwarder
#
# GATEWAY_BIN=PATH measures another nm-gateway binary (an older build, say); BIN_DIR=DIR takes
# both binaries from DIR. Settings such as NM_LOG or NM_HOT_PATH_OFF pass through to the gateway.
# KEEP=FILE keeps the callgrind profile (for callgrind_annotate; with THREADS=1, one per thread,
# FILE.1-01 and on). THREADS=1 profiles each thread apart and prints each one's instructions per
# request (the workers, the record shipper, the span export, the log writer). STREAM=1 asks for
# the streamed answer (20 SSE content chunks + finish + usage + [DONE]) instead of the JSON one.
# TRACED=1 exports every request's spans (sampler always_on) to nm-bench's OTLP collector. SESSIONS=N
# sends each request in one of N sessions (`NM-Session`), alternating per session between the
# question and the question with the mock's answer brought back, so the implicit rules fire on
# every request (a `reask`, then a `continued`); NM_IMPLICIT_RULES=off measures the same load
# with the rules off. SCOPED=1 sends
# the requests with a service key scoped to provider openai, models gpt-4o* and agent bench
# (created through the CLI once the gateway runs; gateway and dataplane targets) instead of the
# unscoped bootstrap key: what the scope check costs. EXPERIMENT=1 creates an experiment on agent
# bench through the CLI once the gateway runs (gateway and dataplane targets; two arms on openai,
# gpt-4o and gpt-4.1, so every request's model is rewritten) and sends the requests in SESSIONS
# sessions (100 unless set): what assignment and the rewrite cost. Compare with SESSIONS=100
# alone. The script checks that an answer names its arm (NM-Variant) before it measures.
# BUDGETS=0 sets no budget (requests skip
# the budget path); the default, BUDGETS=1, a default end-user budget (dollars a day and
# requests a minute, both far from reached) that every request passes, leases included.
# BUDGETS=2..5 add budgets every request must also pass, each far from reached: the agent
# `bench`, the model `gpt-4o-mini`, the default for keys, the env `production`. NM_ENV_HEADER=E
# sends `NM-Env: E` with every request (give it to every run compared with BUDGETS=5).
# Needs valgrind and wrk (Debian: apt-get install valgrind wrk). Prints the requests served, the
# user-space instructions per request, and the costliest functions (inclusive).
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:-gateway}
secs=${SECS:-15}
stream=$([ "${STREAM:-0}" = 1 ] && echo ',"stream":true,"stream_options":{"include_usage":true}' || true)
bin=${BIN_DIR:-target/dist}
gateway=${GATEWAY_BIN:-$bin/nm-gateway}
key=nmk_5d8a1f3c7e9b2d4f6a8c0e1b3d5f7a9c2e4b6d8f0a1c3e57
for tool in valgrind callgrind_control callgrind_annotate wrk; do
  command -v "$tool" >/dev/null || { echo "callgrind.sh: $tool not found" >&2; exit 1; }
done
# THREADS=1: a profile per thread, and each thread's share printed.
threads=$([ "${THREADS:-0}" = 1 ] && echo --separate-threads=yes || true)
dir=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; pkill -P $$ -x sleep 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT


# The helpers exit when their stdin closes: keep a pipe open for them.
sleep infinity | "$bin/nm-bench" mock --port-file "$dir/mock.port" &
pids+=($!)
for _ in $(seq 50); do [ -f "$dir/mock.port" ] && break; sleep 0.1; done
mock=127.0.0.1:$(cat "$dir/mock.port")

if [ "${TRACED:-0}" = 1 ]; then
  sleep infinity | "$bin/nm-bench" collector --port-file "$dir/collector.port" &
  pids+=($!)
  for _ in $(seq 50); do [ -f "$dir/collector.port" ] && break; sleep 0.1; done
  export OTEL_TRACES_SAMPLER=always_on OTEL_SERVICE_NAME=callgrind
  export OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:$(cat "$dir/collector.port")
fi

# The default log filter, or the one given; the "listening on" lines are always let through.
export NM_LOG="${NM_LOG:-info},nm_gateway::app=info"

wait_for() { for _ in $(seq 120); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.5; done; echo "callgrind.sh: $1 did not answer" >&2; exit 1; }
# The address a process logged as "<what> listening on ADDR" (ports are picked by the system,
# so runs side by side do not meet).
listening() {
  for _ in $(seq 240); do
    addr=$(grep -o "$2 listening on [0-9.:]*" "$1" 2>/dev/null | head -n1 | awk '{print $NF}')
    [ -n "$addr" ] && { echo "$addr"; return 0; }
    sleep 0.5
  done
  echo "callgrind.sh: no \"$2 listening\" in $1" >&2; cat "$1" >&2; exit 1
}
budget() {  # budget rules every request passes (BUDGETS=0: none; N: the first N scopes)
  local n=${BUDGETS:-1} i=0 scope
  for scope in "--default" "--agent bench" "--model gpt-4o-mini" "--default-key" "--env production"; do
    [ "$i" -ge "$n" ] && break
    # shellcheck disable=SC2086
    NM_CONTROLPLANE_URL=http://$1 NM_ADMIN_KEY=$key "$gateway" budgets set \
      $scope --usd-per-day 1000000 --rpm 1000000 >/dev/null
    i=$((i + 1))
  done
  [ "$n" -gt 0 ] && sleep 2   # every dataplane has the rules (a full state on change)
  return 0
}

case "$target" in
gateway)
  NM_HTTP_ADDR=127.0.0.1:0 NM_GRPC_ADDR=127.0.0.1:0 \
    NM_DATABASE_URL="sqlite://$dir/gw.db?mode=rwc" NM_SPOOL_DIR="$dir/spool" \
    NM_BOOTSTRAP_KEY=$key NM_UPSTREAM_OPENAI=http://$mock \
    valgrind --tool=callgrind $threads --callgrind-out-file="$dir/cg.out" "$gateway" serve \
    >"$dir/target.log" 2>&1 &
  pids+=($!)
  http=$(listening "$dir/target.log" "dataplane HTTP")
  wait_for "http://$http/health"
  cp=$(listening "$dir/target.log" "controlplane gRPC")
  budget "$cp"
  url=http://$http/openai/v1/chat/completions
  ;;
dataplane)
  secret=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
  NM_GRPC_ADDR=127.0.0.1:0 NM_DATABASE_URL="sqlite://$dir/cp.db?mode=rwc" \
    NM_BOOTSTRAP_KEY=$key NM_LINK_SECRET=$secret OTEL_SERVICE_NAME=callgrind-cp \
    "$gateway" controlplane >"$dir/controlplane.log" 2>&1 &
  pids+=($!)
  grpc=$(listening "$dir/controlplane.log" "controlplane gRPC")
  NM_HTTP_ADDR=127.0.0.1:0 NM_CONTROLPLANE_URL=http://$grpc NM_LINK_SECRET=$secret \
    NM_SPOOL_DIR="$dir/spool" NM_UPSTREAM_OPENAI=http://$mock \
    valgrind --tool=callgrind $threads --callgrind-out-file="$dir/cg.out" "$gateway" dataplane \
    >"$dir/target.log" 2>&1 &
  pids+=($!)
  http=$(listening "$dir/target.log" "dataplane HTTP")
  wait_for "http://$http/health"
  cp=$grpc
  budget "$grpc"
  url=http://$http/openai/v1/chat/completions
  ;;
forwarder)
  sleep infinity | valgrind --tool=callgrind $threads --callgrind-out-file="$dir/cg.out" \
    "$bin/nm-bench" forwarder --upstream "$mock" --port-file "$dir/fwd.port" >"$dir/target.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 120); do [ -f "$dir/fwd.port" ] && break; sleep 0.5; done
  url=http://127.0.0.1:$(cat "$dir/fwd.port")/v1/chat/completions
  ;;
*) echo "usage: bench/callgrind.sh [gateway|dataplane|forwarder]" >&2; exit 64 ;;
esac
measured=${pids[-1]}   # valgrind runs its tool in its own process: this pid

reqkey=$key
if [ "${SCOPED:-0}" = 1 ] && [ "$target" != forwarder ]; then
  reqkey=$(NM_CONTROLPLANE_URL=http://$cp NM_ADMIN_KEY=$key "$gateway" keys create --name scoped \
    --providers openai --models 'gpt-4o*' --agents bench --json | sed -n 's/.*"secret":"\([^"]*\)".*/\1/p')
  [ -n "$reqkey" ] || { echo "callgrind.sh: could not create the scoped key" >&2; exit 1; }
  sleep 2   # every dataplane has the key (pushed on change)
fi
sessions=${SESSIONS:-0}
if [ "${EXPERIMENT:-0}" = 1 ] && [ "$target" != forwarder ]; then
  [ "$sessions" = 0 ] && sessions=100
  NM_CONTROLPLANE_URL=http://$cp NM_ADMIN_KEY=$key "$gateway" experiments create --agent bench \
    --arm a=openai:gpt-4o:1 --arm b=openai:gpt-4.1:1 >/dev/null \
    || { echo "callgrind.sh: could not create the experiment" >&2; exit 1; }
  # Every dataplane has it once its next key snapshot came (pushed on change).
  for _ in $(seq 20); do
    curl -s -o /dev/null -D - "$url" -H "NM-Key: $reqkey" -H "NM-Agent: bench" \
      -H "NM-Session: sess_bench0" -H "Content-Type: application/json" \
      -d '{"model":"gpt-4o-mini"}' | grep -qi '^nm-variant:' && break
    sleep 0.5
  done
  curl -s -o /dev/null -D - "$url" -H "NM-Key: $reqkey" -H "NM-Agent: bench" \
    -H "NM-Session: sess_bench0" -H "Content-Type: application/json" \
    -d '{"model":"gpt-4o-mini"}' | grep -qi '^nm-variant:' \
    || { echo "callgrind.sh: the experiment does not reach the requests" >&2; exit 1; }
fi
cat > "$dir/req.lua" <<LUA
wrk.method = "POST"
wrk.body = '{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Say hello to the benchmark."}],"max_tokens":64$stream}'
-- The same question with the mock's answer brought back and a follow-up (SESSIONS=N).
followup = '{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Say hello to the benchmark."},{"role":"assistant","content":"Hello from the nm-bench mock upstream. This reply is canned."},{"role":"user","content":"Thanks."}],"max_tokens":64$stream}'
question = wrk.body
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer sk-bench"
wrk.headers["NM-Key"] = "$reqkey"
wrk.headers["NM-Agent"] = "bench"
if "${NM_ENV_HEADER:-}" ~= "" then wrk.headers["NM-Env"] = "${NM_ENV_HEADER:-}" end
sessions = $sessions
n = 0
request = function()
  n = n + 1
  wrk.headers["NM-User"] = "bench-user-" .. (n % 100)
  if sessions > 0 then
    wrk.headers["NM-Session"] = "sess_bench" .. (n % sessions)
    if math.floor(n / sessions) % 2 == 0 then wrk.body = question else wrk.body = followup end
  end
  return wrk.format()
end
LUA

wrk -t1 -c10 -d5s -s "$dir/req.lua" "$url" >/dev/null   # warm up
sleep 1
callgrind_control -z "$measured" >/dev/null 2>&1
out=$(wrk -t1 -c10 -d"${secs}s" -s "$dir/req.lua" "$url")
sleep 1.5   # the gateway stores (or ships) its last batch of records
callgrind_control -d "$measured" >/dev/null 2>&1 || true
requests=$(echo "$out" | awk '/requests in/ {print $1}')
# On a busy machine the dump can finish after callgrind_control returns.
for _ in $(seq 120); do ls "$dir"/cg.out.* >/dev/null 2>&1 && break; sleep 0.5; done
sleep 1
dumps=$(ls "$dir"/cg.out.*)
dump=$(echo "$dumps" | head -n1)
# A profile's instructions (0 for a thread that ran none in the measure: its total reads ".").
instructions() {
  callgrind_annotate "$1" 2>/dev/null \
    | awk 'BEGIN {n = "0"} /PROGRAM TOTALS/ {gsub(",", "", $1); if ($1 ~ /^[0-9]+$/) n = $1} END {print n}'
}
total=0
for d in $dumps; do total=$((total + $(instructions "$d"))); done
if [ -n "${KEEP:-}" ]; then
  if [ "$(echo "$dumps" | wc -l)" = 1 ]; then cp "$dump" "$KEEP"
  else for d in $dumps; do cp "$d" "$KEEP.${d##*.}"; done; fi
  echo "callgrind.sh: profile kept in $KEEP ($requests requests)"
fi
echo "$target: $requests requests, $((total / requests)) instructions per request (user space)"
if [ -n "$threads" ]; then
  echo "per thread (instructions per request, the thread's costliest function of ours or its libraries):"
  for d in $dumps; do
    n=$(instructions "$d")
    [ "$((n / requests))" -ge 10 ] || continue
    top=$(callgrind_annotate --inclusive=yes "$d" 2>/dev/null | sed -n '/file:function/,$p' | sed -n '3,$p' \
      | grep -Ev 'clone\.S|pthread_create|libc-start|std::sys::|thread_start|FnOnce|tokio::runtime::|^$' \
      | head -n 1 | sed -E 's/^ *[0-9,]+ +\([^)]*\) +//; s/^[^ ]*\.(rs|c|h|S)://; s/ \[[^]]*\]$//' \
      | cut -c1-100) || true
    printf '%9d/req  thread %s  %s\n' "$((n / requests))" "${d##*-}" "$top"
  done
fi
# The runtime's frames (threads, tokio's scheduler) enclose everything: left out. (One profile
# only: with THREADS=1, the per-thread lines above stand for it.)
[ -n "$threads" ] || callgrind_annotate --inclusive=yes "$dump" 2>/dev/null | sed -n '/file:function/,$p' | sed -n '3,$p' \
  | grep -Ev 'clone\.S|pthread_create|std::sys::|thread_start|FnOnce|tokio::runtime::' | head -n 30 \
  | awk -v n="$requests" '{c=$1; gsub(",", "", c); $1=""; $2=""; printf "%9d/req %s\n", c/n, substr($0, 1, 150)}' || true   # head closes the pipe early
