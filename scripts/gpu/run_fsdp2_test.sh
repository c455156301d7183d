#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with the bundle from
# scripts/gpu/bundle.sh in .gpu/. Builds the Python binding there against the machine's
# Python and torch (>= 2.6), then runs tests/gpu/fsdp2_check.py: FSDP2 under shardcoord
# decisions on 2 GPUs with NCCL (on one GPU or none: Gloo on CPU tensors). Every wait is
# bounded. Then the example trainer (examples/python/vlm_train.py --fsdp2): every policy bitwise
# equal to its reference, kill -9 and SIGSTOP of a rank. PARTS="check bitwise lost" (the
# default) picks what runs. Output: ${OUT:-/tmp}/fsdp2_test.log. Exit 0 when everything passed.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
exec > >(tee "${OUT:-/tmp}/fsdp2_test.log") 2>&1
echo "== $(date -u +%FT%TZ) $(hostname)"
nvidia-smi --query-gpu=index,name --format=csv,noheader 2>/dev/null || echo "no GPU"
source "$root/scripts/gpu/python_env.sh"
fail=0
parts=" ${PARTS:-check bitwise lost} "
if [[ $parts == *" check "* ]]; then
  timeout 900 "$py" "$root/tests/gpu/fsdp2_check.py" --shardcoordd "$b/bin/shardcoordd" || fail=1
fi

# The example trainer (examples/python/vlm_train.py --fsdp2) on 2 GPUs: every policy bitwise
# equal to its FSDP2 reference (the tower in the root unit), and a lost rank under FSDP2.
echo "== the example trainer under FSDP2 (2 ranks, NCCL)"
work=$(mktemp -d)
export CUBLAS_WORKSPACE_CONFIG=:4096:8
"$b/bin/shardcoordd" --listen 127.0.0.1:0 --address-file "$work/addr" --log-level warn \
  --heartbeat-timeout-ms 5000 2>"$work/daemon.err" &
coord=$!
trap 'kill -9 $coord 2>/dev/null' EXIT
for _ in $(seq 100); do [[ -s $work/addr ]] && break; sleep 0.1; done
addr=$(cat "$work/addr")
check() { if eval "$2"; then echo "PASS: $1"; else echo "FAIL: $1"; fail=1; fi; }
n=0
start() {  # start JOB [flags]: 2 ranks in the background, pids in ${pids[@]}
  local job=$1; shift
  pids=()
  for r in 0 1; do
    RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 timeout 300 "$py" "$root/examples/python/vlm_train.py" --fsdp2 \
      --coordinator "$addr" --job "$job" --init-method "file://$work/$job.store" "$@" \
      >"$work/$job-$r.out" 2>"$work/$job-$r.err" &
    pids+=($!)
  done
}
train() {  # train [flags]: waits for both ranks; sets $job
  job=j$((n++))
  start "$job" --steps 4 --accum 2 "$@"
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  [[ $rc == 0 ]] || tail -n 5 "$work/$job"-*.err
  return $rc
}
result() { grep -E '^(step|final)' "$work/$1-0.out" | md5sum | cut -c1-12; }  # losses (float.hex) + params hash
same_on_both() { diff <(grep '^final' "$work/$1-0.out") <(grep '^final' "$work/$1-1.out") >/dev/null; }  # losses are per rank (own data); parameters are shared
summary() { grep '^summary' "$work/$1-0.out" | cut -d: -f2; }

signal_rank() {  # signal_rank SIGNAL PID: the trainer under `timeout` PID, and `timeout` itself
  pkill -"$1" -P "$2" 2>/dev/null; kill -"$1" "$2" 2>/dev/null; true
}
for media in mixed rank0 none; do
  [[ $parts == *" bitwise "* ]] || break
  train --no-shard --media "$media"; rc=$? ref=$job
  check "reference (tower in the root unit), media $media: ran, same parameters on both ranks" \
    '[[ $rc == 0 ]] && grep -q "^final" $work/$ref-0.out && same_on_both $ref'
  for policy in auto per_layer root replicate; do
    train --policy "$policy" --media "$media"; rc=$?
    check "policy $policy, media $media: bitwise equal to the reference ($(summary $job))" \
      '[[ $rc == 0 ]] && [[ $(result $job) == $(result $ref) ]] && same_on_both $job'
  done
done

lost() {  # lost SIGNAL [flags]: rank 1 gets SIGNAL after its step 2; rank 0 must stop within the
          # heartbeat timeout plus slack, exit 3 and name rank 1. Sets $rc0 and $secs.
  job=j$((n++))
  local sig=$1; shift
  start "$job" --steps 400 --accum 2 --interval-ms 20 "$@"
  for _ in $(seq 600); do grep -q '^step 2 ' "$work/$job-1.out" 2>/dev/null && break; sleep 0.1; done
  signal_rank "$sig" "${pids[1]}"
  local t0=$SECONDS
  rc0=timeout
  for _ in $(seq 250); do
    if ! kill -0 "${pids[0]}" 2>/dev/null; then wait "${pids[0]}"; rc0=$?; break; fi
    sleep 0.1
  done
  secs=$((SECONDS - t0))
  for p in "${pids[@]}"; do signal_rank KILL "$p"; done
  wait "${pids[@]}" 2>/dev/null
  echo "   rank 0 after $sig of rank 1: exit $rc0 after ${secs} s; its stderr:"
  grep -v -i warn "$work/$job-0.err" | tail -n 4 | cut -c1-300 | sed 's/^/      /'
  mkdir -p "$out/lost" && cp "$work/$job"-* "$out/lost/" 2>/dev/null
}
[[ $parts == *" lost "* ]] || { [[ $fail == 0 ]] && echo "== result: ALL PASSED" || echo "== result: FAILED"; exit $fail; }
lost KILL
check "kill -9 of rank 1 under FSDP2: rank 0 exits 3 naming rank 1" \
  '[[ $rc0 == 3 ]] && grep -q "rank 1" $work/$job-0.err'
lost STOP
check "SIGSTOP of rank 1 (hung in NCCL, sockets open): rank 0 exits 3 naming rank 1 after the heartbeat timeout" \
  '[[ $rc0 == 3 ]] && grep -q "rank 1" $work/$job-0.err'
lost STOP --no-watch
check "control: the same without FailureWatch leaves rank 0 blocked in NCCL for the whole 25 s" \
  '[[ $rc0 == timeout ]]'
[[ $fail == 0 ]] && echo "== result: ALL PASSED" || echo "== result: FAILED"
exit $fail
