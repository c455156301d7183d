#!/usr/bin/env bash
# Runs the decision_load matrix recorded in docs/BENCHMARKS.md: a separate shardcoordd
# process (as deployed) and the load generator as another process, at 8, 64, 512 and 4096
# ranks in groups of 8; one plan per message, then 8 per message (a prefetching loader).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
"$root/scripts/build.sh" shardcoordd decision_load >/dev/null
work=$(mktemp -d)
"$build/coordinator/shardcoordd" --listen 127.0.0.1:0 --address-file "$work/addr" \
  --heartbeat-timeout-ms 120000 --log-level warn &
coord=$!
trap 'kill -TERM $coord 2>/dev/null; wait $coord 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 100); do [[ -s "$work/addr" ]] && break; sleep 0.1; done
addr=$(cat "$work/addr")
echo "# $(date -u +%F) $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo "## one plan per message, lookahead 4"
"$build/bench/decision_load" --coordinator "$addr" --ranks 8,64,512,4096 --microbatches ${MICROBATCHES:-100} "$@"
echo "## 8 plans per message, lookahead 16"
"$build/bench/decision_load" --coordinator "$addr" --ranks 8,64,512,4096 --microbatches ${MICROBATCHES:-100} --batch 8 --lookahead 16 "$@"
echo "## paced like trainers: every rank releases one microbatch per 1/rate s, all ranks at once"
for spec in "8 50" "64 50" "512 20" "4096 5"; do
  set -- $spec
  echo "### $1 ranks, $2 microbatches/s per rank, lookahead 4"
  "$build/bench/decision_load" --coordinator "$addr" --ranks "$1" --rate "$2" --microbatches 40
done
