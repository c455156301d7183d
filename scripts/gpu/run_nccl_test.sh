#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with the bundle from
# scripts/gpu/bundle.sh in .gpu/. The NCCL scenario of the communicators issue, on GPUS
# ranks, one per GPU (GPUS=2 by default; GPUS=8 on an 8-GPU host; BACKEND=gloo runs the same
# scenario on CPU, to check the script itself):
#   1. rendezvous through shardcoordd, checked all-gather, all-reduce and broadcast;
#   2. kill -9 the last rank during a loop of collectives: every survivor's collective fails
#      with ABORTED naming the lost rank within the deadline, `shardctl comms` shows the
#      epoch aborted; a replacement registers, epoch 2 forms, collectives are correct again.
# SECURED=1 runs it all against a daemon with tokens and mutual TLS (certificates from the
# bundle). Every wait is bounded. Output: stdout and ${OUT:-/tmp}/nccl_test.log.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
b=$root/.gpu
out=${OUT:-/tmp}
log=$out/nccl_test.log
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64:$b/lib
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the shared host.
work=$(mktemp -d)
gpus=${GPUS:-2}
last=$((gpus - 1))
exec > >(tee "$log") 2>&1
fail=0
check() { if eval "$2"; then echo "PASS: $1"; else echo "FAIL: $1"; fail=1; fi; }
wait_for() { local deadline=$((SECONDS + $1)); shift; while (( SECONDS < deadline )); do eval "$1" && return 0; sleep 0.2; done; return 1; }

echo "== $(date -u +%FT%TZ) $(hostname)"
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
echo "NCCL: $(ls /usr/lib/x86_64-linux-gnu/libnccl.so.* 2>/dev/null | head -1)"

secured=()
ctl=("$b/bin/shardctl")
if [[ "${SECURED:-0}" == 1 ]]; then
  c=$b/certs
  chmod 600 "$c"/*.key "$c/tokens"
  secured=(--token-file "$c/tokens" --tls-cert-file "$c/server.pem" --tls-key-file "$c/server.key" --tls-client-ca-file "$c/ca.pem")
  export SHARDCOORD_TOKEN=rank-gpu-token-0123456789abcdef SHARDCOORD_TLS_CA=$c/ca.pem
  export SHARDCOORD_TLS_CERT=$c/client.pem SHARDCOORD_TLS_KEY=$c/client.key
  ctl=(env SHARDCOORD_TOKEN=read-gpu-token-0123456789abcdef "$b/bin/shardctl")
  echo "secured: tokens and mutual TLS"
fi
"$b/bin/shardcoordd" --listen 127.0.0.1:0 --address-file "$work/addr" --heartbeat-interval-ms 100 \
  --heartbeat-timeout-ms 1500 --log-level warn "${secured[@]}" 2>"$work/daemon.err" &
coord=$!
trap 'kill -9 $coord $(jobs -p) 2>/dev/null' EXIT
wait_for 20 '[[ -s $work/addr ]]' || { echo "FAIL: shardcoordd did not start"; cat "$work/daemon.err"; exit 1; }
addr=$(cat "$work/addr")
pid=0
rank() {  # rank JOB R ITER INTERVAL_MS TAG [extra]; sets $pid (a child of this shell)
  "$b/bin/comm_rank" --coordinator "$addr" --job "$1" --rank "$2" --world-size "$gpus" --group-size "$gpus" --comm world \
    --backend "${BACKEND:-nccl}" --iterations "$3" --interval-ms "$4" --op-timeout-ms 10000 "${@:6}" \
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

echo "== 1. rendezvous and checked collectives on $gpus GPUs"
pids=()
for r in $(seq 0 "$last"); do rank basic "$r" 50 0 ""; pids+=($pid); done
for r in $(seq 0 "$last"); do
  finish "${pids[$r]}" 120; code=$?
  check "rank $r finished 50 checked iterations (exit $code)" '[[ $code == 0 ]] && grep -q "iteration 49 epoch 1 ok" $work/basic-$r.out'
done
[[ $fail == 0 ]] || tail -n 5 "$work"/basic-*.err

echo "== 2. kill -9 of rank $last during collectives, abort, replacement, epoch 2"
pids=()
for r in $(seq 0 "$last"); do rank kill "$r" 3000 2 "" --rejoin; pids+=($pid); done
wait_for 60 '[[ $(grep -c " ok" $work/kill-0.out 2>/dev/null) -ge 100 ]]'
kill -9 "${pids[$last]}"; wait "${pids[$last]}" 2>/dev/null; t0=$(now_ms)
all_aborted() { for r in $(seq 0 $((last - 1))); do grep -q ABORTED "$work/kill-$r.err" || return 1; done; }
wait_for 10 all_aborted; t1=$(now_ms)
for r in $(seq 0 $((last - 1))); do
  check "rank $r's collective failed with ABORTED naming rank $last (all within $((t1 - t0)) ms of the kill)" \
    'grep -q "ABORTED.*rank $last" $work/kill-$r.err'
done
"${ctl[@]}" comms --coordinator "$addr" | tee "$work/comms-aborted.txt"
check "shardctl comms shows epoch 1 aborted, lost rank $last" 'grep -q "world .* 1 aborted" $work/comms-aborted.txt'
rank kill "$last" 3000 0 "-replacement" --rejoin; pids[$last]=$pid
for r in $(seq 0 "$last"); do
  finish "${pids[$r]}" 300; code=$?
  out_file=$work/kill-$r.out
  [[ $r == "$last" ]] && out_file=$work/kill-$r-replacement.out
  check "rank $r finished in epoch 2 (exit $code)$([[ $r == "$last" ]] && echo ", the replacement")" \
    '[[ $code == 0 ]] && grep -q "iteration 2999 epoch 2 ok" $out_file'
done
"${ctl[@]}" comms --coordinator "$addr"
echo "-- survivor stderr"; tail -n 4 "$work/kill-0.err"
cp "$work"/kill-0.err "$work"/daemon.err "$out"/ 2>/dev/null || true
echo "== result: $([[ $fail == 0 ]] && echo ALL PASSED || echo FAILURES)"
exit $fail
