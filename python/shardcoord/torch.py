"""shardcoord.torch: the manifest from a ``torch.nn.Module``, plans kept ahead of the training loop,
and a plain ``torch.distributed`` executor that carries decisions out on the real frozen parameters.

On every rank, in the same order::

    import shardcoord, shardcoord.torch as sct
    specs = sct.manifest(model)                                  # controlled (fully frozen) modules
    worker = shardcoord.Worker("run-42", specs, group_size=G)    # RANK / WORLD_SIZE from torchrun
    pg = sct.shard_process_group(worker)                         # this rank's shard group
    ex = sct.Executor(model, specs, worker, pg)                  # frozen parameters sharded now
    plans = sct.PlanAhead(worker, sct.with_keys(loader, accum),
                          lambda batch: {"model.visual": 1 if batch.images is not None else 0})
    for step, mb, batch, decision in plans:
        ex.begin_microbatch(decision)                            # root / replicate: gathered here
        loss = model(batch).loss                                 # per_layer: hooks gather each unit
        loss.backward()
        ex.end_microbatch()                                      # root: released

The executor mirrors the C++ ``shardcoord::torchx::FrozenShardExecutor`` (worker/torch/): each unit
(an entry of a controlled module's layer lists, or its rest unit "": the parameters outside them,
such as a Hugging Face tower's embeddings, norms, merger or pooling head, or the whole module when
it has no layer list) is one flat buffer padded to a multiple of the group size; each rank keeps
its 1/G shard; materializing all-gathers the buffer (as raw bytes, so the values are bitwise those
of the unsharded parameters) and points the parameters at views of it. Under ``per_layer`` the rest
unit is gathered when the module's forward starts and released when it ends, each layer around its
own forward: the peak is the rest plus one layer. torch is imported lazily: ``import shardcoord``
works without it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Callable, Deque, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence,
                    Tuple, TypeVar, Union)

from . import classify
from .errors import Error, FailedPrecondition, GroupFailed, InvalidArgument
from .worker import Decision, GroupInfo, LayerUnit, ModuleDecision, ModuleSpec, Worker

if TYPE_CHECKING:  # pragma: no cover
    import torch as _torch_t

__all__ = [
    "DEFAULT_LAYER_LISTS", "Executor", "FailureWatch", "ModuleBytes", "PlanAhead", "abort_process_group", "collective",
    "collective_failure", "manifest", "shard_process_group", "wait_collective", "with_keys",
]

# Where a tower keeps its layers: ModuleLists with one of these names, anywhere in the module and
# not inside another such list (Qwen-VL `blocks`; Whisper / Gemma `layers`; CLIP / SigLIP
# `encoder.layers`; ViT / InternViT `encoder.layer`; Mllama's vision model has two,
# `transformer.layers` and `global_transformer.layers`). Parameters outside them (patch embeddings,
# position embeddings, pre / post norms, mergers, pooling heads) form the module's rest unit.
DEFAULT_LAYER_LISTS = ("layers", "blocks", "layer")

_MAX_NAMES = 16  # Error messages list at most this many names, as the coordinator's do.

T = TypeVar("T")


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:_MAX_NAMES])
    return shown + (f" ... ({len(names) - _MAX_NAMES} more)" if len(names) > _MAX_NAMES else "")


def _param_bytes(params: Iterable[Any]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


# ---------------------------------------------------------------------------------------------
# Manifest


def _find_layer_lists(module: Any) -> List[str]:
    """Dotted paths of ``module``'s layer lists: ModuleLists named like :data:`DEFAULT_LAYER_LISTS`
    with at least one entry, outermost first, none inside another, in registration order."""
    import torch

    found: List[str] = []
    for path, child in module.named_modules():
        if not path or not isinstance(child, torch.nn.ModuleList) or len(child) == 0:
            continue
        if path.rsplit(".", 1)[-1] not in DEFAULT_LAYER_LISTS:
            continue
        if any(path.startswith(f + ".") for f in found):
            continue  # A list inside a layer is part of that layer's unit.
        found.append(path)
    return found


def _layer_lists(module: Any, path: str, given: Union[str, Sequence[str], None]) -> List[str]:
    """The layer lists of ``module``: as ``given`` ("" or [] for none: one whole-module unit), else found."""
    import torch

    if given is None:
        return _find_layer_lists(module)
    lists = [given] if isinstance(given, str) else list(given)
    lists = [g for g in lists if g]
    for g in lists:
        try:
            target = module.get_submodule(g)
        except AttributeError:
            raise InvalidArgument(f"layer_lists['{path}'] = '{g}': module '{path}' has no submodule '{g}'") from None
        if not isinstance(target, (torch.nn.ModuleList, torch.nn.Sequential)):
            raise InvalidArgument(f"layer_lists['{path}'] = '{g}' is a {type(target).__name__}, not a "
                                  f"torch.nn.ModuleList")
    nested = [(a, b) for a in lists for b in lists if a != b and (b + ".").startswith(a + ".")]
    if nested:
        raise InvalidArgument(f"layer_lists['{path}']: '{nested[0][1]}' lies inside '{nested[0][0]}'; name "
                              f"layer lists that do not contain each other")
    return lists


@dataclass
class _UnitParams:
    """One unit of a controlled module: its name (relative to the module; "" is the rest unit),
    the module whose forward it wraps (the layer, or the controlled module itself for the rest
    unit) and its parameters, in ``named_parameters`` order."""

    name: str
    module: Any
    params: List[Tuple[str, Any]]


def _rest_of(path: str, module: Any, layers: Sequence[_UnitParams]) -> List[Tuple[str, Any]]:
    """The module's parameters that none of ``layers`` holds, in ``named_parameters`` order.
    Raises InvalidArgument for a parameter that two layers hold (it belongs to neither alone)."""
    owners: Dict[int, List[str]] = collections.defaultdict(list)
    for unit in layers:
        for _, p in unit.params:
            owners[id(p)].append(unit.name)
    shared = [name for name, p in module.named_parameters() if len(owners.get(id(p), ())) > 1]
    if shared:
        raise InvalidArgument(f"module '{path}' has parameters shared by several of its layers: {_names(shared)}; "
                              f"each parameter must belong to exactly one unit (untie them, or make the whole "
                              f"module one unit with layer_lists={{'{path}': ''}})")
    return [(name, p) for name, p in module.named_parameters() if id(p) not in owners]


def _units(path: str, module: Any, layer_lists: Sequence[str]) -> List[_UnitParams]:
    """The module's units: the rest unit "" first (every parameter that no layer holds: the whole
    module when it has no layer list; omitted when the layers hold everything), then every entry
    of each layer list."""
    layers = [_UnitParams(f"{lst}.{name}", child, list(child.named_parameters()))
              for lst in layer_lists for name, child in module.get_submodule(lst).named_children()]
    rest = _rest_of(path, module, layers)
    if rest or not layers:
        return [_UnitParams("", module, rest)] + layers
    return layers


def _frozen_roots(model: Any, controlled: Sequence[str]) -> List[Tuple[str, int]]:
    """Outermost fully frozen submodules with parameters that no controlled module covers, by bytes."""
    out: List[Tuple[str, int]] = []
    for path, m in model.named_modules():
        if not path or any(path == c or path.startswith(c + ".") for c in controlled):
            continue
        if any(path.startswith(f + ".") for f, _ in out):
            continue
        params = list(m.parameters())
        if params and not any(p.requires_grad for p in params):
            out.append((path, _param_bytes(params)))
    return sorted(out, key=lambda item: -item[1])


def manifest(model: "_torch_t.nn.Module", layer_lists: Optional[Mapping[str, Union[str, Sequence[str]]]] = None,
             extra_towers: Sequence[str] = (), extra_projectors: Sequence[str] = ()) -> List[ModuleSpec]:
    """The controlled modules of ``model`` (fully frozen towers and projectors, by the contract's
    classifier), with their parameter bytes and units, in path order.

    A module's units are the entries of its layer lists (``layer_lists[path]``: a dotted attribute
    path or several; otherwise every ModuleList named like :data:`DEFAULT_LAYER_LISTS`, e.g.
    ``encoder.layers`` or ``blocks``) and, first, the rest unit ``""``: every parameter no layer holds
    (embeddings, norms, mergers, pooling heads), gathered when the module's forward starts and
    released when it ends under ``per_layer``. A module without layer lists (or with
    ``layer_lists[path] = ""``) is the rest unit alone: one whole-module unit. ``param_bytes`` is
    numel * element_size. Raises InvalidArgument when a parameter is shared between units or
    ``layer_lists`` names what the model does not have. When nothing is controlled, warns naming
    the frozen modules it saw (pass their names as ``extra_towers`` / ``extra_projectors``).
    """
    layer_lists = dict(layer_lists or {})
    modules = dict(model.named_modules())
    unknown = sorted(set(layer_lists) - set(modules))
    if unknown:
        raise InvalidArgument(f"layer_lists names modules the model does not have: {_names(unknown)}")
    nodes = []
    for path, m in modules.items():
        if not path:
            continue  # The model itself, as the C++ BuildManifest (include_self=false).
        params = list(m.parameters())
        nodes.append((path, len(params), sum(1 for p in params if p.requires_grad)))
    specs = []
    for path, _kind, fully_frozen in classify(nodes, extra_towers, extra_projectors):
        if not fully_frozen:
            continue  # A trainable tower or projector keeps normal FSDP sharding: no decisions.
        module = modules[path]
        units = _units(path, module, _layer_lists(module, path, layer_lists.get(path)))
        specs.append(ModuleSpec(path, _param_bytes(module.parameters()),
                                tuple(LayerUnit(u.name, _param_bytes(p for _, p in u.params)) for u in units)))
    if not specs:
        frozen = _frozen_roots(model, [])
        seen = ", ".join(f"'{p}' ({b / 2**20:.1f} MiB)" for p, b in frozen[:8]) or "none"
        warnings.warn(f"shardcoord.torch.manifest: no controlled module in {type(model).__name__}: none of its fully "
                      f"frozen modules has a tower or projector name (frozen modules seen: {seen}); pass their last "
                      f"name component as extra_towers=[...] or extra_projectors=[...], e.g. "
                      f"extra_towers=['{frozen[0][0].rsplit('.', 1)[-1] if frozen else 'vision'}']",
                      RuntimeWarning, stacklevel=2)
    return specs


# ---------------------------------------------------------------------------------------------
# Plans ahead of the training loop


def with_keys(batches: Iterable[T], accum: int, start_step: int = 0) -> Iterator[Tuple[int, int, T]]:
    """``(step, microbatch, batch)`` for a plain iterable of microbatches, ``accum`` per step."""
    if accum < 1:
        raise InvalidArgument(f"accum must be >= 1, got {accum}")
    for i, batch in enumerate(batches):
        yield start_step + i // accum, i % accum, batch


class PlanAhead(Iterator[Tuple[int, int, T, Decision]]):
    """Keeps this rank's plans reported ``lookahead`` microbatches ahead of the training loop, so that
    decisions are normally made before the loop asks (the wait is then a queue pop).

    ``batches`` yields ``(step, microbatch, batch)`` in increasing key order (see :func:`with_keys`);
    ``plan_fn(batch)`` says how often each controlled module runs on it (``{module: calls}``).
    Iterating yields ``(step, microbatch, batch, decision)``, the decision being the group's,
    waited for at most ``timeout`` seconds. ``lookahead`` (default: the group's, as registered)
    counts the microbatch being returned, as the C++ ``shardcoord::PlanAhead``; batches are pulled
    from ``batches`` that far ahead. Errors are the worker's, unchanged (shardcoord.Error). Not
    thread-safe: one training loop drives it.
    """

    def __init__(self, worker: Worker, batches: Iterable[Tuple[int, int, T]],
                 plan_fn: Callable[[T], Mapping[str, int]], lookahead: Optional[int] = None, timeout: float = 60.0):
        window = worker.group.lookahead
        lookahead = window if not lookahead else lookahead
        if not 1 <= lookahead <= window:
            raise InvalidArgument(f"lookahead {lookahead} must be in 1..{window} (the group's lookahead window, "
                                  f"as registered)")
        if timeout < 0:
            raise InvalidArgument(f"timeout must be >= 0 seconds, got {timeout}")
        self.lookahead = lookahead
        self.timeout = timeout
        self._worker = worker
        self._source = iter(batches)
        self._plan_fn = plan_fn
        self._pending: Deque[Tuple[int, int, T]] = collections.deque()
        self._exhausted = False
        self.reported = 0  # Plans reported so far.
        self.key: Optional[Tuple[int, int]] = None  # The key returned last.

    @property
    def pending(self) -> List[Tuple[int, int]]:
        """Keys reported and not yet returned, oldest first."""
        return [(s, m) for s, m, _ in self._pending]

    def _fill(self) -> None:
        while not self._exhausted and len(self._pending) < self.lookahead:
            try:
                item = next(self._source)
            except StopIteration:
                self._exhausted = True
                return
            try:
                step, microbatch, batch = item
            except (TypeError, ValueError):
                raise InvalidArgument(f"PlanAhead: batches must yield (step, microbatch, batch) tuples, got "
                                      f"{type(item).__name__}; wrap a plain loader with with_keys(loader, accum)") \
                    from None
            self._worker.report_plan(step, microbatch, self._plan_fn(batch))
            self._pending.append((step, microbatch, batch))
            self.reported += 1

    def __iter__(self) -> "PlanAhead[T]":
        return self

    def __next__(self) -> Tuple[int, int, T, Decision]:
        self._fill()
        if not self._pending:
            raise StopIteration
        step, microbatch, batch = self._pending.popleft()
        self.key = (step, microbatch)
        return step, microbatch, batch, self._worker.get_decision(step, microbatch, self.timeout)


# ---------------------------------------------------------------------------------------------
# Collectives that fail name the cause


def collective_failure(worker: Optional[Worker], what: str, cause: BaseException, wait: float = 2.0) -> Error:
    """The error to raise for a failed ``torch.distributed`` collective.

    A peer's socket closing usually means the peer died; the coordinator sees its session end at
    the same moment and fails its group, naming the rank, and tells the job's other groups. This
    waits up to ``wait`` seconds for that verdict (``worker.job_health()``: this rank's group, or a
    rank lost in another group, which a collective over the world also includes) and returns it
    (GroupFailed: "... rank 1 declared dead ..."), or GroupFailed with the collective's own error
    when none comes."""
    if worker is not None:
        deadline = time.monotonic() + wait
        while True:
            try:
                worker.job_health()
            except Error as verdict:
                return verdict
            if time.monotonic() >= deadline:
                break
            time.sleep(0.02)
    return GroupFailed(f"{what} failed: {cause}")


@contextlib.contextmanager
def collective(worker: Optional[Worker], what: str, wait: float = 2.0) -> Iterator[None]:
    """``with collective(worker, "gradient all-reduce"): dist.all_reduce(t)``: a RuntimeError from
    the collective becomes :func:`collective_failure`'s shardcoord error (chained to it)."""
    try:
        yield
    except Error:
        raise
    except RuntimeError as e:
        raise collective_failure(worker, what, e, wait) from e


def wait_collective(work: Any, worker: Optional[Worker], what: str, *, poll: float = 0.05,
                    verdict_wait: float = 2.0) -> None:
    """Waits for an asynchronous collective (``dist.all_reduce(t, async_op=True)``) while watching
    the coordinator: once this rank's group failed, or a rank of another group of the job was
    declared dead (also one that hangs without closing its sockets, after the heartbeat timeout:
    a world collective waits for it too), the verdict is raised at once,
    instead of after the backend's own timeout; a collective that fails raises
    :func:`collective_failure`'s error. The abandoned operation must not be waited for again:
    the process group is unusable (exit, or build a new one)."""
    import datetime

    if worker is None:
        with collective(None, what, verdict_wait):
            work.wait()
        return
    interval = datetime.timedelta(seconds=poll)
    while True:
        try:
            work.wait(interval)
            return
        except RuntimeError:  # "Operation timed out!" (the poll) or the collective's failure.
            if work.is_completed():
                # Completed: but maybe just after the poll timed out (the poll's "Operation timed
                # out!" is no failure; taking it for one failed a healthy job on a loaded host,
                # issue 25). Its own outcome decides: waiting again returns at once.
                with collective(worker, what, verdict_wait):
                    work.wait()
                return
        worker.job_health()  # Raises the coordinator's verdict (GroupFailed names the rank).


def abort_process_group(pg: Any = None) -> bool:
    """Aborts a ``torch.distributed`` process group (``None``: the default one) so that collectives
    blocked in it return (NCCL kernels watch the communicator's abort flag). Returns False when this
    torch or backend cannot abort (torch 1.13, Gloo: a dead peer's closed sockets fail those)."""
    import torch
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    abort = getattr(c10d, "_abort_process_group", None)  # torch >= 2.6
    if abort is not None:
        abort(pg)
        return True
    group = pg if pg is not None else c10d._get_default_group()
    for device in ("cuda", "cpu"):
        try:
            backend = group._get_backend(torch.device(device))
        except Exception:
            continue
        if hasattr(backend, "abort"):
            backend.abort()
            return True
    return False


class FailureWatch:
    """Watches the coordinator from a background thread while the training loop runs collectives
    that shardcoord does not manage (FSDP2's all-gathers and reduce-scatters on NCCL).

    Once this rank's group fails (a member killed, or hung past the heartbeat timeout), or with
    ``job_wide`` (the default, right for process groups that span shard groups, such as the
    default one) once a rank of any group of the job is declared dead, the watch keeps the
    coordinator's verdict (GroupFailed, naming the rank), prints it on stderr and aborts
    ``process_groups`` (default: the default group) so that nothing stays blocked in a collective
    with the dead peer; :meth:`check`, called by the training loop once per microbatch and after
    anything that waits for the GPU, raises the verdict. Without it, a rank blocked in an NCCL
    collective waits for the process group's timeout and then dies without saying why. The
    aborted process groups are unusable afterwards: leave the process (or build new ones)::

        with sct.FailureWatch(worker) as watch:
            for step, mb, batch, decision in plans:
                watch.check()
                ...
                loss.item(); watch.check()
    """

    def __init__(self, worker: Worker, process_groups: Sequence[Any] = (None,), poll: float = 0.05,
                 job_wide: bool = True):
        if poll <= 0:
            raise InvalidArgument(f"poll must be > 0 seconds, got {poll}")
        self._worker = worker
        self._groups = list(process_groups)
        self._poll = poll
        self._check = worker.job_health if job_wide else worker.health
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._abort = abort_process_group  # A seam for tests (torch 1.13 cannot abort Gloo).
        self.verdict: Optional[Error] = None
        self.aborted = False
        self.polls = 0  # Health checks made so far.

    def start(self) -> "FailureWatch":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="shardcoord-failure-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(max(1.0, 4 * self._poll))

    def __enter__(self) -> "FailureWatch":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def check(self) -> None:
        """Raises the coordinator's verdict once the group failed; returns at once otherwise."""
        if self.verdict is not None:
            raise self.verdict

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            try:
                self.polls += 1
                self._check()
            except Error as verdict:
                if self._stop.is_set() or getattr(self._worker, "closed", False):  # A clean end, not a failure.
                    return
                self.verdict = verdict
                print(f"shardcoord: rank {self._worker.rank}: {type(verdict).__name__}: {verdict}; aborting the "
                      f"process groups", file=sys.stderr, flush=True)
                for pg in self._groups:
                    try:
                        self.aborted = bool(self._abort(pg)) or self.aborted
                    except Exception as e:  # The verdict stands; the loop raises it at check().
                        print(f"shardcoord: aborting a process group failed: {e}", file=sys.stderr, flush=True)
                return


def shard_process_group(group: Union[Worker, GroupInfo]) -> Any:
    """Creates the ``torch.distributed`` process group of every shard group (contiguous blocks of
    ``len(group.ranks)`` ranks) and returns this rank's. Call it on every rank, after
    ``init_process_group`` (``new_group`` is collective over the world)."""
    import torch.distributed as dist

    info = group.group if isinstance(group, Worker) else group
    world, size = dist.get_world_size(), len(info.ranks)
    if size == world:
        return dist.group.WORLD
    if size < 1 or world % size or list(info.ranks) != list(range(info.ranks[0], info.ranks[0] + size)):
        raise InvalidArgument(f"shard group ranks {info.ranks} are not a contiguous block dividing the world of "
                              f"{world} ranks")
    mine = None
    for start in range(0, world, size):
        pg = dist.new_group(list(range(start, start + size)))
        if start == info.ranks[0]:
            mine = pg
    return mine


# ---------------------------------------------------------------------------------------------
# The executor


@dataclass
class ModuleBytes:
    """Bytes counted on this rank for one controlled module (as the C++ executor's)."""

    shard: int = 0     # Always resident: this rank's shards.
    resident: int = 0  # Shards plus currently materialized full buffers.
    peak: int = 0      # Highest ``resident`` so far.
    gathered: int = 0  # Total bytes received by all-gathers.


@dataclass
class _Param:
    param: Any  # The module's torch.nn.Parameter; its .data is swapped.
    shape: Tuple[int, ...]
    offset: int  # In the unit's flat buffer (elements).
    numel: int


@dataclass
class _Unit:
    name: str
    params: List[_Param]
    shard: Any          # This rank's slice of the padded flat buffer.
    padded: int         # Elements in the full buffer.
    full: Any = None    # The materialized flat buffer, or None.

    @property
    def full_bytes(self) -> int:
        return self.padded * self.shard.element_size()

    @property
    def shard_bytes(self) -> int:
        return self.shard.numel() * self.shard.element_size()


@dataclass
class _Module:
    spec: ModuleSpec
    units: List[_Unit] = field(default_factory=list)
    rest: Optional[_Unit] = None  # The rest unit "" beside layer units (gathered around the module's forward).
    decision: Optional[str] = None  # None outside a microbatch.
    replicated: bool = False


def _checked_units(spec: ModuleSpec, module: Any) -> List[_UnitParams]:
    """The units of a manifest entry, in the manifest's order, checked as the C++ executor does:
    every parameter in exactly one unit (those outside the named layers in the rest unit ""),
    none trainable, one dtype and device per unit."""
    names = [u.name for u in spec.units] or [""]
    if len(set(names)) != len(names):
        raise InvalidArgument(f"manifest module '{spec.name}' lists a unit twice: {_names(names)}")
    layers = []
    for name in names:
        if not name:
            continue
        try:
            child = module.get_submodule(name)
        except AttributeError:
            raise InvalidArgument(f"unit '{name}' of manifest module '{spec.name}' is not in the model") from None
        layers.append(_UnitParams(name, child, list(child.named_parameters())))
    rest = _rest_of(spec.name, module, layers)
    if rest and "" not in names:
        raise InvalidArgument(f"module '{spec.name}' has parameters outside the units its manifest names: "
                              f"{_names([n for n, _ in rest])}; list the rest unit \"\" (shardcoord.torch.manifest does)")
    by_name = {u.name: u for u in layers}
    units = [by_name[n] if n else _UnitParams("", module, rest) for n in names]
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    if trainable:
        raise InvalidArgument(f"module '{spec.name}' has trainable parameters {_names(trainable)}: only fully frozen "
                              f"modules are controlled")
    for unit in units:
        if unit.params:
            first = unit.params[0][1]
            mixed = [n for n, p in unit.params if p.dtype != first.dtype or p.device != first.device]
            if mixed:
                raise InvalidArgument(f"unit '{unit.name}' of '{spec.name}' mixes dtypes or devices ({first.dtype} on "
                                      f"{first.device}, and {_names(mixed)})")
    return units


_DECISIONS = ("skip", "per_layer", "root", "replicate")


class Executor:
    """Carries the group's decisions out on the real frozen parameters of ``model``.

    At construction each unit of every module in ``manifest`` is flattened, padded to a multiple of
    the group size and sharded: this rank keeps 1/G of it and the parameters' ``.data`` become empty
    (the Parameter objects stay; memory is freed). Every rank of the shard group must construct it
    with the same model structure and manifest, and call :meth:`begin_microbatch` /
    :meth:`end_microbatch` for the same microbatches in the same order with the group's decision:

    - ``skip``: nothing (running the module anyway raises FailedPrecondition: its plan said 0).
    - ``per_layer``: forward hooks gather each unit right before its forward and release it right
      after, so the model's own calls drive the collectives (every rank calls it equally often).
    - ``root``: every unit gathered now; released by :meth:`end_microbatch` (call it after backward).
    - ``replicate``: every unit gathered once and kept resident until a decision that is not.

    The group: ``process_group`` (a torch.distributed group; default: the world) with
    ``rank_in_group`` / ``group_size`` taken from it unless given; ``group`` (the Worker or its
    GroupInfo) is checked against it, and a Worker also names the cause of a failed all-gather
    (see :func:`collective_failure`). CPU tensors need Gloo, CUDA tensors NCCL. Not thread-safe.
    """

    def __init__(self, model: "_torch_t.nn.Module", manifest: Sequence[ModuleSpec],
                 group: Union[Worker, GroupInfo, None] = None, process_group: Any = None,
                 rank_in_group: Optional[int] = None, group_size: Optional[int] = None, *,
                 verdict_wait: float = 2.0):
        import torch
        import torch.distributed as dist

        self._worker = group if isinstance(group, Worker) else None
        info = group.group if isinstance(group, Worker) else group
        if process_group is None and info is not None and dist.is_initialized() \
                and len(info.ranks) != dist.get_world_size():
            raise InvalidArgument(f"the shard group has ranks {info.ranks} but the world has "
                                  f"{dist.get_world_size()}: pass its process_group (shard_process_group(worker))")
        if info is not None and group_size is None and len(info.ranks) == 1:
            rank_in_group, group_size = 0, 1  # A group of one needs no process group.
        if rank_in_group is None or group_size is None:
            if not dist.is_initialized():
                raise FailedPrecondition("torch.distributed is not initialized: call init_process_group first, or "
                                         "give rank_in_group and group_size")
            pg = process_group if process_group is not None else dist.group.WORLD
            rank_in_group = dist.get_rank(pg) if rank_in_group is None else rank_in_group
            group_size = dist.get_world_size(pg) if group_size is None else group_size
        if group_size < 1 or not 0 <= rank_in_group < group_size:
            raise InvalidArgument(f"rank_in_group {rank_in_group} is not in 0..{group_size - 1}")
        if info is not None and len(info.ranks) != group_size:
            raise InvalidArgument(f"the coordinator's shard group has {len(info.ranks)} ranks {info.ranks}, the "
                                  f"process group {group_size}")
        self._pg = process_group
        self._rank = rank_in_group
        self._size = group_size
        self._verdict_wait = verdict_wait
        self._modules: Dict[str, _Module] = {}
        self._bytes: Dict[str, ModuleBytes] = {}
        self._resident_total = 0
        self._peak_total = 0
        self._in_microbatch = False
        self._hooks: List[Any] = []
        self.gathers = 0  # All-gathers issued (one per unit materialized).

        by_path = dict(model.named_modules())
        checked = []
        for spec in manifest:  # Everything is checked before any parameter changes.
            if not isinstance(spec, ModuleSpec):
                raise InvalidArgument(f"manifest entries must be shardcoord.ModuleSpec, got {type(spec).__name__}")
            if not spec.name or spec.name not in by_path:
                raise InvalidArgument(f"manifest module '{spec.name}' is not in the model")
            checked.append((spec, _checked_units(spec, by_path[spec.name])))
        with torch.no_grad():
            for spec, units in checked:
                self._shard_module(spec, units)

    # -- construction

    def _shard_module(self, spec: ModuleSpec, units: List[_UnitParams]) -> None:
        import torch

        mod = _Module(spec)
        self._bytes[spec.name] = ModuleBytes()
        for u in units:
            params = [p for _, p in u.params]
            if not params:
                continue  # Nothing to gather; no hooks, no collectives (the same on every rank).
            first, g, offset, flat, entries = params[0], self._size, 0, [], []
            for p in params:
                entries.append(_Param(p, tuple(p.shape), offset, p.numel()))
                flat.append(p.detach().reshape(-1))
                offset += p.numel()
            chunk = (offset + g - 1) // g
            full = torch.zeros(chunk * g, dtype=first.dtype, device=first.device)
            full[:offset].copy_(torch.cat(flat))
            shard = full[self._rank * chunk:(self._rank + 1) * chunk].clone()
            del full, flat
            for e in entries:  # The Parameter objects stay (optimizers, hooks); their storage goes.
                e.param.data = torch.empty(0, dtype=first.dtype, device=first.device)
            unit = _Unit(u.name, entries, shard, chunk * g)
            mod.units.append(unit)
            if u.name == "" and len(units) > 1:
                mod.rest = unit
            self._bytes[spec.name].shard += unit.shard_bytes
            self._account(mod, unit.shard_bytes)
            # The rest unit (or the whole-module unit) wraps the module's own forward: under
            # per_layer it is gathered when the forward starts, before any layer, and released
            # when it ends, after every layer, so every rank gathers in the same order.
            self._hooks.append(u.module.register_forward_pre_hook(functools.partial(self._before, mod, unit)))
            self._hooks.append(u.module.register_forward_hook(functools.partial(self._after, mod, unit)))
        self._modules[spec.name] = mod

    # -- materialize / release

    def _account(self, mod: _Module, delta: int) -> None:
        b = self._bytes[mod.spec.name]
        b.resident += delta
        b.peak = max(b.peak, b.resident)
        self._resident_total += delta
        self._peak_total = max(self._peak_total, self._resident_total)

    def _materialize(self, mod: _Module, unit: _Unit) -> None:
        if unit.full is not None:
            return
        import torch
        import torch.distributed as dist

        full = torch.empty(unit.padded, dtype=unit.shard.dtype, device=unit.shard.device)
        self.gathers += 1
        if self._size == 1:
            full.copy_(unit.shard)  # A group of one: the all-gather is a copy (no torch.distributed needed).
        else:
            # Gathered as bytes: exact for every dtype, whatever the backend supports for it.
            chunk = unit.shard.numel()
            outputs = [full[r * chunk:(r + 1) * chunk].view(torch.uint8) for r in range(self._size)]
            what = f"all-gather of unit '{unit.name}' of '{mod.spec.name}'"
            with collective(self._worker, what, self._verdict_wait):
                work = dist.all_gather(outputs, unit.shard.view(torch.uint8), group=self._pg, async_op=True)
            wait_collective(work, self._worker, what, verdict_wait=self._verdict_wait)
        for p in unit.params:
            p.param.data = full[p.offset:p.offset + p.numel].view(p.shape)
        unit.full = full
        self._bytes[mod.spec.name].gathered += unit.full_bytes
        self._account(mod, unit.full_bytes)

    def _release(self, mod: _Module, unit: _Unit) -> None:
        if unit.full is None:
            return
        import torch

        for p in unit.params:
            p.param.data = torch.empty(0, dtype=unit.shard.dtype, device=unit.shard.device)
        unit.full = None
        self._account(mod, -unit.full_bytes)

    # -- hooks (per_layer, and the skip check)

    def _before(self, mod: _Module, unit: _Unit, _module: Any, _inputs: Any) -> None:
        if mod.decision is None:
            raise FailedPrecondition(f"module '{mod.spec.name}' ran outside a microbatch: call "
                                     f"begin_microbatch(decision) before the forward")
        if mod.decision == "skip":
            raise FailedPrecondition(f"module '{mod.spec.name}' is decided `skip` for this microbatch, but this rank "
                                     f"runs it (unit '{unit.name}'): its plan said 0 calls")
        if mod.decision == "per_layer":
            if mod.rest is not None and unit is not mod.rest and mod.rest.full is None:
                raise FailedPrecondition(
                    f"unit '{unit.name}' of '{mod.spec.name}' ran outside the module's own forward, so the module's "
                    f"rest unit (its parameters outside the layer lists) is not gathered: per_layer gathers it when "
                    f"'{mod.spec.name}' is called; call the module, not its layers directly")
            self._materialize(mod, unit)

    def _after(self, mod: _Module, unit: _Unit, _module: Any, _inputs: Any, output: Any) -> None:
        if mod.decision != "per_layer":
            return
        self._release(mod, unit)
        import torch

        if torch.is_grad_enabled() and _requires_grad(output):
            raise FailedPrecondition(
                f"unit '{unit.name}' of '{mod.spec.name}' produced an output that requires grad, so backward would "
                f"need its weights, but per_layer releases them after the forward: run the frozen module under "
                f"torch.no_grad() (its inputs must not require grad)")

    # -- the microbatch

    def begin_microbatch(self, decision: Union[Decision, Mapping[str, Union[str, ModuleDecision]]]) -> None:
        """Applies the group's decision at the always-run start of a microbatch: ``root`` modules
        are gathered whole now, ``replicate`` modules become resident (gathered once); ``skip`` and
        ``per_layer`` do nothing yet. Call it on every rank of the group, whatever this rank runs."""
        if self._in_microbatch:
            raise FailedPrecondition("begin_microbatch called twice: call end_microbatch after each microbatch's "
                                     "backward")
        entries = decision.modules if isinstance(decision, Decision) else decision
        where = f"({decision.step}, {decision.microbatch})" if isinstance(decision, Decision) else "the microbatch"
        chosen = {}
        for name in self._modules:
            d = entries.get(name)
            if d is None:
                raise InvalidArgument(f"the decision for {where} has no entry for module '{name}': register the "
                                      f"executor's manifest with the coordinator")
            d = d.decision if isinstance(d, ModuleDecision) else d
            if d not in _DECISIONS:
                raise InvalidArgument(f"unknown decision '{d}' for module '{name}'")
            chosen[name] = d
        for name, mod in self._modules.items():
            mod.decision = chosen[name]
            if mod.decision != "replicate" and mod.replicated:
                # Demoted by `auto`: back to sharded from this microbatch on (local, no collective).
                for unit in mod.units:
                    self._release(mod, unit)
                mod.replicated = False
            if mod.decision == "root" or (mod.decision == "replicate" and not mod.replicated):
                for unit in mod.units:  # Same order on every rank.
                    self._materialize(mod, unit)
                mod.replicated = mod.decision == "replicate"
        self._in_microbatch = True

    def end_microbatch(self) -> None:
        """After the microbatch's backward: releases what ``root`` gathered (and any unit a failed
        forward left gathered). Local, no collective; ``replicate`` modules stay resident."""
        for mod in self._modules.values():
            if not mod.replicated:
                for unit in mod.units:
                    self._release(mod, unit)
            mod.decision = None
        self._in_microbatch = False

    # -- what it holds

    def current(self, module: str) -> Optional[str]:
        """The decision ``module`` runs under now (None outside a microbatch)."""
        return self._modules[module].decision

    def unit_count(self, module: str) -> int:
        """Units of ``module`` that hold parameters."""
        return len(self._modules[module].units)

    @property
    def bytes(self) -> Dict[str, ModuleBytes]:
        return {name: ModuleBytes(**vars(b)) for name, b in self._bytes.items()}

    @property
    def peak_total_bytes(self) -> int:
        return self._peak_total

    @property
    def resident_total_bytes(self) -> int:
        return self._resident_total

    def memory_usage(self) -> List[Tuple[str, int, int, int]]:
        """(module, resident_bytes, peak_bytes, gathered_bytes), as ``Worker.report_memory`` takes."""
        return [(name, b.resident, b.peak, b.gathered) for name, b in sorted(self._bytes.items())]


def _requires_grad(output: Any) -> bool:
    import torch

    if isinstance(output, torch.Tensor):
        return output.requires_grad
    if isinstance(output, Mapping):
        return any(_requires_grad(v) for v in output.values())
    if isinstance(output, (tuple, list)):
        return any(_requires_grad(v) for v in output)
    return False
