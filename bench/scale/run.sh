#!/usr/bin/env bash
# The scale matrix of docs/BENCHMARKS.md ("Issue 14") on a machine with many cores: the
# daemon pinned to D cores (taskset) with D session threads, the load generator (several
# processes, bench/decision_load --procs) pinned to the other cores. Each line names the
# daemon (this commit's, or the baseline's from bench/scale/bundle.sh BASELINE_COMMIT), each
# against the load generator built from its own commit.
#
#   bench/scale/run.sh            (after bench/scale/bundle.sh; from the repository root)
#
# Environment: DAEMON_CORES ("1 2 4 8"), DAEMONS ("shardcoordd-baseline shardcoordd"),
# SESSION_THREADS (session threads of every daemon; default: its cores), SECTIONS (which tables, in this order; default "batched single paced comms"; also
# "heartbeats"), REPEAT (rows per daemon and core count, the daemons alternating; 1),
# DEADLINE_S (decision_load --deadline-s; 300), SPLIT_ONLY=1 (the split table only),
# PERF_DIR (a folder: each row's daemon is sampled by `perf record -F 499` into it, as
# DAEMON-CORES-N.data; perf from the system, else the one bundle.sh packed with WITH_PERF=1).
# What decision_load says on stderr (communicator set-up, heartbeats sent) follows each table.
set -euo pipefail
dir=$(cd "${BUNDLE:-.gpu-scale}" && pwd)
export LD_LIBRARY_PATH=$dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cores=$(nproc)
gen_cores=${GEN_CORES:-$((cores / 2))}
work=$(mktemp -d)
trap 'pkill -P $$ 2>/dev/null || true; rm -rf "$work"' EXIT
echo "# $(date -u +%FT%TZ) $(hostname) $cores cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)); generator on $gen_cores cores"
echo "# shardcoordd $(cat "$dir/commit"), baseline $(cat "$dir/baseline-commit" 2>/dev/null || echo none)"
perf=()
if [[ -n "${PERF_DIR:-}" ]]; then
  mkdir -p "$PERF_DIR"
  if command -v perf >/dev/null && perf --version >/dev/null 2>&1; then
    perf=(perf)
  elif [[ -f "$dir/perf.tar.xz" ]]; then
    tar -C "$work" -xJf "$dir/perf.tar.xz"
    perf=(env LD_LIBRARY_PATH="$work/perf/lib" "$work/perf/bin/perf")
    "${perf[@]}" --version >/dev/null 2>&1 || perf=()
  fi
  [[ ${#perf[@]} -gt 0 ]] || echo "# PERF_DIR: no working perf here; rows not sampled"
fi

# run DAEMON DAEMON_CORES -- decision_load args...
run() {
  local daemon=$1 dcores=$2
  shift 3
  [[ -x "$dir/bin/$daemon" ]] || return 0
  # As many session threads as cores, for every daemon that has the flag (since fef9399): left
  # to its default, a daemon takes one per core of the machine, not of its taskset.
  local threads=() help
  help=$("$dir/bin/$daemon" --help 2>&1 || true)
  [[ $help == *--session-threads* ]] && threads=(--session-threads "${SESSION_THREADS:-$dcores}")
  rm -f "$work/addr"
  taskset -c 0-$((dcores - 1)) "$dir/bin/$daemon" --listen 127.0.0.1:0 --address-file "$work/addr" \
    --heartbeat-timeout-ms 120000 --log-level warn --max-world-size 65536 "${threads[@]}" &
  local pid=$!
  for _ in $(seq 200); do [[ -s "$work/addr" ]] && break; sleep 0.05; done
  local line perf_pid=
  if [[ ${#perf[@]} -gt 0 ]]; then
    local n=1
    while [[ -e "$PERF_DIR/$daemon-$dcores-$n.data" ]]; do n=$((n + 1)); done
    "${perf[@]}" record -F 499 -p $pid -o "$PERF_DIR/$daemon-$dcores-$n.data" >/dev/null 2>"$work/perf.err" &
    perf_pid=$!
  fi
  # Each daemon against the load generator of its own commit (they speak its wire).
  local gen=$dir/bin/decision_load
  [[ $daemon == shardcoordd-baseline && -x $dir/bin/decision_load-baseline ]] && gen=$dir/bin/decision_load-baseline
  line=$(taskset -c $((cores - gen_cores))-$((cores - 1)) "$gen" --coordinator "$(cat "$work/addr")" \
    --procs "$gen_cores" --channels $((gen_cores * 4)) --deadline-s "${DEADLINE_S:-300}" "$@" 2>"$work/err" |
    tail -1) || true
  sed "s/^/- $daemon on $dcores cores: /" "$work/err" >> "$work/notes"
  rm -f "$work/err"
  if [[ -n "$perf_pid" ]]; then
    kill -INT $perf_pid 2>/dev/null || true
    wait $perf_pid 2>/dev/null || true
  fi
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
  notes
  echo
  echo "### $1"
  echo "| daemon | daemon cores | ranks | groups | plans | seconds | plans/s | p50 (us) | p99 (us) | max (us) | failures |$2 daemon peak RSS | daemon CPU |"
}
# What decision_load wrote on stderr since the last table.
notes() {
  if [[ -s "$work/notes" ]]; then
    echo
    cat "$work/notes"
  fi
  rm -f "$work/notes"
}

# rows ARGS...: one row per daemon core count, daemon and repetition (the daemons alternate).
rows() {
  for d in "${daemon_cores[@]}"; do
    for _ in $(seq "${REPEAT:-1}"); do
      for daemon in "${daemons[@]}"; do
        run $daemon "$d" -- "$@"
      done
    done
  done
}

IFS=' ' read -r -a daemon_cores <<< "${DAEMON_CORES:-1 2 4 8}"
IFS=' ' read -r -a daemons <<< "${DAEMONS:-shardcoordd-baseline shardcoordd}"
if [[ -n "${SPLIT_ONLY:-}" ]]; then
  header "paced, 16384 ranks x 5 microbatches/s, one daemon against the groups split over two" " stalled | p99 stall (us) |"
  run shardcoordd 8 -- --ranks 16384 --rate 5 --microbatches 40
  split 2 8 -- --ranks 16384 --rate 5 --microbatches 40
  notes
  exit 0
fi
for section in ${SECTIONS:-batched single paced comms}; do
  case $section in
    batched)
      header "saturated, 4096 ranks, 8 plans per message, lookahead 16" ""
      rows --ranks 4096 --microbatches 200 --batch 8 --lookahead 16 ;;
    single)
      header "saturated, 4096 ranks, 1 plan per message, lookahead 4" ""
      rows --ranks 4096 --microbatches 200 ;;
    paced)
      header "paced, 16384 ranks x 5 microbatches/s, lookahead 4" " stalled | p99 stall (us) |"
      rows --ranks 16384 --rate 5 --microbatches 40 ;;
    comms)
      # Every rank joins the job's "world" communicator before the run (CommJoin, CommReport
      # ready), then heartbeats every interval (the daemon's, 500 ms) with its progress.
      header "paced, 16384 ranks x 5 microbatches/s, lookahead 4, every rank in the world communicator, heartbeats with its progress every 500 ms" " stalled | p99 stall (us) |"
      rows --ranks 16384 --rate 5 --microbatches 40 --comms world ;;
    heartbeats)
      # The control for comms: the same heartbeats without a communicator.
      header "paced, 16384 ranks x 5 microbatches/s, lookahead 4, heartbeats every 500 ms, no communicator" " stalled | p99 stall (us) |"
      rows --ranks 16384 --rate 5 --microbatches 40 --heartbeat-ms 500 ;;
    *) echo "unknown section '$section'" >&2; exit 2 ;;
  esac
done
notes
