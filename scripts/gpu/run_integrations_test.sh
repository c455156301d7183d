#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with the bundle from scripts/gpu/bundle.sh
# in .gpu/: installs the shardcoord Python package into the machine's torch venv (python_env.sh),
# starts a shardcoordd, then scripts/gpu/hf_trainer_check.py: a stock Hugging Face Trainer with
# accelerate's FSDP2 plugin on real VLM classes (Qwen2.5-VL, LLaVA, Gemma 3, Qwen2-Audio from tiny
# configs) with shardcoord, its unsharded reference and the stock per-layer run (expected to hang),
# and (--examples) examples/python/hf_trainer_vlm.py and lightning_vlm.py with and without their
# lines marked "# shardcoord". RANKS (default 2) processes share the one GPU over Gloo.
# CHECK=trainable_tower_check.py runs that check instead (towers that train: Qwen2.5-VL with its tower
# trainable, LLaVA with LoRA on its tower), with CHECK_ARGS (default for it: none).
# Output: ${OUT:-/tmp}/integrations_test.log and the check's JSON. Exit 0 when all passed.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-/tmp}
exec > >(tee "$out/integrations_test.log") 2>&1
echo "== $(date -u +%FT%TZ) $(hostname)"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU"
source "$root/scripts/gpu/python_env.sh"
"$py" -c 'import transformers, accelerate, lightning, torch; print("== transformers", transformers.__version__, "accelerate", accelerate.__version__, "lightning", lightning.__version__, "torch", torch.__version__)'
daemon_dir=$(mktemp -d)
"$root/.gpu/bin/shardcoordd" --listen 127.0.0.1:0 --address-file "$daemon_dir/addr" --heartbeat-timeout-ms 20000 \
  >"$out/shardcoordd.log" 2>&1 &
daemon=$!
trap 'kill $daemon 2>/dev/null' EXIT
for _ in $(seq 100); do [[ -s $daemon_dir/addr ]] && break; sleep 0.1; done
[[ -s $daemon_dir/addr ]] || { echo "FAIL: shardcoordd did not start"; tail "$out/shardcoordd.log"; exit 1; }
export SHARDCOORD_ADDR=$(cat "$daemon_dir/addr")
echo "== shardcoordd at $SHARDCOORD_ADDR"
rc=0
check=${CHECK:-hf_trainer_check.py}
[[ $check == hf_trainer_check.py ]] && default_args=--examples || default_args=
timeout 560 "$py" "$root/scripts/gpu/$check" --ranks "${RANKS:-2}" --steps "${STEPS:-8}" ${CHECK_ARGS-$default_args} || rc=1
"$root/.gpu/bin/shardctl" --coordinator "$SHARDCOORD_ADDR" status 2>&1 | head -40
echo "== run_integrations_test: $([[ $rc == 0 ]] && echo 'all passed' || echo FAILED)"
exit $rc
