#!/usr/bin/env bash
# Builds shardcoord and runs every CPU test (unit, in-process, multi-process) with ctest.
# GPU tests are labelled "gpu" and skip themselves where there is no GPU. Then the install
# checks (scripts/package-test.sh: pip, wheel, .deb), the clang
# build (scripts/clang-build.sh: lock annotations checked, ASan+UBSan, fuzz targets), the
# C++ suite under ASan+UBSan (scripts/sanitize.sh address) and a short run of every fuzz
# target (scripts/fuzz.sh --seconds 20). SHARDCOORD_QUICK=1 stops after the first part.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build}
SHARDCOORD_DEPS=test "$root/scripts/build.sh"
cd "$build"
# Each test has its own timeout (tests/CMakeLists.txt); this bounds the whole run too.
rc=0
ctest --output-on-failure --timeout 600 -j "$(nproc)" "$@" || rc=$?
[[ "${SHARDCOORD_QUICK:-0}" == 1 ]] && exit $rc
# Installed as a user would (scripts/package-test.sh): pip into fresh venvs, the wheel, the .deb.
BUILD_DIR=$build "$root/scripts/package-test.sh" || rc=1
# The clang build (build-clang/): lock annotations, then the suite under ASan+UBSan, then fuzzing.
"$root/scripts/clang-build.sh" || exit 1
"$root/scripts/sanitize.sh" address -j "$(nproc)" || rc=1
"$root/scripts/fuzz.sh" --seconds 20 || rc=1
exit $rc
