#!/usr/bin/env bash
# The policy matrix (issues 10, 28) on the GPU machine, from the repository root, with the bundle
# from scripts/gpu/bundle.sh in .gpu/: bench/policy_matrix.py on --gpus GPUs (default 2, NCCL; 1
# works), one bounded run. Arguments go to policy_matrix.py (e.g. --gpus 1, --mixes all none,
# --placements root replicate sc_per_layer, --size vlm, --repeats 8). Output in ${OUT:-/tmp}:
# policy_matrix.log, policy_matrix.jsonl, the cost model measured in the run
# (policy_matrix.cost.json, shardcoord.cost/v1), the manifest (policy_matrix.manifest.json) and
# each mix's plans (policy_matrix.traces/MIX.jsonl) for `shardctl plan`. A --cost-out,
# --manifest-out or --trace-dir given here wins (the last of a flag wins). Each run must fit the
# machine's 10 minutes with the package install (about 1): keep --timeout at 450 or below.
#
#   run_policy_matrix.sh --gpus 1 --mixes all none --placements root replicate per_layer sc_per_layer --timeout 450
#                                                    # the A/A on one GPU (root#2 vs root), ~6 min
#   run_policy_matrix.sh --mixes all none --repeats 4 --timeout 450        # 2 GPUs, every placement;
#   run_policy_matrix.sh --mixes random50 skewed --repeats 4 --timeout 450 # then the other mixes, and
#   run_policy_matrix.sh --mixes llava15_665k@1 qwen25vl_sft@4 --repeats 4 --timeout 450 # published ones
#   ... --memory-budget-bytes 536870912                                   # regime b: no replica fits
#   run_policy_matrix.sh --mixes random50 qwen25vl_sft@4 --memory-budget-bytes 536870912 \
#       --placements root per_layer_dummy sc_per_layer sc_padded sc_auto_padded --repeats 4 --timeout 450
#                                    # regime b with fallback padded: divergent microbatches padded
#                                    # (one unit held) against root (whole tower) and dummy forwards
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
exec > >(tee "${OUT:-/tmp}/policy_matrix.log") 2>&1
echo "== $(date -u +%FT%TZ) $(hostname)"
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"
source "$root/scripts/gpu/python_env.sh"
echo "== $("$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())))')"
echo "== bench/policy_matrix.py $*"
timeout 590 "$py" "$root/bench/policy_matrix.py" --shardcoordd "$b/bin/shardcoordd" --json "$out/policy_matrix.jsonl" \
  --cost-out "$out/policy_matrix.cost.json" --manifest-out "$out/policy_matrix.manifest.json" \
  --trace-dir "$out/policy_matrix.traces" "$@"
