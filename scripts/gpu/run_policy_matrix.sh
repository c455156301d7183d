#!/usr/bin/env bash
# The policy matrix (issue 10) on the GPU machine, from the repository root, with the bundle
# from scripts/gpu/bundle.sh in .gpu/: bench/policy_matrix.py on 2 GPUs (NCCL), every data mix
# x every placement, one bounded run. Arguments go to policy_matrix.py (e.g. --quick, --mixes
# all none, --steps 10). Output: ${OUT:-/tmp}/policy_matrix.log and policy_matrix.jsonl.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
exec > >(tee "${OUT:-/tmp}/policy_matrix.log") 2>&1
echo "== $(date -u +%FT%TZ) $(hostname)"
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"
source "$root/scripts/gpu/python_env.sh"
echo "== $("$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())))')"
echo "== bench/policy_matrix.py $*"
timeout 590 "$py" "$root/bench/policy_matrix.py" --shardcoordd "$b/bin/shardcoordd" --json "$out/policy_matrix.jsonl" "$@"
