"""The executor: carries the group's decisions out on the real frozen parameters with plain
``torch.distributed`` (the package docstring says how), and the shard group's process group it
runs over."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import FailedPrecondition, InvalidArgument
from ..worker import Worker
from ._failures import collective, wait_collective
from ._manifest import _names, _rest_of, _UnitParams
from ._placement import PER_LAYER_HOOKS, PadChain, decision_of, padded_plan, requires_grad

if TYPE_CHECKING:  # pragma: no cover
    import torch as _torch_t

    from ..worker import Decision, GroupInfo, ModuleSpec


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

    @property
    def forward_order(self) -> List[_Unit]:
        """The units in the order a forward through the module gathers them: the rest unit first
        (its hook wraps the module's own forward), then the layer units in manifest order."""
        return ([self.rest] if self.rest is not None else []) + [u for u in self.units if u is not self.rest]


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
    if trainable and not spec.trainable:
        raise InvalidArgument(f"module '{spec.name}' has trainable parameters {_names(trainable)}: only fully frozen "
                              f"modules are controlled, and those opted in as trainable (manifest(model, "
                              f"trainable=...) sets ModuleSpec.trainable)")
    if spec.trainable:  # Adapters on a frozen base: only the frozen parameters are sharded.
        units = [_UnitParams(u.name, u.module, [(n, p) for n, p in u.params if not p.requires_grad]) for u in units]
    for unit in units:
        if unit.params:
            first = unit.params[0][1]
            mixed = [n for n, p in unit.params if p.dtype != first.dtype or p.device != first.device]
            if mixed:
                raise InvalidArgument(f"unit '{unit.name}' of '{spec.name}' mixes dtypes or devices ({first.dtype} on "
                                      f"{first.device}, and {_names(mixed)})")
    return units


def _checked_manifest(model: Any, manifest: Sequence[ModuleSpec]) -> List[Tuple[ModuleSpec, List[_UnitParams]]]:
    """Each entry of ``manifest`` with its units in ``model`` (see :func:`_checked_units`)."""
    from ..worker import ModuleSpec  # The binding's types, loaded at first use (worker.py).

    by_path = dict(model.named_modules())
    checked = []
    for spec in manifest:
        if not isinstance(spec, ModuleSpec):
            raise InvalidArgument(f"manifest entries must be shardcoord.ModuleSpec, got {type(spec).__name__}")
        if not spec.name or spec.name not in by_path:
            raise InvalidArgument(f"manifest module '{spec.name}' is not in the model")
        checked.append((spec, _checked_units(spec, by_path[spec.name])))
    return checked


def _place_in_group(info: Optional[GroupInfo], process_group: Any, rank_in_group: Optional[int],
                    group_size: Optional[int]) -> Tuple[int, int]:
    """(rank_in_group, group_size): as given, else the process group's (default: the world's),
    checked against the coordinator's shard group ``info`` where there is one."""
    import torch.distributed as dist

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
    return rank_in_group, group_size


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
    - ``padded`` (``("padded", K)`` in the mapping form; ``ModuleDecision.calls`` is K): ranks call
      the module unequally often, and each must make K all-gather passes over it, K the most calls
      any rank makes. The rank's own calls gather as under ``per_layer``; the other K - c (c: the
      rank's planned calls, given to :meth:`begin_microbatch` as ``calls``) are pad passes: each
      unit gathered and released at once, no forward, in the order a forward through the module
      gathers them (the rest unit "" first, then the layers in manifest order, the order of the
      module's layer list). The peak stays one unit (the rest unit plus one layer during a real
      call), not the whole module as under ``root``. Several modules can be padded in one
      microbatch: their passes form a chain in manifest order. :meth:`begin_microbatch` (after the
      ``root`` and ``replicate`` gathers) issues the pads of the padded modules in manifest order
      up to the first one this rank calls (that module's pads included), and stops there; the end
      of this rank's last planned call of it (its forward post-hook) issues the pads from the next
      one on, up to the next it calls, and so on. So every rank makes module A's K passes, then
      module B's, whichever of them it calls or pads. What that assumes of the model:

      - the forward calls the padded modules in manifest order (order the manifest as the forward
        calls them), every call of one before the first call of the next;
      - the padded modules come before any ``per_layer`` module's call (root, replicate and skip
        gather nothing in the forward), and they are the first users of the shard process
        group in the microbatch (no other collective on it between begin_microbatch and their
        last call);
      - the rank runs exactly the calls it planned, and ``calls`` names every padded module (0
        included).

      Checked, before a call gathers anything (FailedPrecondition naming both modules): a padded
      module called while an earlier padded module still has planned calls left, any other
      controlled module called while a padded module still has, and a call beyond the plan;
      :meth:`end_microbatch` raises for fewer calls (and for pads a short module held back).

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

        self._worker = group if isinstance(group, Worker) else None
        info = group.group if isinstance(group, Worker) else group
        self._pg = process_group
        self._rank, self._size = _place_in_group(info, process_group, rank_in_group, group_size)
        self._verdict_wait = verdict_wait
        self._modules: Dict[str, _Module] = {}
        self._bytes: Dict[str, ModuleBytes] = {}
        self._resident_total = 0
        self._peak_total = 0
        self._in_microbatch = False
        self._hooks: List[Any] = []
        self.gathers = 0  # All-gathers issued (one per unit materialized).

        checked = _checked_manifest(model, manifest)  # Everything is checked before any parameter changes.
        with torch.no_grad():
            for spec, units in checked:
                self._shard_module(spec, units, model.get_submodule(spec.name))
        # Padded modules' passes, in manifest order (modules without parameters gather nothing).
        self._chain = PadChain([name for name, mod in self._modules.items() if mod.units],
                                lambda name, passes: self._pad(self._modules[name], passes))

    # -- construction

    def _shard_module(self, spec: ModuleSpec, units: List[_UnitParams], module: Any) -> None:
        import torch

        mod = _Module(spec)
        self._bytes[spec.name] = ModuleBytes()
        gathers = any(u.params for u in units)
        if gathers:  # Before the units' hooks: a call is checked before its rest unit gathers.
            self._hooks.append(module.register_forward_pre_hook(functools.partial(self._call_begins, mod)))
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
        if gathers:  # After the units' hooks: a call ends once its rest unit is released.
            self._hooks.append(module.register_forward_hook(functools.partial(self._call_ends, mod)))
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

    def _call_begins(self, mod: _Module, _module: Any, _inputs: Any) -> None:
        """A call of the module starts: refused, before it gathers, out of the padded modules' order."""
        if mod.decision is not None:
            self._chain.before_call(mod.spec.name, mod.decision)

    def _call_ends(self, mod: _Module, _module: Any, _inputs: Any, _output: Any) -> None:
        """A call of the module ended: after this rank's last planned call of a padded module, the
        pad chain goes on (the next padded modules' pads)."""
        if mod.decision is not None:
            self._chain.after_call(mod.spec.name)

    def _before(self, mod: _Module, unit: _Unit, _module: Any, _inputs: Any) -> None:
        if mod.decision is None:
            raise FailedPrecondition(f"module '{mod.spec.name}' ran outside a microbatch: call "
                                     f"begin_microbatch(decision) before the forward")
        if mod.decision == "skip":
            raise FailedPrecondition(f"module '{mod.spec.name}' is decided `skip` for this microbatch, but this rank "
                                     f"runs it (unit '{unit.name}'): its plan said 0 calls")
        if mod.decision in PER_LAYER_HOOKS:
            if mod.rest is not None and unit is not mod.rest and mod.rest.full is None:
                raise FailedPrecondition(
                    f"unit '{unit.name}' of '{mod.spec.name}' ran outside the module's own forward, so the module's "
                    f"rest unit (its parameters outside the layer lists) is not gathered: per_layer gathers it when "
                    f"'{mod.spec.name}' is called; call the module, not its layers directly")
            self._materialize(mod, unit)

    def _after(self, mod: _Module, unit: _Unit, _module: Any, _inputs: Any, output: Any) -> None:
        if mod.decision not in PER_LAYER_HOOKS:
            return
        import torch

        if mod.spec.trainable and torch.is_grad_enabled() and requires_grad(output):
            return  # Its backward needs the frozen weights: kept until end_microbatch (every rank alike).
        self._release(mod, unit)
        if torch.is_grad_enabled() and requires_grad(output):
            raise FailedPrecondition(
                f"unit '{unit.name}' of '{mod.spec.name}' produced an output that requires grad, so backward would "
                f"need its weights, but per_layer releases them after the forward: run the frozen module under "
                f"torch.no_grad() (its inputs must not require grad)")

    # -- the microbatch

    def begin_microbatch(self, decision: Union[Decision, Mapping[str, Any]],
                         calls: Optional[Mapping[str, int]] = None) -> None:
        """Applies the group's decision at the always-run start of a microbatch: ``root`` modules
        are gathered whole now, ``replicate`` modules become resident (gathered once); then the pad
        chain starts: ``padded`` modules get their pad passes, in manifest order, up to the first
        one this rank calls (the rest follow its last planned call); ``skip`` and ``per_layer`` do
        nothing yet. Call it on every rank of the group, whatever this rank runs, before the forward.

        ``decision``: the group's Decision, or a mapping module -> decision name, ``("padded", K)``
        or ModuleDecision. ``calls``: this rank's planned calls per module (the plan it reported);
        required for the modules decided ``padded``."""
        if self._in_microbatch:
            raise FailedPrecondition("begin_microbatch called twice: call end_microbatch after each microbatch's "
                                     "backward")
        chosen = self._chosen(decision)
        unsafe = [f"'{name}' ({chosen[name][0]})" for name, mod in self._modules.items()
                  if mod.spec.trainable and chosen[name][0] in ("padded", "replicate")]
        if unsafe:
            raise FailedPrecondition(
                f"trainable module(s) {', '.join(unsafe)} decided padded or replicate: a coordinator decides a "
                f"trainable module skip, per_layer or root only (its backward needs what the forward gathered); this "
                f"one predates trainable modules: run the shardcoordd of this package's version")
        planned = padded_plan(chosen, calls)  # Everything checked before any module changes.
        for name, mod in self._modules.items():
            mod.decision = chosen[name][0]
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
        # After root and replicate, the same on every rank: the pads depend on this rank's calls.
        self._chain.begin({name: (chosen[name][1], n) for name, n in planned.items()})
        self._chain.start()

    def _pad(self, mod: _Module, passes: int) -> None:
        """``passes`` pad passes: each unit gathered and released at once, in forward order."""
        for _ in range(passes):
            for unit in mod.forward_order:
                self._materialize(mod, unit)
                self._release(mod, unit)

    def _chosen(self, decision: Union[Decision, Mapping[str, Any]]) -> Dict[str, Tuple[str, int]]:
        """module -> (its decision by name, passes), for every module of the manifest; checked
        before any module changes."""
        from ..worker import Decision  # The binding's types, loaded at first use (worker.py).

        entries = decision.modules if isinstance(decision, Decision) else decision
        where = f"({decision.step}, {decision.microbatch})" if isinstance(decision, Decision) else "the microbatch"
        chosen = {}
        for name in self._modules:
            d = entries.get(name)
            if d is None:
                raise InvalidArgument(f"the decision for {where} has no entry for module '{name}': register the "
                                      f"executor's manifest with the coordinator")
            chosen[name] = decision_of(name, d)
        return chosen

    def end_microbatch(self) -> None:
        """After the microbatch's backward: releases what ``root`` gathered (and any unit a failed
        forward left gathered). Local, no collective; ``replicate`` modules stay resident. Then
        raises FailedPrecondition when a ``padded`` module ran another number of calls than this
        rank planned, or its pad passes were never issued (the chain stopped at a module called
        less than planned): its all-gathers then did not match the group's."""
        wrong = self._chain.wrong()
        self._chain.begin({})
        for mod in self._modules.values():
            if not mod.replicated:
                for unit in mod.units:
                    self._release(mod, unit)
            mod.decision = None
        self._in_microbatch = False
        if wrong:
            raise FailedPrecondition(
                f"under `padded` this rank did not make the calls and pads it planned: {'; '.join(wrong)}. Its "
                f"all-gathers no longer matched the group's (another rank may wait in, or have paired with, a "
                f"different collective): stop the job, and give begin_microbatch the calls this rank makes (the plan "
                f"it reported), in the order the padded modules' chain needs (the Executor's documentation)")

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
