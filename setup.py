"""How `pip install .` builds shardcoord's native parts (the metadata is in pyproject.toml).

The package directory of the wheel holds the Python modules (python/shardcoord/*.py, and
python/shardcoord/torch/ for the subpackage shardcoord.torch), the binding
``_shardcoord<EXT_SUFFIX>`` built for the interpreter that runs pip, and the worker library it
links (``libshardcoord_worker.so.0``); the binding finds that library beside itself ($ORIGIN), so
neither PYTHONPATH nor LD_LIBRARY_PATH is needed. Two ways to get them:

- From source (default): CMake configures this repository with tests and benchmarks off and
  builds the targets ``shardcoord_python`` (the binding) and ``shardcoord_worker``, for
  ``sys.executable``. The worker's C++ dependencies (gRPC, protobuf, Abseil, spdlog, Gloo) must be
  installed (Debian: ``scripts/install-deps.sh python``); the wheel then needs them at run time
  too. Environment: ``SHARDCOORD_BUILD_DIR`` (default ``build-pip``, kept between builds, so a
  second install compiles only what changed), ``SHARDCOORD_CMAKE_ARGS`` (extra CMake arguments,
  e.g. ``-DSHARDCOORD_WITH_NCCL=ON``), ``CMAKE_BUILD_PARALLEL_LEVEL``.
The daemon ``shardcoordd`` and the CLI ``shardctl`` are built too and shipped in the package
(``shardcoord/_bin/``), on the environment's PATH through the console entry points of pyproject.toml
(``shardcoord/_cli.py``); ``SHARDCOORD_NO_DAEMON=1`` leaves them out.

- Prebuilt (``SHARDCOORD_PREBUILT=DIR``): a worker library built elsewhere, as
  ``scripts/gpu/bundle.sh`` makes for the GPU machine (``DIR/lib`` with
  ``libshardcoord_worker.so*`` and every shared library it needs that the target machine lacks;
  ``DIR/include`` with Abseil's headers and ``shardcoord/version.h``). Only the binding is
  compiled here (pybind11's setuptools helpers); the libraries in ``DIR/lib`` are copied into
  the package, and the binding and the worker library look for them there ($ORIGIN, as
  DT_RPATH so that their own dependencies are found too). ``DIR/bin/shardcoordd`` and
  ``DIR/bin/shardctl``, where present, ship as above (run with the package folder on the loader's
  path).
"""

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
(ROOT / "build-pip").mkdir(exist_ok=True)  # setuptools' egg-info and build folders (below).


def version() -> str:
    """The one source of the version number: CMakeLists.txt's project()."""
    text = (ROOT / "CMakeLists.txt").read_text()
    m = re.search(r"project\(\s*shardcoord\s+VERSION\s+([0-9][0-9.]*)", text)
    if not m:
        sys.exit("setup.py: no 'project(shardcoord VERSION x.y.z' in CMakeLists.txt")
    return m.group(1)


def run(cmd, **kwargs):
    print("+ " + " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kwargs)


# The daemon and the CLI ship in the package (shardcoord/_bin/), run by the console entry points of
# pyproject.toml (shardcoord/_cli.py). SHARDCOORD_NO_DAEMON=1 builds the binding alone.
DAEMON_BINARIES = {"shardcoordd": "shardcoordd", "shardctl": "shardctl"}  # file name -> CMake target
DAEMON_PATHS = {"coordinator/shardcoordd": "shardcoordd", "client/shardctl": "shardctl"}  # in the build
NO_DAEMON = os.environ.get("SHARDCOORD_NO_DAEMON", "0") == "1"


def ship_binaries(out: Path, binaries: dict):
    (out / "_bin").mkdir(exist_ok=True)
    for name, path in binaries.items():
        if not path.is_file():
            sys.exit(f"setup.py: {path} was not built (the daemon and the CLI ship in the package; "
                     f"SHARDCOORD_NO_DAEMON=1 builds without them)")
        shutil.copy2(path, out / "_bin" / name)
        subprocess.run(["strip", "--strip-unneeded", str(out / "_bin" / name)], check=False)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        out = Path(self.get_ext_fullpath(ext.name)).resolve().parent  # <build_lib>/shardcoord
        out.mkdir(parents=True, exist_ok=True)
        (out / "_version.py").write_text(f'__version__ = "{version()}"\n')  # Read without loading the binding.
        prebuilt = os.environ.get("SHARDCOORD_PREBUILT")
        if prebuilt:
            self.build_prebuilt(ext, Path(prebuilt).resolve(), out)
        else:
            self.build_with_cmake(out)

    def build_with_cmake(self, out: Path):
        if shutil.which("cmake") is None:
            sys.exit("setup.py: cmake is not installed (Debian: scripts/install-deps.sh python)")
        build = Path(os.environ.get("SHARDCOORD_BUILD_DIR", ROOT / "build-pip")).resolve()
        args = ["-DCMAKE_BUILD_TYPE=Release", "-DSHARDCOORD_BUILD_TESTS=OFF", "-DSHARDCOORD_BUILD_BENCHMARKS=OFF",
                "-DSHARDCOORD_WITH_PYTHON=ON", "-DSHARDCOORD_PYTHON_STANDALONE=ON",
                f"-DPython3_EXECUTABLE={sys.executable}"]
        try:  # pybind11 from pip, where the environment has it; else CMake finds Debian's pybind11-dev.
            import pybind11
            args.append(f"-Dpybind11_DIR={pybind11.get_cmake_dir()}")
        except ImportError:
            pass
        if shutil.which("ninja") and not (build / "CMakeCache.txt").exists():
            args += ["-G", "Ninja"]
        args += os.environ.get("SHARDCOORD_CMAKE_ARGS", "").split()
        run(["cmake", "-S", ROOT, "-B", build, *args])
        targets = ["shardcoord_python", "shardcoord_worker"] + ([] if NO_DAEMON else list(DAEMON_BINARIES.values()))
        print(f"setup.py: building {', '.join(targets)} in {build} (a first build takes minutes; pip -v shows it)",
              file=sys.stderr, flush=True)
        run(["cmake", "--build", build, "--target", *targets])
        binding = glob.glob(str(build / "python" / "shardcoord" / ("_shardcoord" + sysconfig.get_config_var("EXT_SUFFIX"))))
        if not binding:
            sys.exit(f"setup.py: CMake built no _shardcoord{sysconfig.get_config_var('EXT_SUFFIX')} in "
                     f"{build}/python/shardcoord (was the Python package switched off? see CMake's output)")
        shutil.copy2(binding[0], out)
        worker = build / "worker" / "libshardcoord_worker.so.0"
        shutil.copy2(worker.resolve(), out / worker.name)
        if not NO_DAEMON:
            ship_binaries(out, {name: build / path for path, name in DAEMON_PATHS.items()})

    def build_prebuilt(self, ext, prebuilt: Path, out: Path):
        lib, include = prebuilt / "lib", prebuilt / "include"
        if not list(lib.glob("libshardcoord_worker.so*")):
            sys.exit(f"setup.py: SHARDCOORD_PREBUILT={prebuilt} has no lib/libshardcoord_worker.so* "
                     f"(make it with scripts/gpu/bundle.sh)")
        try:
            import pybind11
        except ImportError:
            sys.exit("setup.py: SHARDCOORD_PREBUILT needs the pybind11 Python package (pip install pybind11)")
        absl = sorted(str(p) for p in lib.glob("libabsl_*.so.*"))
        ext.sources = sorted(str(p) for p in (ROOT / "python" / "src").glob("*.cc"))
        ext.include_dirs = [pybind11.get_include(), str(ROOT / "worker" / "include"),
                            str(ROOT / "contract" / "include"), str(include)]
        ext.extra_compile_args = ["-std=c++17", "-O2", "-fvisibility=hidden"]
        ext.library_dirs = [str(lib)]
        ext.libraries = ["shardcoord_worker"]
        ext.extra_objects = absl  # Abseil's status and time, used by the binding directly.
        # DT_RPATH (not RUNPATH): it also serves the dependencies of the worker library.
        ext.extra_link_args = ["-Wl,--disable-new-dtags", "-Wl,-rpath,$ORIGIN"]
        super().build_extension(ext)
        # Every versioned library, a soname symlink copied as a file under its own name (the name
        # the loader asks for).
        for so in sorted(lib.glob("*.so.*")):
            shutil.copy2(so.resolve(), out / so.name)
        found = {name: prebuilt / "bin" / name for name in DAEMON_BINARIES if (prebuilt / "bin" / name).is_file()}
        if found and not NO_DAEMON:
            ship_binaries(out, found)  # Run with the package folder on the loader's path (_cli.py).


setup(
    version=version(),
    # setuptools' own build folder, not build/ (where scripts/build.sh keeps the CMake build).
    options={"build": {"build_base": "build-pip/setuptools"}, "egg_info": {"egg_base": "build-pip"}},
    ext_modules=[Extension("shardcoord._shardcoord", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
