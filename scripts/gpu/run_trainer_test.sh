#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with the bundle from scripts/gpu/bundle.sh
# in .gpu/. Builds vlm_trainer there against the machine's LibTorch (CUDA), then runs the seed's
# two-rank regression through shardcoordd, adapters on the frozen tower against the unsharded
# model, and a short training run. With two GPUs the ranks run on them over NCCL; with one, they
# run on the CPUs over Gloo (NCCL refuses two ranks on one GPU), and one rank on the GPU checks
# the adapters under CUDA autograd. Every wait is bounded. Output: ${OUT:-/tmp}/trainer_test.log.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
b=$root/.gpu
out=${OUT:-/tmp}
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64:$b/lib
export NCCL_NVLS_ENABLE=0
export SHARDCOORD_LOG_LEVEL=warn
work=$(mktemp -d)
exec > >(tee "$out/trainer_test.log") 2>&1
fail=0
check() { if eval "$2"; then echo "PASS: $1"; else echo "FAIL: $1"; fail=1; fi; }

echo "== $(date -u +%FT%TZ) $(hostname)"
nvidia-smi --query-gpu=index,name --format=csv,noheader
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [[ $gpus -ge 2 ]]; then device=cuda where="2 GPUs (NCCL)"; else device=cpu where="the CPUs (Gloo; $gpus GPU here)"; fi
torch_dir=${TORCH_DIR:-/opt/torch/.venv/lib/python3.12/site-packages/torch/share/cmake/Torch}
echo "== building vlm_trainer against $(python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null)"
cmake -S "$root/examples/vlm_trainer/gpu" -B "$work/build" -DTorch_DIR="$torch_dir" -DCMAKE_BUILD_TYPE=Release \
  >"$work/cmake.log" 2>&1 || { tail -n 30 "$work/cmake.log"; exit 1; }
cmake --build "$work/build" -j 16 >"$work/build.log" 2>&1 || { grep -m 20 -E "error|Error" "$work/build.log"; exit 1; }
trainer=$work/build/vlm_trainer
torch_lib=$(dirname "$(dirname "$torch_dir")")/../lib
export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$torch_lib

"$b/bin/shardcoordd" --listen 127.0.0.1:0 --address-file "$work/addr" --log-level warn 2>"$work/daemon.err" &
coord=$!
trap 'kill -9 $coord 2>/dev/null' EXIT
for _ in $(seq 100); do [[ -s $work/addr ]] && break; sleep 0.1; done
addr=$(cat "$work/addr")
n=0
train() {  # train POLICY MEDIA [extra]: 2 ranks on $device; sets $job; returns non-zero if a rank failed
  job=j$((n++))
  local pids=() ranks=${RANKS_OF_JOB:-2} r
  for ((r = 0; r < ranks; r++)); do
    timeout 300 "$trainer" --coordinator "$addr" --job "$job" --rank $r --world-size $ranks --group-size $ranks \
      --device "${DEVICE_OF_JOB:-$device}" \
      --policy "$1" --media "$2" --steps "${STEPS:-3}" --accum 2 "${@:3}" >"$work/$job-$r.out" 2>"$work/$job-$r.err" &
    pids+=($!)
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  [[ $rc == 0 ]] || tail -n 3 "$work/$job"-*.err
  return $rc
}
losses() { grep '^step' "$work/$1-$2.out" | awk '{print $4}' | tr '\n' ' '; }
hash_of() { grep '^final' "$work/$1-0.out" | awk '{print $4}'; }
# same_losses JOB REF: both ranks' loss sequences equal, and not empty (two crashed runs are not equal runs).
same_losses() { [[ -n "$(losses $1 0)" && -n "$(losses $1 1)" && "$(losses $1 0)" == "$(losses $2 0)" && "$(losses $1 1)" == "$(losses $2 1)" ]]; }

echo "== seed regression, 2 ranks on $where"
train root rank0; rc=$?
check "root, media on rank 0 only, 2 accumulated microbatches: no hang" '[[ $rc == 0 ]]'
train per_layer none; rc=$?
check "per_layer, every rank skipping, under accumulation" '[[ $rc == 0 ]] && grep -q "skip=12" $work/$job-0.out'
train replicate rank0; rc=$?
check "replicate with asymmetric media" '[[ $rc == 0 ]] && grep -q "replicate=12" $work/$job-0.out'
train root all; root_all=$job
train per_layer all; pl_all=$job
check "root and per_layer with uniform media: identical parameters after the optimizer steps" \
  '[[ -n "$(hash_of $root_all)" && "$(hash_of $root_all)" == "$(hash_of $pl_all)" ]]'
train per_layer rank0; pl_asym=$job
train root rank0; root_asym=$job
check "per_layer requested with asymmetric media: falls back, no hang, loss sequence equals root's" \
  'grep -q "fallbacks=12" $work/$pl_asym-0.out && same_losses $pl_asym $root_asym'
train auto mixed --no-shard; ref=$job
for policy in auto per_layer root replicate; do
  train $policy mixed
  check "$policy: outputs equal the unsharded model's, bitwise" 'same_losses $job $ref'
done
echo "== adapters (LoRA, rank 4) on the frozen tower, trained projector: equal to the unsharded model, bitwise"
adapters=(--tower-adapters 4 --image-fraction 0.6)
for c in "per_layer all per_layer" "per_layer mixed root --fallback padded" "replicate mixed root"; do
  read -r policy media decided extra <<<"$c"
  train $policy $media "${adapters[@]}" $extra --no-shard; ref=$job
  train $policy $media "${adapters[@]}" $extra; rc=$?
  check "adapters, $policy $media $extra: losses and parameters equal the unsharded model's, decided $decided, never padded or replicate" \
    '[[ $rc == 0 && "$(hash_of $job)" == "$(hash_of $ref)" ]] && same_losses $job $ref && grep -q " $decided=[1-9]" $work/$job-0.out && grep -q "padded=0" $work/$job-0.out && grep -q "replicate=0" $work/$job-0.out'
done
grep -h '^summary' "$work/$job"-*.out
if [[ $gpus -ge 1 ]]; then
  RANKS_OF_JOB=1 DEVICE_OF_JOB=cuda train per_layer all "${adapters[@]}" --no-shard; ref=$job
  RANKS_OF_JOB=1 DEVICE_OF_JOB=cuda train per_layer all "${adapters[@]}"; rc=$?
  check "adapters, one rank on the GPU (CUDA autograd): parameters equal the unsharded model's" \
    '[[ $rc == 0 && -n "$(losses $job 0)" && "$(losses $job 0)" == "$(losses $ref 0)" && -n "$(hash_of $job)" && "$(hash_of $job)" == "$(hash_of $ref)" ]]'
fi
echo "== short training run: auto, skewed mixed media, 50 steps"
STEPS=50 train auto mixed --skew 0.3 --memory-budget-bytes 1048576; rc=$?
check "training run finished on both ranks with identical parameters" \
  '[[ $rc == 0 && "$(grep final $work/$job-0.out)" == "$(grep final $work/$job-1.out)" ]]'
grep -h -E '^step (0|49) |^final|^summary' "$work/$job"-*.out
"$b/bin/shardctl" status --coordinator "$addr" --job "$job"
echo "== result: $([[ $fail == 0 ]] && echo ALL PASSED || echo FAILURES)"
exit $fail
