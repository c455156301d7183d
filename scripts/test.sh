#!/usr/bin/env bash
# Builds shardcoord and runs every CPU test (unit, in-process, multi-process) with ctest.
# GPU tests are labelled "gpu" and skip themselves where there is no GPU.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
"$root/scripts/build.sh"
cd "$build"
# Each test has its own timeout (tests/CMakeLists.txt); this bounds the whole run too.
ctest --output-on-failure --timeout 600 -j "$(nproc)" "$@"
