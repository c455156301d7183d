#!/usr/bin/env bash
# The scale matrix of docs/BENCHMARKS.md ("Issue 14") on a machine with many cores: the
# daemon pinned to D cores (taskset) with D session threads, the load generator (several
# processes, bench/decision_load --procs) pinned to the other cores. Each line names the
# daemon (this commit's, or the baseline's from bench/scale/bundle.sh BASELINE_COMMIT).
#
#   bench/scale/run.sh            (after bench/scale/bundle.sh; from the repository root)
set -euo pipefail
dir=$(cd "${BUNDLE:-.gpu-scale}" && pwd)
export LD_LIBRARY_PATH=$dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cores=$(nproc)
gen_cores=${GEN_CORES:-$((cores / 2))}
work=$(mktemp -d)
trap 'pkill -P $$ 2>/dev/null; rm -rf "$work"' EXIT
echo "# $(date -u +%FT%TZ) $(hostname) $cores cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)); generator on $gen_cores cores"
echo "# shardcoordd $(cat "$dir/commit"), baseline $(cat "$dir/baseline-commit" 2>/dev/null || echo none)"

# run DAEMON DAEMON_CORES -- decision_load args...
run() {
  local daemon=$1 dcores=$2
  shift 3
  [[ -x "$dir/bin/$daemon" ]] || return 0
  local threads=()
  [[ $daemon == shardcoordd ]] && threads=(--session-threads "$dcores")
  rm -f "$work/addr"
  taskset -c 0-$((dcores - 1)) "$dir/bin/$daemon" --listen 127.0.0.1:0 --address-file "$work/addr" \
    --heartbeat-timeout-ms 120000 --log-level warn --max-world-size 65536 "${threads[@]}" &
  local pid=$!
  for _ in $(seq 200); do [[ -s "$work/addr" ]] && break; sleep 0.05; done
  local line
  line=$(taskset -c $((cores - gen_cores))-$((cores - 1)) "$dir/bin/decision_load" --coordinator "$(cat "$work/addr")" \
    --procs "$gen_cores" --channels $((gen_cores * 4)) "$@" | tail -1) || true
  local hwm cpu
  hwm=$(awk '/VmHWM/ {print $2}' /proc/$pid/status)
  cpu=$(awk '{printf "%.1f", ($14 + $15) / 100}' /proc/$pid/stat)
  kill -TERM $pid
  wait $pid 2>/dev/null || true
  echo "| $daemon | $dcores $line $((hwm / 1024)) MB | $cpu s |"
}

# split K DAEMON_CORES -- decision_load args...: K daemons of this commit, each on
# DAEMON_CORES / K cores, the job's groups spread over them (the prototype of DESIGN 7).
split() {
  local k=$1 dcores=$2
  shift 3
  local per=$((dcores / k)) pids=() addrs=()
  for i in $(seq 0 $((k - 1))); do
    rm -f "$work/addr$i"
    taskset -c $((i * per))-$((i * per + per - 1)) "$dir/bin/shardcoordd" --listen 127.0.0.1:0 \
      --address-file "$work/addr$i" --heartbeat-timeout-ms 120000 --log-level warn --max-world-size 65536 \
      --session-threads "$per" &
    pids+=($!)
  done
  for i in $(seq 0 $((k - 1))); do
    for _ in $(seq 200); do [[ -s "$work/addr$i" ]] && break; sleep 0.05; done
    addrs+=("$(cat "$work/addr$i")")
  done
  local line
  line=$(taskset -c $((cores - gen_cores))-$((cores - 1)) "$dir/bin/decision_load" \
    --coordinator "$(IFS=,; echo "${addrs[*]}")" --procs "$gen_cores" --channels $((gen_cores * 4)) "$@" |
    tail -1) || true
  local hwm=0 cpu=0
  for pid in "${pids[@]}"; do
    hwm=$((hwm + $(awk '/VmHWM/ {print $2}' /proc/$pid/status)))
    cpu=$(awk -v c="$cpu" '{printf "%.1f", c + ($14 + $15) / 100}' /proc/$pid/stat)
    kill -TERM $pid
    wait $pid 2>/dev/null || true
  done
  echo "| $k x shardcoordd | $k x $per $line $((hwm / 1024)) MB | $cpu s |"
}

header() {
  echo
  echo "### $1"
  echo "| daemon | daemon cores | ranks | groups | plans | seconds | plans/s | p50 (us) | p99 (us) | max (us) | failures |$2 daemon peak RSS | daemon CPU |"
}
IFS=' ' read -r -a daemon_cores <<< "${DAEMON_CORES:-1 2 4 8}"
IFS=' ' read -r -a daemons <<< "${DAEMONS:-shardcoordd-baseline shardcoordd}"
if [[ -n "${SPLIT_ONLY:-}" ]]; then
  header "paced, 16384 ranks x 5 microbatches/s, one daemon against the groups split over two" " stalled | p99 stall (us) |"
  run shardcoordd 8 -- --ranks 16384 --rate 5 --microbatches 40
  split 2 8 -- --ranks 16384 --rate 5 --microbatches 40
  exit 0
fi
header "saturated, 4096 ranks, 8 plans per message, lookahead 16" ""
for d in "${daemon_cores[@]}"; do
  for daemon in "${daemons[@]}"; do
    run $daemon "$d" -- --ranks 4096 --microbatches 200 --batch 8 --lookahead 16
  done
done
header "saturated, 4096 ranks, 1 plan per message, lookahead 4" ""
for d in "${daemon_cores[@]}"; do
  for daemon in "${daemons[@]}"; do
    run $daemon "$d" -- --ranks 4096 --microbatches 200
  done
done
header "paced, 16384 ranks x 5 microbatches/s, lookahead 4" " stalled | p99 stall (us) |"
for d in "${daemon_cores[@]}"; do
  for daemon in "${daemons[@]}"; do
    run $daemon "$d" -- --ranks 16384 --rate 5 --microbatches 40
  done
done
