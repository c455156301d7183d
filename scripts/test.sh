#!/usr/bin/env bash
# Builds shardcoord and runs every CPU test (unit, in-process, multi-process) with ctest.
# GPU tests are labelled "gpu" and skip themselves where there is no GPU. Then the
# clang thread-safety build (scripts/thread-safety.sh).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
"$root/scripts/build.sh"
cd "$build"
# Each test has its own timeout (tests/CMakeLists.txt); this bounds the whole run too.
rc=0
ctest --output-on-failure --timeout 600 -j "$(nproc)" "$@" || rc=$?
# The lock annotations, checked by clang (a second build, in build-tsa/).
"$root/scripts/thread-safety.sh" || rc=1
exit $rc
