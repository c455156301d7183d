#!/usr/bin/env bash
# Builds the Debian package of shardcoord: the daemon, shardctl, the worker library with its
# headers and CMake package, the Python package for Debian's python3, the systemd unit and the
# configuration file. A build configured for /usr in ${DEB_BUILD_DIR:-build-deb} (the build type of
# scripts/build.sh's, so ccache serves most of what that build compiled), then `cpack -G DEB`.
# Without the NCCL backend: a package that depends on no CUDA (Gloo only; build from source with
# -DSHARDCOORD_WITH_NCCL=ON for NCCL).
#
#   scripts/package.sh             -> build-deb/shardcoord_<version>_amd64.deb (path printed last)
#   apt-get install ./build-deb/shardcoord_*.deb
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${DEB_BUILD_DIR:-$root/build-deb}
"$root/scripts/install-deps.sh" package >&2
if [[ ! -f "$build/build.ninja" ]]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_INSTALL_PREFIX=/usr \
    -DSHARDCOORD_BUILD_TESTS=OFF -DSHARDCOORD_BUILD_BENCHMARKS=OFF -DSHARDCOORD_WITH_NCCL=OFF \
    -DPython3_EXECUTABLE=/usr/bin/python3 -DCPACK_STRIP_FILES=ON >&2
fi
cmake --build "$build" >&2
rm -f "$build"/shardcoord_*.deb
(cd "$build" && cpack -G DEB >&2)
ls "$build"/shardcoord_*.deb
