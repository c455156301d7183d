"""shardcoord: safe per-layer sharding of frozen multimodal towers (Python binding).

    import shardcoord
    with shardcoord.Worker("run-42", manifest, group_size=8) as w:   # RANK/WORLD_SIZE from torchrun
        w.report_plan(step, mb, {"model.visual": 1})                  # ahead of time
        d = w.get_decision(step, mb, timeout=30)                      # right before the microbatch
        d["model.visual"].decision                                    # "per_layer", "skip", "root", "replicate"

``shardcoord.torch`` builds the manifest from a ``torch.nn.Module`` and keeps plans ahead of the
training loop.
"""

try:
    from . import _shardcoord
except ImportError as _e:  # Say which interpreter it was built for, not "circular import".
    import glob as _glob
    import os as _os
    import sys as _sys
    import sysconfig as _sysconfig
    _here = _os.path.dirname(__file__)
    _built = sorted(_os.path.basename(p) for p in _glob.glob(_os.path.join(_here, "_shardcoord*.so")))
    _want = "_shardcoord" + (_sysconfig.get_config_var("EXT_SUFFIX") or ".so")
    if _want not in _built:
        raise ImportError(f"shardcoord's native binding was not built for this Python ({_sys.executable}, "
                          f"{_sys.version.split()[0]}): {_here} has {_built or 'no binding'}, this Python loads {_want}. "
                          f"Install shardcoord with this interpreter: `{_sys.executable} -m pip install "
                          f"--no-build-isolation <shardcoord checkout>` (README, Install)") from _e
    raise ImportError(f"shardcoord's native binding {_here}/{_want} failed to load: {_e}. A shared library it needs "
                      f"is missing (Debian: scripts/install-deps.sh python installs the worker's dependencies), "
                      f"or it was built against other versions of them: reinstall shardcoord") from _e
from .errors import (AlreadyExists, Cancelled, DeadlineExceeded, Error, FailedPrecondition, GroupFailed, Internal,
                     InvalidArgument, NotFound, OutOfRange, PermissionDenied, ResourceExhausted, Unavailable,
                     Unimplemented)
from .worker import ADDRESS_ENV, Decision, GroupInfo, LayerUnit, ModuleDecision, ModuleSpec, Worker, launcher_rank


def classify(nodes, extra_towers=(), extra_projectors=()):
    """The contract's classification (one implementation, shared with C++).

    ``nodes``: (dotted path, parameter tensors in the subtree, those requiring grad). Returns
    [(path, "tower" | "projector", fully_frozen)] in path order; controlled modules are the fully
    frozen ones."""
    return _shardcoord.classify([(p, int(n), int(t)) for p, n, t in nodes], list(extra_towers),
                                list(extra_projectors))


__version__ = _shardcoord.__version__  # CMakeLists.txt's project() version, as the daemon reports.
BUILTIN_TOWER_NAMES = tuple(_shardcoord.builtin_tower_names())
BUILTIN_PROJECTOR_NAMES = tuple(_shardcoord.builtin_projector_names())

__all__ = [
    "ADDRESS_ENV", "AlreadyExists", "BUILTIN_PROJECTOR_NAMES", "BUILTIN_TOWER_NAMES", "Cancelled", "DeadlineExceeded",
    "Decision", "Error", "FailedPrecondition", "GroupFailed", "GroupInfo", "Internal", "InvalidArgument", "LayerUnit",
    "ModuleDecision", "ModuleSpec", "NotFound", "OutOfRange", "PermissionDenied", "ResourceExhausted", "Unavailable",
    "Unimplemented", "Worker", "classify", "launcher_rank",
]
