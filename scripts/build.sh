#!/usr/bin/env bash
# Configures and builds shardcoord into ${BUILD_DIR:-build} (Ninja, ccache when present).
# Extra arguments are build targets (default: everything).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
"$root/scripts/install-deps.sh"
if [[ ! -f "$build/build.ninja" ]]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo ${CMAKE_ARGS:-} >/dev/null
fi
cmake --build "$build" -- "$@"
