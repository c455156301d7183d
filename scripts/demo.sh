#!/usr/bin/env bash
# The main job, on CPU: shardcoordd plus the example VLM trainer as 4 rank processes in 2
# shard groups, with skewed mixed media (even ranks see more images than odd ones). The
# frozen vision tower and projector are sharded across each group and placed, per
# microbatch, by the coordinator. Shows live status while it trains, then the groups and a
# summary per rank: decisions by kind, fallbacks, bytes gathered, peak frozen memory.
#
#   scripts/demo.sh                 (DEMO_POLICY=auto|per_layer|root|replicate, DEMO_STEPS=40)
#   scripts/demo.sh --replay        the trace replay instead: 8 simulated ranks, 2 groups
#
# At the end the daemon and its status page stay up until Enter is pressed (on a terminal)
# or for DEMO_HOLD_S seconds (default 60; 0 ends at once) when not on a terminal.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# A build of its own, made to compile fast on a fresh machine (unity batches, -O1, no debug
# information, no tests, no NCCL): about 100 s on 2 cores, against 260 s for the full build.
build=${DEMO_BUILD_DIR:-$root/build-demo}
policy=${DEMO_POLICY:-auto}
steps=${DEMO_STEPS:-40}
mode=${1:-train}

echo "== building shardcoordd, shardctl, vlm_trainer into $build (installs missing Debian packages first)"
"$root/scripts/install-deps.sh" demo
if [[ ! -f "$build/build.ninja" ]]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=None -DCMAKE_CXX_FLAGS=-O1 -DCMAKE_UNITY_BUILD=ON \
    -DSHARDCOORD_WITH_TORCH=ON -DSHARDCOORD_WITH_NCCL=OFF -DSHARDCOORD_WITH_PYTHON=OFF \
    -DSHARDCOORD_BUILD_TESTS=OFF -DSHARDCOORD_BUILD_BENCHMARKS=OFF >/dev/null
fi
cmake --build "$build" --target shardcoordd shardctl vlm_trainer >/dev/null
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
  --heartbeat-timeout-ms 2000 --http-listen 127.0.0.1:0 --http-address-file "$work/http" \
  --journal-file "$work/events.db" >"$work/shardcoordd.log" 2>&1 &
coord_pid=$!
for _ in $(seq 1 100); do [[ -s "$work/addr" ]] && break; sleep 0.1; done
[[ -s "$work/addr" ]] || { echo "shardcoordd did not start; see $work/shardcoordd.log" >&2; exit 1; }
export SHARDCOORD_ADDR=$(cat "$work/addr")
echo "   listening on $SHARDCOORD_ADDR; status page http://$(cat "$work/http")/ (also: shardctl watch)"

if [[ "$mode" == "--replay" ]]; then
  echo "== 8 simulated rank processes (2 groups of 4) replaying examples/traces/mixed_8ranks.jsonl"
  for r in 0 1 2 3 4 5 6 7; do
    "$shardctl" replay "$root/examples/traces/mixed_8ranks.jsonl" --job-id demo --world-size 8 --group-size 4 \
      --ranks "$r" --policy "$policy" --interval-ms 150 --per-rank --output "$work/rank$r.jsonl" \
      2>"$work/rank$r.log" &
    pids+=($!)
  done
else
  echo "== vlm_trainer: 4 CPU ranks in 2 shard groups, policy $policy, $steps steps x 2 microbatches, skewed media"
  for r in 0 1 2 3; do
    SHARDCOORD_LOG_LEVEL=warn "$build/examples/vlm_trainer/vlm_trainer" --job demo --rank "$r" --world-size 4 \
      --group-size 2 --policy "$policy" --media mixed --image-fraction 0.5 --skew 0.3 --steps "$steps" \
      --accum 2 --memory-budget-bytes 1048576 --interval-ms 100 >"$work/rank$r.out" 2>"$work/rank$r.log" &
    pids+=($!)
  done
fi

running() { for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }
deadline=$((SECONDS + 300))
while running && (( SECONDS < deadline )); do
  echo "-- live status ($(date +%T))"
  "$shardctl" status --job demo 2>/dev/null || echo "   (waiting for the ranks to register)"
  sleep 1
done

failed=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "rank $i failed:" >&2; tail -n 3 "$work/rank$i.log" >&2; failed=1
  fi
done
pids=()

echo "== final status"
"$shardctl" status --job demo
echo "== groups"
"$shardctl" groups --job demo
echo "== communicators"
"$shardctl" comms --job demo
if [[ "$mode" == "--replay" ]]; then
  echo "== summary (from what each rank process received)"
  "$shardctl" verify "$work"/rank*.jsonl
else
  echo "== summary per rank (decisions by kind, fallbacks to root, bytes gathered, peak frozen memory)"
  for r in 0 1 2 3; do grep summary "$work/rank$r.out" || true; done
  echo "== final loss and trained-parameter hash per rank (identical hash: the ranks agree)"
  for r in 0 1 2 3; do echo "rank $r: $(grep '^step' "$work/rank$r.out" | tail -n 1) $(grep final "$work/rank$r.out")"; done
fi

hold=${DEMO_HOLD_S:-60}
echo "== the daemon is still up: status page http://$(cat "$work/http")/"
echo "   try: $shardctl --coordinator $SHARDCOORD_ADDR events --job demo --limit 20"
echo "        $shardctl --coordinator $SHARDCOORD_ADDR watch"
if [[ -t 0 && -t 1 ]]; then
  read -r -p "   press Enter to stop it " _ || true
elif (( hold > 0 )); then
  echo "   (not on a terminal: stopping it in $hold s; DEMO_HOLD_S sets how long)"
  sleep "$hold"
fi
exit $failed
