"""The worker: one per trainer rank. Mirrors the C++ ``shardcoord::Worker``.

The values it takes and gives are the C++ types, bound (python/src/): ``ModuleSpec`` and
``LayerUnit`` (the manifest), ``WorkerOptions`` and ``TlsOptions`` (what a worker connects with),
``Decision``, ``ModuleDecision`` and ``GroupInfo`` (what the coordinator answers). They live in the
native binding, so this module looks them up on first use (``__getattr__`` below) rather than at
import: ``import shardcoord`` loads no native code (_native.py says why).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Dict, Optional, Sequence, Tuple

from ._native import native
from .errors import InvalidArgument

if TYPE_CHECKING:  # pragma: no cover
    from ._shardcoord import Decision, GroupInfo, ModuleSpec, WorkerOptions

ADDRESS_ENV = "SHARDCOORD_ADDR"

# The binding's value types, by the names the package exports.
BOUND_TYPES = ("Decision", "GroupInfo", "LayerUnit", "ModuleDecision", "ModuleSpec", "TlsOptions", "WorkerOptions")


def __getattr__(name: str):
    if name in BOUND_TYPES:
        return getattr(native(), name)
    raise AttributeError(f"module 'shardcoord.worker' has no attribute '{name}'")


# Where a launcher puts a task's rank and the number of tasks: torchrun first (torchrun inside an
# srun step sets both, and its RANK is the one its process groups use), then Slurm's srun.
LAUNCHERS = (("torchrun", "RANK", "WORLD_SIZE"), ("Slurm", "SLURM_PROCID", "SLURM_NTASKS"))


def _env_int(name: str, who: str) -> int:
    raw = os.environ.get(name)
    if raw is None:
        raise InvalidArgument(f"${name} is not set, though this looks like a {who} task: pass rank= and "
                              f"world_size= explicitly")
    try:
        value = int(raw)
    except ValueError:
        raise InvalidArgument(f"${name}={raw!r} ({who}) is not an integer") from None
    if value < 0:
        raise InvalidArgument(f"${name}={raw!r} ({who}) is negative")
    return value


def launcher_rank(rank: Optional[int] = None, world_size: Optional[int] = None) -> Tuple[int, int, str]:
    """(rank, world_size, where they came from): the arguments where given, else torchrun's
    ``RANK``/``WORLD_SIZE``, else Slurm's ``SLURM_PROCID``/``SLURM_NTASKS`` (a task started by
    ``srun``). Raises InvalidArgument naming the variables when neither launcher set them."""
    if rank is not None and world_size is not None:
        return rank, world_size, "arguments"
    for who, rank_var, size_var in LAUNCHERS:
        if rank_var in os.environ or (rank is not None and size_var in os.environ):
            r = rank if rank is not None else _env_int(rank_var, who)
            w = world_size if world_size is not None else _env_int(size_var, who)
            return r, w, who
    missing = "rank" if rank is None else "world_size"
    raise InvalidArgument(f"{missing} not given, and no launcher set it: torchrun sets $RANK and $WORLD_SIZE, "
                          f"srun sets $SLURM_PROCID and $SLURM_NTASKS; pass rank= and world_size= otherwise")


class Worker:
    """Connects to the coordinator and registers this rank (within ``connect_timeout`` seconds).

    ``rank`` and ``world_size`` default to torchrun's ``RANK`` and ``WORLD_SIZE``, or, in a task started
    by Slurm's ``srun`` without torchrun, ``SLURM_PROCID`` and ``SLURM_NTASKS`` (:func:`launcher_rank`;
    ``self.launcher`` says which); ``address`` to
    ``$SHARDCOORD_ADDR``; with neither, rank 0 starts a coordinator for this job and the others find
    it through the launcher's rendezvous store (``_embedded.py``: the embedded mode, said in the log).
    ``group_size`` is the FSDP shard group size (contiguous blocks of ranks).
    If the coordinator goes away (killed, restarted), the worker reconnects for ``reconnect_window``
    seconds and resumes, keeping the decisions it holds; 0 fails at once instead. ``token`` (a ``rank``
    token, for a coordinator started with ``--token-file``) defaults to ``$SHARDCOORD_TOKEN`` or the
    file named by ``$SHARDCOORD_TOKEN_FILE``. For a coordinator serving TLS, ``tls_ca`` names the PEM CA
    file that signed its certificate (default ``$SHARDCOORD_TLS_CA``); ``tls_cert`` and ``tls_key`` the
    client certificate and key under mutual TLS (``$SHARDCOORD_TLS_CERT``, ``$SHARDCOORD_TLS_KEY``);
    ``tls_server_name`` the name its certificate carries when it is not the host dialled.
    Use as a context manager, or call ``close()`` (a clean leave). Thread-safe: a data-loader thread
    may report plans while the training loop waits for decisions (waits release the GIL).
    :meth:`from_options` connects with a ``shardcoord.WorkerOptions`` instead (the C++ fields).
    """

    def __init__(self, job_id: str, modules: Sequence[ModuleSpec], group_size: int, *, rank: Optional[int] = None,
                 world_size: Optional[int] = None, address: Optional[str] = None, policy: str = "",
                 fallback: str = "", wrap_outer_model: bool = True, lookahead: int = 0,
                 memory_budget_bytes: int = 0, connect_timeout: float = 30.0, reconnect_window: float = 30.0,
                 token: str = "", tls_ca: str = "", tls_cert: str = "", tls_key: str = "",
                 tls_server_name: str = ""):
        rank, world_size, launcher = launcher_rank(rank, world_size)
        address = address if address is not None else os.environ.get(ADDRESS_ENV, "")
        if not address:  # The embedded coordinator of this job (_embedded.py): rank 0 starts it.
            from ._embedded import coordinator_for

            address, embedded_token = coordinator_for(job_id, rank, world_size, timeout=max(connect_timeout, 1.0))
            token = token or embedded_token
        bound = native()
        tls = bound.TlsOptions(ca_file=tls_ca, cert_file=tls_cert, key_file=tls_key, server_name=tls_server_name)
        options = bound.WorkerOptions(
            coordinator_address=address, job_id=job_id,
            rank=rank, world_size=world_size, group_size=group_size, modules=modules, policy=policy,
            fallback=fallback, wrap_outer_model=wrap_outer_model, lookahead=lookahead,
            memory_budget_bytes=memory_budget_bytes, connect_timeout=connect_timeout,
            reconnect_window=reconnect_window, token=token, tls=tls)
        self._connect(options, launcher)

    @classmethod
    def from_options(cls, options: WorkerOptions) -> "Worker":
        """Connects with a ``shardcoord.WorkerOptions`` built beforehand (the C++ WorkerOptions'
        fields, checked as they are set): its rank and world size as given, no launcher's."""
        worker = cls.__new__(cls)
        worker._connect(options, "options")
        return worker

    def _connect(self, options: WorkerOptions, launcher: str) -> None:
        self._native = native().connect(options)
        self.launcher = launcher
        self.rank = options.rank
        self.world_size = options.world_size
        self.closed = False

    def report_plan(self, step: int, microbatch: int, calls: Dict[str, int]) -> None:
        """Tells the coordinator, ahead of time, how often each controlled module will run in the
        microbatch. Never blocks on the network. Plans go in increasing (step, microbatch) order."""
        self._native.report_plan(step, microbatch, dict(calls))

    def get_decision(self, step: int, microbatch: int, timeout: float = 30.0) -> Decision:
        """The group's decision for the microbatch, waiting at most ``timeout`` seconds."""
        return self._native.get_decision(step, microbatch, float(timeout))

    def report_memory(self, usage: Sequence[Tuple[str, int, int, int]]) -> None:
        """(module, resident_bytes, peak_bytes, gathered_bytes) per controlled module; shown by shardctl."""
        self._native.report_memory(list(usage))

    def report_costs(self, costs: Sequence[Tuple[str, float, Sequence[Tuple[str, int, float]]]],
                     frozen_budget_bytes: int = 0) -> None:
        """What the controlled modules cost on this rank, for the coordinator's cost-aware ``auto``:
        ``(module, forward_seconds_per_call, [(unit, gather_bytes, gather_seconds), ...])`` per module
        (medians of recent microbatches; ``shardcoord.torch.CostMeter`` measures them), and the bytes
        frozen modules may hold at once here (0: not measured). Sent with a heartbeat, at most once
        every 5 s (the latest report wins); never blocks."""
        self._native.report_costs([(m, float(f), [tuple(u) for u in units]) for m, f, units in costs],
                                  int(frozen_budget_bytes))

    def health(self) -> None:
        """Returns while the session is usable; raises why it is not."""
        self._native.health()

    def job_health(self) -> None:
        """As :meth:`health`, and also raises GroupFailed once a rank of another shard group of
        this job was declared dead (naming it): collectives that span groups (the data-parallel
        gradient reduction) cannot complete. Stays raised for the rest of the session."""
        self._native.job_health()

    @property
    def undecided_plans(self) -> int:
        return self._native.undecided_plans()

    def await_group_ready(self, timeout: float = 60.0) -> None:
        """After a group failure: waits until the group re-formed under a new epoch."""
        self._native.await_group_ready(float(timeout))

    @property
    def group(self) -> GroupInfo:
        return self._native.group()

    def close(self, timeout: float = 10.0, reason: Optional[str] = None) -> None:
        """Says goodbye (the rank becomes LEFT, not dead), waiting at most ``timeout`` seconds for the
        coordinator to end the session (if it does not read the goodbye in time, e.g. it is paused,
        the rank counts as dead). ``reason`` is what operators see ("left cleanly: REASON"); a
        trainer that stops on an error calls :meth:`fail` instead. Idempotent."""
        self.closed = True
        self._native.close(float(timeout), reason or "", False)

    def fail(self, error: str, timeout: float = 10.0) -> None:
        """The trainer stops on an error: the rank is recorded failed (dead, reason "failed: ERROR"),
        not left, and its group fails at once naming the rank and ``error`` (the other ranks raise
        GroupFailed with it), instead of waiting for plans that will not come. Ends the session as
        :meth:`close` does. Idempotent (the first of close and fail wins)."""
        self.closed = True
        self._native.close(float(timeout), error or "stopped on an error", True)

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None or issubclass(exc_type, (KeyboardInterrupt, GeneratorExit)):
            self.close(reason="interrupted" if exc_type is not None else None)
        else:
            self.fail(f"{exc_type.__name__}: {exc}")
