"""The native binding (_shardcoord: the worker library and the libraries it links), loaded on first
use rather than at ``import shardcoord``.

Why lazily: loading it loads gRPC, protobuf, Abseil, Gloo and the rest into the process, and a
trainer imports torch next. On the GPU machine, with the worker's libraries bundled from another
distribution (scripts/gpu/bundle.sh), ``import shardcoord, torch`` aborted in torch's import
("free(): invalid pointer") while ``import torch, shardcoord`` worked (docs/GPU.md). Loaded at
first use (``Worker(...)``, the bound types such as ``shardcoord.ModuleSpec``, ``classify``, the
builtin names), the binding comes after torch in the usual script: imports at the top, work below.
"""

import glob
import os
import sys
import sysconfig

_module = None


def native():
    """The _shardcoord module, imported the first time it is needed."""
    global _module
    if _module is None:
        _module = _load()
    return _module


def _load():
    try:
        from . import _shardcoord
        return _shardcoord
    except ImportError as e:  # Say which interpreter it was built for, not "circular import".
        here = os.path.dirname(__file__)
        built = sorted(os.path.basename(p) for p in glob.glob(os.path.join(here, "_shardcoord*.so")))
        want = "_shardcoord" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")
        if want not in built:
            raise ImportError(f"shardcoord's native binding was not built for this Python ({sys.executable}, "
                              f"{sys.version.split()[0]}): {here} has {built or 'no binding'}, this Python loads "
                              f"{want}. Install shardcoord with this interpreter: `{sys.executable} -m pip install "
                              f"--no-build-isolation <shardcoord checkout>` (README, Install)") from e
        raise ImportError(f"shardcoord's native binding {here}/{want} failed to load: {e}. A shared library it "
                          f"needs is missing (Debian: scripts/install-deps.sh python installs the worker's "
                          f"dependencies), or it was built against other versions of them: reinstall shardcoord") from e
