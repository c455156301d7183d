# Sourced by the GPU scripts, on the GPU machine, from the repository root, with the bundle
# from scripts/gpu/bundle.sh in .gpu/: sets the library path and NCCL settings for the bundled
# programs (shardcoordd, shardctl, comm_rank), installs the shardcoord Python package into the
# machine's torch venv the way a user would, `pip install --no-build-isolation .` with
# SHARDCOORD_PREBUILT=.gpu/python (setup.py: the binding is compiled there against that Python and
# the bundle's worker library built without NCCL, which goes into the package with the libraries
# it needs), checks that
# it imports with no PYTHONPATH and no LD_LIBRARY_PATH, and exports $py. Needs $root.
b=$root/.gpu
out=${OUT:-/tmp}
py=${PYTHON:-/opt/torch/.venv/bin/python}
export LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu:/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/cuda/lib64:$b/lib
export NCCL_NVLS_ENABLE=0
export SHARDCOORD_LOG_LEVEL=warn
echo "== pip install of shardcoord into $("$py" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__)')"
SHARDCOORD_PREBUILT=$b/python "$py" -m pip install --no-build-isolation --no-index --no-deps -q "$root" >"$out/pip-install.log" 2>&1 ||
  { tail -30 "$out/pip-install.log"; echo "FAIL: pip install"; exit 1; }
(cd / && env -u LD_LIBRARY_PATH -u PYTHONPATH "$py" -c 'import shardcoord, sys; print("== installed:", shardcoord.__version__, shardcoord.__file__); assert "torch" not in sys.modules; import torch') ||
  { echo "FAIL: the installed package does not import"; exit 1; }
