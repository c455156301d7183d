#!/usr/bin/env bash
# The clang build of every C++ source (coordinator, worker with Gloo and, where CUDA is
# present, NCCL, client, tests, fuzz targets), checked three ways at once:
#   - the lock annotations (ABSL_GUARDED_BY, ...) by -Wthread-safety -Werror=thread-safety;
#   - AddressSanitizer and UndefinedBehaviorSanitizer compiled into everything, so that its
#     test binaries (scripts/sanitize.sh address) and fuzz targets (scripts/fuzz.sh) run checked;
#   - the libFuzzer targets of fuzz/.
# Called by scripts/test.sh. Build folder: ${CLANG_BUILD_DIR:-build-clang}.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${CLANG_BUILD_DIR:-$root/build-clang}
"$root/scripts/install-deps.sh" clang
nccl=OFF
[[ -f /usr/local/cuda/include/nccl.h || -f /usr/include/nccl.h ]] && [[ -d /usr/local/cuda ]] && nccl=ON
if [[ ! -f "$build/build.ninja" ]]; then
  CC=clang CXX=clang++ cmake -S "$root" -B "$build" -G Ninja -DSHARDCOORD_THREAD_SAFETY=ON \
    -DSHARDCOORD_SANITIZE=address,undefined -DSHARDCOORD_FUZZ=ON \
    -DSHARDCOORD_WITH_NCCL=$nccl -DSHARDCOORD_WITH_PYTHON=OFF -DSHARDCOORD_WITH_TORCH=OFF \
    -DSHARDCOORD_BUILD_BENCHMARKS=OFF -DSHARDCOORD_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Debug >/dev/null
fi
cmake --build "$build"
echo "clang build: thread-safety analysis clean (-Werror=thread-safety), ASan+UBSan and fuzz targets built (NCCL=$nccl)"
