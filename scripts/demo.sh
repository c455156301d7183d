#!/usr/bin/env bash
# The main job, on CPU: shardcoordd plus an 8-rank job in 2 shard groups, each rank its
# own process playing its part of a mixed-modality trace through the worker library.
# Shows live status while it runs, then the groups, recent decisions and a summary, and
# checks that every rank of each group received identical decisions.
#
#   scripts/demo.sh [TRACE.jsonl]        (default: examples/traces/mixed_8ranks.jsonl)
# Environment: DEMO_INTERVAL_MS (pace per microbatch, default 150), DEMO_POLICY (auto).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
trace=${1:-$root/examples/traces/mixed_8ranks.jsonl}
interval=${DEMO_INTERVAL_MS:-150}
policy=${DEMO_POLICY:-auto}

"$root/scripts/build.sh" shardcoordd shardctl >/dev/null
shardcoordd=$build/coordinator/shardcoordd
shardctl=$build/client/shardctl

work=$(mktemp -d /tmp/shardcoord-demo.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [[ -n "${coord_pid:-}" ]] && kill -TERM "$coord_pid" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap cleanup EXIT

echo "== starting shardcoordd (logs: $work/shardcoordd.log)"
"$shardcoordd" --listen 127.0.0.1:0 --address-file "$work/addr" --heartbeat-interval-ms 200 \
  --heartbeat-timeout-ms 2000 >"$work/shardcoordd.log" 2>&1 &
coord_pid=$!
for _ in $(seq 1 100); do [[ -s "$work/addr" ]] && break; sleep 0.1; done
[[ -s "$work/addr" ]] || { echo "shardcoordd did not start; see $work/shardcoordd.log" >&2; exit 1; }
export SHARDCOORD_ADDR=$(cat "$work/addr")
echo "   listening on $SHARDCOORD_ADDR"

echo "== 8 rank processes (2 shard groups of 4), policy $policy, one microbatch every ${interval} ms"
for r in 0 1 2 3 4 5 6 7; do
  "$shardctl" replay "$trace" --job-id demo --world-size 8 --group-size 4 --ranks "$r" \
    --policy "$policy" --interval-ms "$interval" --per-rank --output "$work/rank$r.jsonl" \
    2>"$work/rank$r.log" &
  pids+=($!)
done

running() { for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }
deadline=$((SECONDS + 120))
while running && (( SECONDS < deadline )); do
  echo "-- live status ($(date +%T))"
  "$shardctl" status --job demo || true
  sleep 1
done

failed=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "rank $i failed:" >&2; tail -3 "$work/rank$i.log" >&2; failed=1
  fi
done
pids=()

echo "== final status"
"$shardctl" status --job demo
echo "== groups"
"$shardctl" groups --job demo
echo "== last 2 decisions of group 1"
"$shardctl" decisions --job demo --group 1 --limit 2
echo "== summary (from what each rank process received)"
"$shardctl" verify "$work"/rank*.jsonl
exit $failed
