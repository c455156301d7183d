#!/usr/bin/env bash
# Configures and builds shardcoord into ${BUILD_DIR:-build} (Ninja, ccache when present).
# Extra arguments are build targets (default: everything). SHARDCOORD_DEPS names the
# install-deps.sh profiles to install first (default: build; scripts/test.sh asks for test).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
# shellcheck disable=SC2086
"$root/scripts/install-deps.sh" ${SHARDCOORD_DEPS:-build}
# The NCCL backend is built (compiled and linked, run only on a GPU machine) wherever CUDA
# and NCCL are installed in /usr/local/cuda, as on the development machines and CI.
nccl=OFF
if [[ -f /usr/local/cuda/include/nccl.h && -f /usr/local/cuda/include/cuda_runtime.h ]]; then nccl=ON; fi
# (Re)configure when there is no build yet, or when an older one lacks the parts above.
if [[ ! -f "$build/build.ninja" ]] || ! grep -q "SHARDCOORD_WITH_TORCH:BOOL=ON" "$build/CMakeCache.txt" ||
   ! grep -q "SHARDCOORD_WITH_NCCL:BOOL=$nccl" "$build/CMakeCache.txt"; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSHARDCOORD_WITH_NCCL=$nccl \
    -DSHARDCOORD_WITH_TORCH=ON ${CMAKE_ARGS:-} >/dev/null
fi
cmake --build "$build" -- "$@"
