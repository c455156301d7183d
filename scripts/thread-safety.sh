#!/usr/bin/env bash
# Builds the C++ sources (coordinator, worker with Gloo and, where CUDA is present, NCCL,
# client, tests) with clang and -Wthread-safety -Werror=thread-safety: the lock annotations
# (ABSL_GUARDED_BY, ABSL_EXCLUSIVE_LOCKS_REQUIRED) are checked by the compiler. Called by
# scripts/test.sh; on its own: scripts/thread-safety.sh. Build folder: ${TSA_BUILD_DIR:-build-tsa}.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${TSA_BUILD_DIR:-$root/build-tsa}
"$root/scripts/install-deps.sh"
nccl=OFF
[[ -f /usr/local/cuda/include/nccl.h || -f /usr/include/nccl.h ]] && [[ -d /usr/local/cuda ]] && nccl=ON
if [[ ! -f "$build/build.ninja" ]]; then
  CC=clang CXX=clang++ cmake -S "$root" -B "$build" -G Ninja -DSHARDCOORD_THREAD_SAFETY=ON \
    -DSHARDCOORD_WITH_NCCL=$nccl -DSHARDCOORD_WITH_PYTHON=OFF -DSHARDCOORD_WITH_TORCH=OFF \
    -DSHARDCOORD_BUILD_BENCHMARKS=OFF -DSHARDCOORD_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Debug >/dev/null
fi
cmake --build "$build"
echo "thread-safety analysis: clean (clang, -Werror=thread-safety, NCCL=$nccl)"
