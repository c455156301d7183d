#!/usr/bin/env bash
# Installs the build into a temporary prefix, then builds and runs a consumer project that
# only does find_package(shardcoord), links shardcoord::worker and, as README says for a LibTorch
# that carries its own Gloo, libgloo ahead of what follows (a stand-in library): the consumer must
# need libgloo before the stand-in, and run.
#   check_package.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
src=$2
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix" >/dev/null
cmake -S "$src/tests/package/consumer" -B "$prefix/consumer-build" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$prefix/consumer-build" >/dev/null
needed=$(readelf -d "$prefix/consumer-build/consumer" | awk '/NEEDED/ {print $NF}' | tr -d '[]' | tr '\n' ' ')
[[ $needed == "libshardcoord_worker.so.0 libgloo.so.0 libtorch_stand_in.so "* ]] ||
  { echo "FAIL: the consumer does not need the worker, libgloo and then the stand-in (NEEDED: $needed)"; exit 1; }
LD_LIBRARY_PATH="$prefix/lib" "$prefix/consumer-build/consumer"
