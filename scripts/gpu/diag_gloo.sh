set -u
root=$PWD; b=$root/.gpu; work=/tmp/w; mkdir -p $work
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64:$b/lib
torch_dir=/opt/torch/.venv/lib/python3.12/site-packages/torch/share/cmake/Torch
tl=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib
cmake -S examples/vlm_trainer/gpu -B $work/build -DTorch_DIR=$torch_dir -DCMAKE_BUILD_TYPE=Release >$work/c.log 2>&1 && cmake --build $work/build -j16 >$work/b.log 2>&1 || { tail $work/b.log; exit 1; }
export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$tl
echo "== gloo symbols exported by libtorch_cpu: $(nm -D --defined-only $tl/libtorch_cpu.so | grep -c gloo)"
nm -D --defined-only $tl/libtorch_cpu.so | c++filt | grep -m5 "gloo::transport::tcp"
echo "== needed order"; readelf -d $work/build/vlm_trainer | grep NEEDED
$b/bin/shardcoordd --listen 127.0.0.1:0 --address-file $work/addr --log-level warn 2>$work/d.err & sleep 1
for r in 0 1; do LD_DEBUG=bindings LD_DEBUG_OUTPUT=$work/bind$r timeout 60 $work/build/vlm_trainer --coordinator $(cat $work/addr) --job j --rank $r --world-size 2 --group-size 2 --device cpu --policy root --media all --steps 2 >$work/o$r 2>$work/e$r & done; wait
tail -3 $work/o0 $work/e0
echo "== gloo bindings across libraries (rank 0)"
cat $work/bind0.* | grep -i gloo | sed -E 's/^ *[0-9]+: *//' | awk '{print $3, "->", $6}' | sort | uniq -c | sort -rn | head -20
echo "== samples: libgloo or libshardcoord bound to libtorch"
cat $work/bind0.* | grep -E "file [^ ]*(libgloo|libshardcoord)[^ ]* .* to [^ ]*libtorch" | head -8 | c++filt
if command -v gdb; then
  timeout 60 $work/build/vlm_trainer --coordinator $(cat $work/addr) --job k --rank 1 --world-size 2 --group-size 2 --device cpu --policy root --media all --steps 1 >/dev/null 2>&1 &
  timeout 60 gdb -batch -ex run -ex bt --args $work/build/vlm_trainer --coordinator $(cat $work/addr) --job k --rank 0 --world-size 2 --group-size 2 --device cpu --policy root --media all --steps 1 2>&1 | grep -E "^#|SIG" | head -30 | c++filt
fi
