#!/usr/bin/env bash
# Builds the daemon, the CLI and the NCCL-enabled rank program here (Debian 12, CUDA 13
# and NCCL from /usr/local/cuda) and bundles them with the shared libraries the GPU
# machine lacks (gRPC, protobuf, Abseil, spdlog, Gloo, ...) into .gpu/ at the repository
# root. The GPU machine's own CUDA runtime and NCCL are used there (see docs/GPU.md).
#
#   scripts/gpu/bundle.sh        then, on the GPU machine: scripts/gpu/run_nccl_test.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${BUILD_DIR:-$root/build-nccl}
"$root/scripts/install-deps.sh"
[[ -f "$build/build.ninja" ]] || cmake -S "$root" -B "$build" -G Ninja -DSHARDCOORD_WITH_NCCL=ON \
  -DSHARDCOORD_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build "$build" -- shardcoordd shardctl comm_rank
out=$root/.gpu
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
cp "$build/coordinator/shardcoordd" "$build/client/shardctl" "$build/tests/comm_rank" "$out/bin/"
cp -P "$build"/worker/libshardcoord_worker.so* "$out/lib/"
# bundle_deps DEST FILE...: copies into DEST every library ldd lists for the FILEs, except the
# C/C++ runtime, the loader, the GPU stack and what is already in the bundle.
bundle_deps() {
  local dest=$1 skip name path
  shift
  skip='^(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt|ld-linux-x86-64|linux-vdso|libcuda|libcudart|libnccl)\.'
  for file in "$@"; do
    ldd "$file" | awk '/=> \// {print $1, $3}' | while read -r name path; do
      [[ "$name" =~ $skip ]] && continue
      [[ "$path" == "$out"/* ]] && continue
      cp -nL "$path" "$dest/$name"
    done
  done
}
bundle_deps "$out/lib" "$out"/bin/* "$out"/lib/libshardcoord_worker.so
# Headers the trainer is compiled against there (it is built on that machine, against its
# LibTorch): Abseil (Debian's inline namespace must match the bundled libraries) and CLI11.
mkdir -p "$out/include"
cp -r /usr/include/absl /usr/include/CLI "$out/include/"
mkdir -p "$out/include/shardcoord" && cp "$build/generated/include/shardcoord/version.h" "$out/include/shardcoord/"
strip --strip-unneeded "$out"/bin/* "$out"/lib/*.so* 2>/dev/null || true
# Test certificates for SECURED=1 runs (a CA, the daemon's for 127.0.0.1, a client's), so the
# GPU machine needs no openssl.
(
  umask 077 && mkdir -p "$out/certs" && cd "$out/certs"
  ec=(-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes)
  openssl req -x509 "${ec[@]}" -keyout ca.key -out ca.pem -days 7 -subj /CN=shardcoord-gpu-ca
  for who in server client; do
    openssl req "${ec[@]}" -keyout $who.key -out $who.csr -subj /CN=$who
    printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n' > ext
    openssl x509 -req -in $who.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out $who.pem -days 7 -extfile ext
  done
  printf 'rank rank-gpu-token-0123456789abcdef\nread read-gpu-token-0123456789abcdef\n' > tokens
) >/dev/null 2>&1
# The Python package's worker library (SHARDCOORD_PREBUILT=.gpu/python, scripts/gpu/python_env.sh):
# built without NCCL. Linked with NCCL it would load /usr/local/cuda's libcudart and the system's
# libnccl into the trainer, and a torch imported after it then runs on those instead of its own
# (seen on the GPU machine: `import shardcoord, torch` aborts with "free(): invalid pointer"
# when the system's NCCL is not torch's). Python trainers use torch's NCCL, not shardcoord's.
pybuild=$root/build-gpu-python-worker
[[ -f "$pybuild/build.ninja" ]] || cmake -S "$root" -B "$pybuild" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DSHARDCOORD_WITH_NCCL=OFF -DSHARDCOORD_BUILD_TESTS=OFF -DSHARDCOORD_BUILD_BENCHMARKS=OFF \
  -DSHARDCOORD_WITH_PYTHON=OFF >/dev/null
cmake --build "$pybuild" -- shardcoord_worker
mkdir -p "$out/python/lib" "$out/python/include"
cp -P "$pybuild"/worker/libshardcoord_worker.so* "$out/python/lib/"
bundle_deps "$out/python/lib" "$pybuild/worker/libshardcoord_worker.so"
cp -r "$out"/include/* "$out/python/include/"
strip --strip-unneeded "$out"/python/lib/*.so* 2>/dev/null || true
command -v patchelf >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq patchelf >/dev/null
# shellcheck disable=SC2016  # $ORIGIN is for the loader
for lib in "$out"/python/lib/libshardcoord_worker.so.*; do
  [[ -L $lib ]] || patchelf --force-rpath --set-rpath '$ORIGIN' "$lib"
done
du -sh "$out"
