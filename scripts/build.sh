#!/usr/bin/env bash
# Configures and builds shardcoord into ${BUILD_DIR:-build} (Ninja, ccache when present).
# Extra arguments are build targets (default: everything).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
"$root/scripts/install-deps.sh"
# The NCCL backend is built (compiled and linked, run only on a GPU machine) wherever CUDA
# and NCCL are installed in /usr/local/cuda, as on the development machines and CI.
nccl=OFF
if [[ -f /usr/local/cuda/include/nccl.h && -f /usr/local/cuda/include/cuda_runtime.h ]]; then nccl=ON; fi
if [[ ! -f "$build/build.ninja" ]]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSHARDCOORD_WITH_NCCL=$nccl \
    -DSHARDCOORD_WITH_TORCH=ON ${CMAKE_ARGS:-} >/dev/null
fi
cmake --build "$build" -- "$@"
