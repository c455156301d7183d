# Sourced by the GPU scripts, on the GPU machine, from the repository root, with the bundle
# from scripts/gpu/bundle.sh in .gpu/: sets the library path and NCCL settings, builds the
# Python binding against this machine's Python and torch (the worker library and its Abseil
# come from the bundle, built on Debian) into build-gpu-python/, and exports PYTHONPATH and
# $py. Needs $root.
b=$root/.gpu
out=${OUT:-/tmp}
py=${PYTHON:-/opt/torch/.venv/bin/python}
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64:$b/lib
export NCCL_NVLS_ENABLE=0
export SHARDCOORD_LOG_LEVEL=warn
pkg=$root/build-gpu-python/shardcoord
mkdir -p "$pkg"
cp "$root"/python/shardcoord/*.py "$pkg/"
suffix=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
echo "== building the binding for $("$py" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)')"
g++ -O2 -shared -fPIC -std=c++17 $("$py" -m pybind11 --includes) -I"$root/worker/include" -I"$root/contract/include" \
  -I"$b/include" "$root/python/src/binding.cc" -o "$pkg/_shardcoord$suffix" \
  -L"$b/lib" -lshardcoord_worker "$b"/lib/libabsl_*.so* -Wl,-rpath,"$b/lib" || { echo "FAIL: binding build"; exit 1; }
export PYTHONPATH=$root/build-gpu-python
