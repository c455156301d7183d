#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with the bundle from
# scripts/gpu/bundle.sh in .gpu/. Builds the Python binding there against the machine's
# Python and torch (>= 2.6), then runs tests/gpu/fsdp2_check.py: FSDP2 under shardcoord
# decisions on 2 GPUs with NCCL (on one GPU or none: Gloo on CPU tensors). Every wait is
# bounded. Output: ${OUT:-/tmp}/fsdp2_test.log. Exit 0 when every scenario passed.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
b=$root/.gpu
out=${OUT:-/tmp}
py=${PYTHON:-/opt/torch/.venv/bin/python}
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64:$b/lib
export NCCL_NVLS_ENABLE=0
export SHARDCOORD_LOG_LEVEL=warn
exec > >(tee "$out/fsdp2_test.log") 2>&1
echo "== $(date -u +%FT%TZ) $(hostname)"
nvidia-smi --query-gpu=index,name --format=csv,noheader 2>/dev/null || echo "no GPU"
pkg=$root/build-gpu-python/shardcoord
mkdir -p "$pkg"
cp "$root"/python/shardcoord/*.py "$pkg/"
suffix=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
echo "== building the binding for $("$py" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)')"
# The worker library and its Abseil come from the bundle (built on Debian); the binding is
# compiled here against this Python.
g++ -O2 -shared -fPIC -std=c++17 $("$py" -m pybind11 --includes) -I"$root/worker/include" -I"$root/contract/include" \
  -I"$b/include" "$root/python/src/binding.cc" -o "$pkg/_shardcoord$suffix" \
  -L"$b/lib" -lshardcoord_worker "$b"/lib/libabsl_*.so* -Wl,-rpath,"$b/lib" || { echo "FAIL: binding build"; exit 1; }
PYTHONPATH=$root/build-gpu-python timeout 900 "$py" "$root/tests/gpu/fsdp2_check.py" --shardcoordd "$b/bin/shardcoordd" "$@"
