#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with the bundle from
# scripts/gpu/bundle.sh in .gpu/: builds the Python binding there against the machine's
# Python, torch and transformers, then, on the real Hugging Face classes built from tiny
# configs (nothing downloaded):
#   - scripts/gpu/hf_calls_check.py: shardcoord.hf.tower_calls against the forward's real calls
#     (hooks), and the look-alikes' module trees against the real ones;
#   - scripts/gpu/hf_sharding_check.py: manifest() with no layer_lists, the plain executor and
#     FSDP2 on 2 Gloo ranks under every decision, and FSDP2 peak memory per placement on one GPU.
# Output: ${OUT:-/tmp}/hf_test.log. Exit 0 when everything passed.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
exec > >(tee "${OUT:-/tmp}/hf_test.log") 2>&1
echo "== $(date -u +%FT%TZ) $(hostname)"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU"
source "$root/scripts/gpu/python_env.sh"
fail=0
echo "== tower calls against the real forward"
timeout 150 "$py" "$root/scripts/gpu/hf_calls_check.py" || fail=1
echo "== sharding the real classes"
timeout 400 "$py" "$root/scripts/gpu/hf_sharding_check.py" ${HF_PARTS:-} || fail=1
echo "== run_hf_test: $([[ $fail == 0 ]] && echo 'all passed' || echo FAILED)"
exit $fail
