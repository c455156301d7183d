#!/usr/bin/env bash
# Bundles the daemon and the load generator built here (build/, and optionally a baseline
# daemon and its load generator built from another commit) with the shared libraries the GPU machine lacks, into
# .gpu-scale/ at the repository root, for bench/scale/run.sh on a many-core machine.
#
#   bench/scale/bundle.sh [BASELINE_COMMIT]     then carry .gpu-scale
#
# WITH_PERF=1 also packs this machine's perf with its libraries (perf.tar.xz, about 10 MB),
# for run.sh's PERF_DIR where the GPU machine has none; the binaries stay stripped, so read
# the samples here (perf report --symfs, with the unstripped binaries of build/).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
"$root/scripts/build.sh" shardcoordd decision_load >/dev/null
out=$root/.gpu-scale
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
cp "$root/build/coordinator/shardcoordd" "$root/build/bench/decision_load" "$out/bin/"
if [[ -n "${1:-}" ]]; then
  # The baseline daemon, built from BASELINE_COMMIT in a worktree of its own.
  base=$root/build-baseline
  [[ -d "$base/src" ]] || git -C "$root" worktree add --detach "$base/src" "$1" >/dev/null
  git -C "$base/src" checkout --detach -q "$1"
  [[ -f "$base/build.ninja" ]] || cmake -S "$base/src" -B "$base" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DSHARDCOORD_WITH_TORCH=OFF -DSHARDCOORD_WITH_NCCL=OFF >/dev/null
  cmake --build "$base" -- shardcoordd decision_load >/dev/null
  cp "$base/coordinator/shardcoordd" "$out/bin/shardcoordd-baseline"
  cp "$base/bench/decision_load" "$out/bin/decision_load-baseline"
  git -C "$base/src" rev-parse --short HEAD > "$out/baseline-commit"
fi
git -C "$root" rev-parse --short HEAD > "$out/commit"
skip='^(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt|ld-linux-x86-64|linux-vdso|libcuda|libcudart|libnccl)\.'
for bin in "$out"/bin/*; do
  ldd "$bin" | awk '/=> \// {print $1, $3}' | while read -r name path; do
    [[ "$name" =~ $skip ]] && continue
    cp -nL "$path" "$out/lib/$name"
  done
done
strip --strip-unneeded "$out"/bin/* "$out"/lib/*.so* 2>/dev/null || true
if [[ -n "${WITH_PERF:-}" ]]; then
  perf_bin=$(command -v perf)
  tmp=$(mktemp -d)
  mkdir -p "$tmp/perf/bin" "$tmp/perf/lib"
  cp -L "$perf_bin" "$tmp/perf/bin/perf"
  ldd "$perf_bin" | awk '/=> \// {print $1, $3}' | while read -r name path; do
    [[ "$name" =~ $skip ]] && continue
    cp -nL "$path" "$tmp/perf/lib/$name"
  done
  tar -C "$tmp" -cJf "$out/perf.tar.xz" perf
  rm -rf "$tmp"
fi
du -sh "$out"
