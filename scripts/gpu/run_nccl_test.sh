#!/usr/bin/env bash
# Runs on the GPU machine (two GPUs), from the repository root, with the bundle from
# scripts/gpu/bundle.sh in .gpu/. The NCCL scenario of the communicators issue:
#   1. rendezvous through shardcoordd, 2 ranks on 2 GPUs, checked all-gather, all-reduce
#      and broadcast;
#   2. kill -9 one rank during a loop of collectives: the survivor's collective fails with
#      ABORTED naming the lost rank within the deadline, `shardctl comms` shows the epoch
#      aborted; a replacement registers, epoch 2 forms, collectives are correct again.
# Every wait is bounded. Output: stdout and ${OUT:-/tmp}/nccl_test.log.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
b=$root/.gpu
out=${OUT:-/tmp}
log=$out/nccl_test.log
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64:$b/lib
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the shared host.
work=$(mktemp -d)
exec > >(tee "$log") 2>&1
fail=0
check() { if eval "$2"; then echo "PASS: $1"; else echo "FAIL: $1"; fail=1; fi; }
wait_for() { local deadline=$((SECONDS + $1)); shift; while (( SECONDS < deadline )); do eval "$1" && return 0; sleep 0.2; done; return 1; }

echo "== $(date -u +%FT%TZ) $(hostname)"
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
echo "NCCL: $(ls /usr/lib/x86_64-linux-gnu/libnccl.so.* 2>/dev/null | head -1)"

"$b/bin/shardcoordd" --listen 127.0.0.1:0 --address-file "$work/addr" --heartbeat-interval-ms 100 \
  --heartbeat-timeout-ms 1500 --log-level warn 2>"$work/daemon.err" &
coord=$!
trap 'kill -9 $coord $(jobs -p) 2>/dev/null' EXIT
wait_for 20 '[[ -s $work/addr ]]' || { echo "FAIL: shardcoordd did not start"; cat "$work/daemon.err"; exit 1; }
addr=$(cat "$work/addr")
pid=0
rank() {  # rank JOB R ITER INTERVAL_MS TAG [extra]; sets $pid (a child of this shell)
  "$b/bin/comm_rank" --coordinator "$addr" --job "$1" --rank "$2" --world-size 2 --group-size 2 --comm world \
    --backend nccl --iterations "$3" --interval-ms "$4" --op-timeout-ms 10000 "${@:6}" \
    >"$work/$1-$2$5.out" 2>"$work/$1-$2$5.err" &
  pid=$!
}
finish() {  # finish PID SECONDS: its exit code, killing it after SECONDS
  local deadline=$((SECONDS + $2))
  while kill -0 "$1" 2>/dev/null && (( SECONDS < deadline )); do sleep 0.2; done
  kill -9 "$1" 2>/dev/null
  wait "$1"
}
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }

echo "== 1. rendezvous and checked collectives on 2 GPUs"
rank basic 0 50 0 ""; p0=$pid
rank basic 1 50 0 ""; p1=$pid
finish $p0 120; r0=$?
finish $p1 120; r1=$?
check "rank 0 finished 50 checked iterations (exit $r0)" '[[ $r0 == 0 ]] && grep -q "iteration 49 epoch 1 ok" $work/basic-0.out'
check "rank 1 finished 50 checked iterations (exit $r1)" '[[ $r1 == 0 ]] && grep -q "iteration 49 epoch 1 ok" $work/basic-1.out'
[[ $fail == 0 ]] || tail -n 5 "$work"/basic-*.err

echo "== 2. kill -9 during collectives, abort, replacement, epoch 2"
rank kill 0 3000 2 "" --rejoin; p0=$pid
rank kill 1 3000 2 "" --rejoin; p1=$pid
wait_for 60 '[[ $(grep -c " ok" $work/kill-0.out 2>/dev/null) -ge 100 ]]'
kill -9 "$p1"; wait "$p1" 2>/dev/null; t0=$(now_ms)
wait_for 10 'grep -q ABORTED $work/kill-0.err'; t1=$(now_ms)
check "survivor's collective failed with ABORTED naming rank 1, $((t1 - t0)) ms after the kill" 'grep -q "ABORTED.*rank 1" $work/kill-0.err'
"$b/bin/shardctl" comms --coordinator "$addr" | tee "$work/comms-aborted.txt"
check "shardctl comms shows epoch 1 aborted, lost rank 1" 'grep -q "world .* 1 aborted" $work/comms-aborted.txt'
rank kill 1 3000 0 "-replacement" --rejoin; p1=$pid
finish $p0 300; r0=$?
finish $p1 300; r1=$?
check "survivor finished in epoch 2 (exit $r0)" '[[ $r0 == 0 ]] && grep -q "iteration 2999 epoch 2 ok" $work/kill-0.out'
check "replacement finished in epoch 2 (exit $r1)" '[[ $r1 == 0 ]] && grep -q "iteration 2999 epoch 2 ok" $work/kill-1-replacement.out'
"$b/bin/shardctl" comms --coordinator "$addr"
echo "-- survivor stderr"; tail -n 4 "$work/kill-0.err"
cp "$work"/kill-0.err "$work"/daemon.err "$out"/ 2>/dev/null || true
echo "== result: $([[ $fail == 0 ]] && echo ALL PASSED || echo FAILURES)"
exit $fail
