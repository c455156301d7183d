"""shardcoord: safe per-layer sharding of frozen multimodal towers (Python binding).

    import shardcoord
    with shardcoord.Worker("run-42", manifest, group_size=8) as w:   # RANK/WORLD_SIZE from torchrun
        w.report_plan(step, mb, {"model.visual": 1})                  # ahead of time
        d = w.get_decision(step, mb, timeout=30)                      # right before the microbatch
        d["model.visual"].decision                                    # "per_layer", "skip", "root", "replicate", "padded"

``shardcoord.torch`` builds the manifest from a ``torch.nn.Module`` and keeps plans ahead of the
training loop. ``import shardcoord`` loads no native code and never imports torch; the binding is
loaded on first use (_native.py says why), also by the first use of the types it binds
(``ModuleSpec``, ``WorkerOptions``, ``Decision``, ...).
"""

from ._native import native as _native
from .errors import (AlreadyExists, Cancelled, DeadlineExceeded, Error, FailedPrecondition, GroupFailed, Internal,
                     InvalidArgument, NotFound, OutOfRange, PermissionDenied, ResourceExhausted, Unauthenticated,
                     Unavailable, Unimplemented)
from .worker import ADDRESS_ENV, BOUND_TYPES as _BOUND_TYPES, Worker, launcher_rank


def classify(nodes, extra_towers=(), extra_projectors=()):
    """The contract's classification (one implementation, shared with C++).

    ``nodes``: (dotted path, parameter tensors in the subtree, those requiring grad). Returns
    [(path, "tower" | "projector", fully_frozen)] in path order; controlled modules are the fully
    frozen ones."""
    return _native().classify([(p, int(n), int(t)) for p, n, t in nodes], list(extra_towers),
                              list(extra_projectors))


try:  # CMakeLists.txt's project() version, as the daemon reports; written by the build (CMake, setup.py).
    from ._version import __version__
except ImportError:  # A tree without it: the binding knows.
    __version__ = _native().__version__


def __getattr__(name):
    """The binding's value types (ModuleSpec, Decision, ...: worker.BOUND_TYPES), BUILTIN_TOWER_NAMES
    and BUILTIN_PROJECTOR_NAMES (the contract's), from the binding on first use (``import
    shardcoord`` loads no native code: see _native.py)."""
    if name in _BOUND_TYPES:
        value = getattr(_native(), name)
    elif name == "BUILTIN_TOWER_NAMES":
        value = tuple(_native().builtin_tower_names())
    elif name == "BUILTIN_PROJECTOR_NAMES":
        value = tuple(_native().builtin_projector_names())
    else:
        raise AttributeError(f"module 'shardcoord' has no attribute '{name}'")
    globals()[name] = value
    return value


__all__ = [
    "ADDRESS_ENV", "AlreadyExists", "BUILTIN_PROJECTOR_NAMES", "BUILTIN_TOWER_NAMES", "Cancelled", "DeadlineExceeded",
    "Decision", "Error", "FailedPrecondition", "GroupFailed", "GroupInfo", "Internal", "InvalidArgument", "LayerUnit",
    "ModuleDecision", "ModuleSpec", "NotFound", "OutOfRange", "PermissionDenied", "ResourceExhausted", "TlsOptions",
    "Unauthenticated", "Unavailable", "Unimplemented", "Worker", "WorkerOptions", "classify", "launcher_rank",
]
