#!/usr/bin/env bash
# Installs the build into a temporary prefix, then builds and runs a consumer project that
# only does find_package(shardcoord) and links shardcoord::worker: it must need libgloo itself,
# not only through the worker, so that libgloo comes ahead of a LibTorch linked after the worker
# (one that carries its own Gloo; README, "Using the worker library"), and run.
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
[[ $needed == "libshardcoord_worker.so.0 "*" libgloo.so.0 "* ]] ||
  { echo "FAIL: the consumer does not need libgloo itself, after the worker (NEEDED: $needed)"; exit 1; }
LD_LIBRARY_PATH="$prefix/lib" "$prefix/consumer-build/consumer"
