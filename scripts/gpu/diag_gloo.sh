#!/usr/bin/env bash
# Runs on the GPU machine after scripts/gpu/bundle.sh: builds vlm_trainer against the machine's
# pip LibTorch *without* libgloo ahead of it (the order a user gets from
# `target_link_libraries(t shardcoord::worker ${TORCH_LIBRARIES})`) and runs two ranks on the CPUs
# over Gloo: pip's libtorch_cpu.so then interposes Gloo, and the ranks must stop with the worker's
# error that says what to do, not crash. Output on stdout.
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
b=$root/.gpu work=$(mktemp -d)
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64:$b/lib
torch_dir=${TORCH_DIR:-/opt/torch/.venv/lib/python3.12/site-packages/torch/share/cmake/Torch}
mkdir -p "$root/examples/vlm_trainer/gpu-unfixed"
grep -v -e 'no-as-needed' "$root/examples/vlm_trainer/gpu/CMakeLists.txt" |
  sed 's|target_link_libraries(vlm_trainer PRIVATE ${BUNDLE}/lib/libshardcoord_worker.so.0|& ${ABSL_LIBS} ${TORCH_LIBRARIES})|' \
  > "$root/examples/vlm_trainer/gpu-unfixed/CMakeLists.txt"
grep -n target_link_libraries "$root/examples/vlm_trainer/gpu-unfixed/CMakeLists.txt"
cmake -S "$root/examples/vlm_trainer/gpu-unfixed" -B "$work/build" -DTorch_DIR="$torch_dir" -DCMAKE_BUILD_TYPE=Release >"$work/c.log" 2>&1 &&
  cmake --build "$work/build" -j 16 >"$work/b.log" 2>&1 || { tail -20 "$work/c.log" "$work/b.log"; exit 1; }
export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$(dirname "$(dirname "$torch_dir")")/../lib
readelf -d "$work/build/vlm_trainer" | grep NEEDED | head -3
"$b/bin/shardcoordd" --listen 127.0.0.1:0 --address-file "$work/addr" --log-level warn 2>"$work/d.err" &
coord=$!
trap 'kill -9 $coord 2>/dev/null' EXIT
for _ in $(seq 100); do [[ -s $work/addr ]] && break; sleep 0.1; done
for r in 0 1; do
  timeout 60 "$work/build/vlm_trainer" --coordinator "$(cat "$work/addr")" --job j --rank $r --world-size 2 --group-size 2 \
    --device cpu --policy root --media all --steps 2 >"$work/o$r" 2>"$work/e$r" &
done
for r in 0 1; do wait %$((r + 2)) 2>/dev/null; echo "== rank $r exit $?"; tail -n 3 "$work/e$r" | cut -c1-600; done
