"""FSDP2 integration: carry out shardcoord decisions on a model sharded with ``fully_shard`` (DESIGN 10).

Needs torch >= 2.6 (``torch.distributed.fsdp.fully_shard``). Two phases, for frameworks that wrap
the model themselves (accelerate, Lightning, torchtitan-style ``parallelize_fn``: ``shardcoord.hf``,
``shardcoord.accelerate``, ``shardcoord.lightning`` and :func:`parallelize` call them for you)::

    towers = fsdp2.shard_towers(model, manifest, mesh=mesh)    # the towers' layer units, before the framework
    ...                                                         # the framework wraps the rest and the root
    ctl = fsdp2.attach(towers, model)                           # the control, on the root it made

or both at once for a loop that wraps the model itself, on every rank::

    from shardcoord import fsdp2
    manifest = shardcoord.torch.manifest(model)                 # controlled (frozen) modules
    ctl = fsdp2.shard(model, manifest, mesh=mesh)               # instead of your fully_shard calls
    ...
    for step, mb, batch, decision in plan_ahead:                # shardcoord.torch.PlanAhead
        ctl.begin_microbatch(decision, calls=plan_fn(batch))    # calls: this rank's plan (root releases early)
        loss = model(**batch).loss
        loss.backward()
        ctl.end_microbatch()

What each decision does, so that every rank of the shard group issues the same collectives
(why each mechanism is needed, and the 2-GPU check of each, are in docs/GPU.md):

- Every layer unit of a controlled module is its own FSDP unit with ``set_unshard_in_backward(False)``,
  left out of FSDP's record of the forward order: a frozen tower takes no part in backward, and
  without this FSDP's backward prefetch follows each rank's own forward order (ranks that skipped the
  tower would gather other units than ranks that ran it, the tower's or the unit before it).
- ``per_layer``: FSDP's own per-unit all-gather before each unit's forward (each unit prefetches
  the next one: measured 2 x H200, without it per_layer was 30 % slower than root), reshard after.
- ``skip``: nothing; no rank calls the module, so no rank gathers it.
- ``root``: every rank gathers every unit up front (``unshard()``, in manifest order) with
  reshard-after-forward off for the microbatch, so a unit's forward issues no all-gather whether or
  not this rank calls it. Releasing is local (``reshard()``, no collective), so each rank releases
  when it no longer needs the tower: with ``root_release="after_forward"`` (the default) and this
  rank's planned calls given to ``begin_microbatch(decision, calls)``, right after the rank's last
  planned call of the module (at once, unit by unit, when it plans none). A frozen tower takes no
  part in backward, so holding it gathered through the backward only raised the peak (by the whole
  tower, at the moment decoder activations peak: docs/FSDP2-NOTES.md, "Memory of the
  placements"). ``calls`` must be exactly (or more than) what the rank runs: a call after the
  release would all-gather on this rank alone, so it raises FailedPrecondition instead, and the
  other ranks then wait in their next collective until its timeout (or until shardcoord's failure
  watch stops them). Give the calls the rank reported (``PlanAhead``'s plan), not a second
  evaluation of a plan function that could differ; when unsure, leave ``calls`` out. Without ``calls``, with ``root_release="end_of_microbatch"``, or when
  the module's output needs grad (its backward would need the weights), ``end_microbatch`` reshards
  after the backward, as before.
- ``replicate``: a full copy that FSDP does not manage, made (one all-gather per parameter, same
  order on every rank) at the first replicate decision and kept while decisions stay replicate; the
  module's forward runs the copy, so its FSDP units issue nothing. Holding FSDP units unsharded
  instead hangs at the second microbatch (the end-of-backward callback reshards them).
- ``padded`` (``ModuleDecision.calls``, or ``("padded", K)`` in a mapping of decisions): ranks call
  the module unequally often, and every rank makes K all-gather passes over its layer units, K the
  most calls any rank makes. The rank's own c calls gather as under ``per_layer``; the other K - c
  are pad passes (``unshard()`` then ``reshard()`` of each layer unit in manifest order: gather
  only, no forward). ``begin_microbatch`` needs the rank's ``calls``. The peak stays one layer unit
  (``root`` holds the whole module). Several modules can be padded in one microbatch: their passes
  form a chain in manifest order, as in ``shardcoord.torch.Executor``. A forward pre-hook on the
  model, which runs after FSDP's own (FSDP2 registers its pre-forward hook with ``prepend=True``),
  so after the root unit's all-gather, as on a rank that runs the modules, issues the pads of the
  padded modules in manifest order up to the first one this rank calls (its pads included) and
  stops there; the end of this rank's last planned call of that module issues the pads from the
  next one on, up to the next it calls, and so on: every rank makes module A's K passes, then
  module B's. What it assumes: the padded modules are called inside the model's forward, in
  manifest order (order the manifest as the forward calls them), every call of one before the
  first call of the next, before any per_layer module's call and before any other FSDP
  unit gathers (a VLM's towers run before its decoder); a forward gathers a module's layer units
  in manifest order (its layer list's); the rank runs exactly the calls it planned. Checked before
  a call gathers (FailedPrecondition naming both modules): a padded module called while an
  earlier padded module still has planned calls left, a per_layer module called while a padded
  module still has, a controlled module called before the model's forward started, a call
  beyond the plan;
  ``end_microbatch`` raises for fewer calls or pads never issued (after the fact: by then the
  group's all-gathers no longer matched; treat it as fatal).

- A controlled module's rest unit ("" beside layer units in the manifest: the parameters outside its
  layer lists, such as patch embeddings, norms, mergers and pooling heads) is not wrapped on its own:
  its parameters stay in the root unit, which every rank gathers in every forward, so it issues the
  same collectives under every decision; the layers, the bulk of a tower, are the per-layer units.
  (Wrapping the module itself, FSDP2's usual way of taking "the rest", was tried on the GPU machine
  with transformers 5.17: ``fully_shard`` swaps the module's class, which hid a CLIP tower's
  ``hidden_states`` from transformers' output recording (LLaVA's forward then fails), and the
  module's own FSDP hooks would fire only on the ranks that call it. docs/GPU.md.)

A controlled module without a layer list (one unit, "" in the manifest) is not wrapped on its own:
it stays in the root unit, which every rank gathers in every forward - safe under every decision.

Towers that train (``ModuleSpec.trainable``: ``manifest(model, trainable=...)``, or ``trainable=`` in
the integrations' options; the whole tower trainable, or LoRA adapters on a frozen one). Their
backward issues collectives too, so the coordinator decides them ``skip``, ``per_layer`` or ``root``
only (``padded`` and ``replicate`` are refused here, should an older coordinator send them); the
rule is that every rank of the group issues the same all-gathers and reduce-scatters in forward
and backward (DESIGN 10, "Towers that train"):

- the layer units are unsharded in backward (the weights are needed there) and are recorded in
  FSDP's forward order, for its backward prefetch, only under ``per_layer``;
- ``per_layer``: every rank makes the same calls, so FSDP's own collectives match: a backward
  all-gather and a reduce-scatter per unit and call;
- ``root``: the units are gathered before the forward (as for a frozen tower) and kept through the
  backward, which then gathers nothing; their gradients are accumulated, not reduced, during the
  backward (FSDP would reduce-scatter after each call, in each rank's own order, or not at all on a
  rank that did not call the tower), and ``end_microbatch`` reduce-scatters each unit once, in
  manifest order, on every rank, zeros where the rank did not run it;
- ``skip``: nothing runs; gradients accumulated earlier (without sync) are not reduced by FSDP's
  end-of-backward callback on the ranks that hold them, but by ``end_microbatch`` on every rank;
- gradient accumulation: the framework's ``set_requires_gradient_sync(False)`` (accelerate's
  ``no_sync``) is honoured: ``end_microbatch`` reduces when the units sync, and then every unit some
  rank may hold gradients of since the last reduction (a ``root`` microbatch, or ``per_layer`` ones
  without sync), once. All of it follows from the decisions, which are the same on every rank.

This reaches into FSDP2's parameter groups (``post_backward``, ``reduce_grads``, the unsharded
gradients; not public API, checked with torch 2.11): where a torch lacks them, ``shard`` refuses a
trainable module, naming what is missing.

Trainable parameters that only media batches use (LLaVA-NeXT's ``image_newline``, a trainable
projector kept in the root unit) get a gradient on the ranks whose microbatch had media and none on
the others. FSDP2 reduce-scatters only the parameters that have a gradient, so under ``root`` or
``replicate`` (media on some ranks only) the ranks would reduce-scatter different sizes: a
collective mismatch (seen on the GPU machine: Gloo's "Received data size doesn't match expected
size", a hang on NCCL). ``shard(..., fill_missing_grads=True)`` (the default) gives every trainable
parameter of each FSDP unit that was gathered for the backward a zero gradient where autograd gave
none, just before FSDP reduces the unit: every rank then reduces the same parameters, and the mean
gradient is the one DDP's ``find_unused_parameters`` would give (a rank that did not use a parameter
contributes zero). This reaches into FSDP2's parameter groups (not public API; checked with torch
2.11): where a torch lacks them, ``shard`` warns and goes on without it.
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import TYPE_CHECKING, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from .errors import FailedPrecondition, InvalidArgument
# Whether a module's output takes part in backward; one module's entry of a decision; padded's plan.
from .torch._placement import PadChain, decision_of, padded_plan, requires_grad

if TYPE_CHECKING:  # pragma: no cover - the binding's types, looked up on first use (worker.py)
    from .integration import Session
    from .worker import Decision, ModuleSpec

try:
    from torch.distributed.fsdp import FSDPModule, fully_shard  # torch >= 2.6
except Exception:  # pragma: no cover - ImportError before 2.6; torch 1.13 on Python 3.11 fails in dataclasses
    FSDPModule = fully_shard = None


def available() -> bool:
    """True when this torch has FSDP2's public API (torch >= 2.6)."""
    return fully_shard is not None


#: How a ``root`` decision releases the gathered module (see the module's documentation).
ROOT_RELEASES = ("after_forward", "end_of_microbatch")


class _Controlled:
    """One controlled module with a layer list: its FSDP units and its replica."""

    def __init__(self, name: str, module: nn.Module, units: List[nn.Module], has_rest: bool,
                 trainable: bool = False):
        self.name = name
        self.module = module
        self.units = units
        self.has_rest = has_rest  # Parameters outside the layer units, in the root unit.
        self.trainable = trainable  # Some parameters train: its backward issues collectives too.
        self.groups: list = []  # Trainable: the units' FSDP parameter groups, in manifest order.
        self.active = False  # Inside begin_microbatch ... end_microbatch.
        self.dirty = False  # Trainable: some rank may hold gradients of it not reduce-scattered yet.
        self.reducing = False  # Trainable: reduce_pending() is reducing (the groups reduce as FSDP would).
        self.rest_owner: Optional[nn.Module] = None  # The FSDP unit holding them (attach() finds it).
        self.template = copy.deepcopy(module).to("meta")  # Structure for the replica; no memory.
        self.replica: Optional[nn.Module] = None
        self.decision = "skip"
        self.root_gathered = False  # Root: units gathered, reshard-after-forward off.
        self.planned: Optional[int] = None  # Root, released early: this rank's planned calls.
        self.calls_done = 0  # Calls of the module in this microbatch.
        self.released = False  # Root: released after the last planned call; a further call would hang.
        self.chain: Optional[PadChain] = None  # The control's pad chain (set by Fsdp2Control).

    def pad(self, passes: int) -> None:
        """Padded: ``passes`` pad passes, each an ``unshard()`` and ``reshard()`` of every layer
        unit in manifest order (an all-gather per unit, then local)."""
        for _ in range(passes):
            for unit in self.units:
                unit.unshard()
                unit.reshard()  # Local: no collective.

    def gather_root(self, planned: Optional[int]) -> None:
        """Root: gathers every unit (same order on every rank). With ``planned`` (this rank's
        planned calls; None: keep until end_microbatch) 0, each unit is released right after its
        gather: the rank issues the group's collectives and holds at most one unit."""
        self.planned, self.calls_done = planned, 0
        for unit in self.units:
            unit.set_reshard_after_forward(False, recurse=False)
        if planned == 0:
            for unit in self.units:
                unit.unshard()
                unit.reshard()  # Local: no collective.
            self._restore()
            self.released = True
            return
        for unit in self.units:
            unit.unshard()
        self.root_gathered = True

    def release_root(self) -> None:
        """Reshards every unit root gathered (local, no collective)."""
        if self.root_gathered:
            for unit in self.units:
                unit.reshard()
            self._restore()
            self.root_gathered = False

    def _restore(self) -> None:
        for unit in self.units:
            unit.set_reshard_after_forward(True, recurse=False)

    def before_call(self) -> None:
        """A call of the module starts (whatever its decision): refused, before it gathers, when it
        would not pair with the other ranks' all-gathers."""
        if self.chain is not None and self.chain.waiting:
            raise FailedPrecondition(
                f"fsdp2: '{self.name}' is called before the model's forward started while modules are decided "
                f"`padded`: their pad passes are issued in the model's forward pre-hook, after FSDP's root "
                f"all-gather, so a call outside the model's forward gathers out of order; call it inside the model's "
                f"forward")
        if self.chain is not None:
            self.chain.before_call(self.name, self.decision)
        if self.decision == "root" and self.released:
            raise FailedPrecondition(
                f"fsdp2: '{self.name}' is called under `root` after this rank's {self.planned} planned "
                f"call(s) of the microbatch, and root released its gathered units after the last one: running it now "
                f"would all-gather on this rank only (a hang). Pass the calls this rank makes (the plan reported "
                f"for the microbatch) to begin_microbatch, or shard(..., root_release='end_of_microbatch')")

    def after_call(self, output) -> None:
        """Padded: after this rank's last planned call, the pad chain goes on (the next padded
        modules' pads). Root, released early: after the last planned call, release (unless
        backward needs it)."""
        if self.chain is not None:
            self.chain.after_call(self.name)
        if self.decision != "root" or self.planned is None or not self.root_gathered:
            return
        self.calls_done += 1
        if self.calls_done < self.planned:
            return
        if torch.is_grad_enabled() and requires_grad(output):
            if self.trainable:  # Its backward needs the gathered weights: kept until end_microbatch.
                self.planned = None
                return
            _warn_once(f"shardcoord.fsdp2: the output of '{self.name}' requires grad, so its backward needs the "
                       f"gathered weights: root keeps them until end_microbatch (run a frozen module under "
                       f"torch.no_grad(), with inputs that need no grad, to release it after its forward)")
            self.planned = None
            return
        self.release_root()
        self.released = True

    def end(self) -> None:
        """Releases what root holds."""
        self.release_root()
        self.planned, self.calls_done, self.released = None, 0, False
        self.active = False

    def defer_reduce(self, unit: nn.Module) -> None:
        """Trainable: the unit's gradients are reduce-scattered as FSDP does it (after each call's
        backward) only under ``per_layer``, where every rank makes the same calls. Under ``root`` and
        ``skip`` they are accumulated instead, and :meth:`settle` reduce-scatters them at the end of
        the microbatch, on every rank alike (see the module's documentation)."""
        group = _param_group(unit)
        needed = ("post_backward", "reduce_grads", "reshard_after_backward", "fsdp_params", "finalize_backward",
                  "comm_ctx", "_training_state", "_record_post_forward")
        if group is None or not all(hasattr(group, a) for a in needed):
            raise FailedPrecondition(
                f"fsdp2: trainable module '{self.name}': this torch {torch.__version__} has FSDP2 parameter groups "
                f"without {', '.join(needed)}, which shardcoord uses to give every rank the same reduce-scatters "
                f"(checked with torch 2.11); freeze the module, or leave it out of trainable=")
        original, record = group.post_backward, group._record_post_forward

        def post_backward(*args, _group=group):
            if self.reducing or not self.active or self.decision == "per_layer":
                return original(*args)
            saved = _group.reduce_grads, _group.reshard_after_backward
            _group.reduce_grads = False  # Accumulate; settle() reduces on every rank alike.
            _group.reshard_after_backward = saved[1] and not self.root_gathered  # Root: held to the end.
            try:
                return original(*args)
            finally:
                _group.reduce_grads, _group.reshard_after_backward = saved

        group.post_backward = post_backward
        # Backward prefetch follows the recorded forward order: recorded only where every rank ran
        # the same calls (per_layer); under root the units are gathered already.
        group._record_post_forward = lambda: record() if self.active and self.decision == "per_layer" else None
        self.groups.append(group)

    def settle(self) -> None:
        """Trainable, after the microbatch's backward: when the framework syncs gradients in it (the
        units' ``reduce_grads``, as ``set_requires_gradient_sync`` left it) and some rank may hold
        gradients not yet reduced (a ``root`` microbatch, or ``per_layer`` ones accumulated without
        sync), one reduce-scatter per unit, in manifest order, on every rank; a rank that did not run
        a unit contributes zeros. The same decisions on every rank give the same calls here."""
        if not self.trainable or not self.groups:
            return
        syncing = bool(self.groups[0].reduce_grads)
        if self.decision == "per_layer":
            self.dirty = not syncing  # Syncing: FSDP reduced every unit after its backward, on every rank.
        elif self.decision == "root":
            self.dirty = True
        if syncing and self.dirty:
            self.reduce_pending()
            self.dirty = False

    def reduce_pending(self) -> None:
        """One reduce-scatter of each unit's accumulated gradients (zeros where this rank has none)."""
        for group in self.groups:
            _zero_missing_grads(group)
            saved = group.reduce_grads, group.reshard_after_backward
            group.reduce_grads, group.reshard_after_backward = True, True
            self.reducing = True
            try:
                group.post_backward()
            finally:
                self.reducing = False
                group.reduce_grads, group.reshard_after_backward = saved
                group._training_state = type(group._training_state).IDLE
            group.finalize_backward()  # The optimizer's stream waits for the reduced gradients.
        state = self.groups[-1].comm_ctx.reduce_scatter_state if self.groups else None
        if state is not None:
            if state.event is not None:
                self.groups[-1].device_handle.current_stream().wait_event(state.event)
            self.groups[-1].comm_ctx.reduce_scatter_state = None


class Fsdp2Control:
    """Returned by :func:`shard`. Not thread-safe: call from the training loop.

    ``root_release`` (one of :data:`ROOT_RELEASES`, settable between microbatches): when a ``root``
    decision releases the gathered module; see the module's documentation."""

    def __init__(self, controlled: Dict[str, _Controlled], left_in_root: List[str], root: nn.Module,
                 root_release: str = "after_forward"):
        self._root = root  # The model: its root unit holds the rest units' parameters.
        self._controlled = controlled
        self.left_in_root = left_in_root  # Controlled modules without a layer list.
        self._in_microbatch = False
        self.root_release = root_release
        # Padded modules' passes, in manifest order, from the model's forward pre-hook on.
        self._chain = PadChain(list(controlled), lambda name, passes: controlled[name].pad(passes), who="fsdp2: ",
                                unstarted="the model's forward never ran")
        for c in controlled.values():
            c.chain = self._chain

    @property
    def root_release(self) -> str:
        return self._root_release

    @root_release.setter
    def root_release(self, value: str) -> None:
        if value not in ROOT_RELEASES:
            raise InvalidArgument(f"root_release must be one of {', '.join(ROOT_RELEASES)}, got {value!r}")
        if getattr(self, "_in_microbatch", False):
            raise FailedPrecondition("root_release changed inside a microbatch; change it between microbatches")
        self._root_release = value

    def begin_microbatch(self, decision: Union[Decision, Mapping[str, object]],
                         calls: Optional[Mapping[str, int]] = None) -> None:
        """Applies the group's decision before the microbatch's forward. Identical on every rank.

        ``decision``: the group's Decision, or a mapping module -> decision name, ``("padded", K)``
        or ModuleDecision. ``calls``: how often this rank will call each controlled module in the
        microbatch (the plan it reported); under ``root`` the module is released right after the
        last of them (module absent from ``calls``: at ``end_microbatch``); required for the
        modules decided ``padded`` (the rank pads the group's K passes up from them)."""
        if self._in_microbatch:
            raise FailedPrecondition("begin_microbatch called twice; call end_microbatch after each backward")
        chosen = self._chosen(decision)
        planned = self._planned(calls)
        padded = padded_plan(chosen, planned if calls is not None else None)
        unsafe = [f"'{name}' ({chosen[name][0]})" for name, c in self._controlled.items()
                  if c.trainable and chosen[name][0] in ("padded", "replicate")]
        if unsafe:
            raise FailedPrecondition(
                f"fsdp2: trainable module(s) {', '.join(unsafe)} decided padded or replicate: their backward would "
                f"issue other collectives on the ranks that call them less (a hang), so a coordinator decides a "
                f"trainable module skip, per_layer or root only. This one predates trainable modules (its wire "
                f"drops ModuleSpec.trainable): run the shardcoordd of this package's version")
        for name, c in self._controlled.items():
            c.active = True
            c.decision = chosen[name][0]
            if c.decision != "replicate" and c.replica is not None:
                c.replica = None  # Back to sharded: free the copy.
            if c.decision == "root":
                c.gather_root(planned.get(name) if self._root_release == "after_forward" else None)
            elif c.decision == "replicate" and c.replica is None:
                c.replica = _materialize(c, self._root)
        self._chain.begin({name: (chosen[name][1], n) for name, n in padded.items() if name in self._controlled})
        self._in_microbatch = True

    def _before_model_forward(self, _module: nn.Module, _args) -> None:
        """The model's forward pre-hook, after FSDP's (the root unit is gathered): the pad chain
        starts (the pads up to the first padded module this rank calls)."""
        if self._in_microbatch:
            self._chain.start()

    def _chosen(self, decision: Union[Decision, Mapping[str, object]]) -> Dict[str, Tuple[str, int]]:
        """module -> (decision, passes) for every controlled module, checked before any module changes."""
        entries = getattr(decision, "modules", decision)
        chosen = {}
        for name in self._controlled:
            md = entries.get(name)
            if md is None:
                raise InvalidArgument(f"the decision names no module '{name}'; the manifest registered with the "
                                      f"coordinator must be the one given to fsdp2.shard")
            chosen[name] = decision_of(name, md)
        return chosen

    def _planned(self, calls: Optional[Mapping[str, int]]) -> Dict[str, int]:
        if calls is None:
            return {}
        planned = {}
        for name, n in calls.items():
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise InvalidArgument(f"calls['{name}'] must be a non-negative int (this rank's planned calls), "
                                      f"got {n!r}")
            if name in self._controlled:
                planned[name] = n
        return planned

    def end_microbatch(self) -> None:
        """After the microbatch's backward: releases what ``root`` still holds (local, no collective).
        Then raises FailedPrecondition when, under ``padded``, this rank's all-gathers did not match
        the group's (it ran other calls than it planned, or pads were never issued: the model's
        forward never ran, or the chain stopped at a module called less than planned)."""
        wrong = self._chain.wrong()
        self._chain.begin({})
        try:
            for c in self._controlled.values():  # Manifest order: the same reduce-scatters on every rank.
                c.settle()
        finally:
            for c in self._controlled.values():
                c.end()
        self._in_microbatch = False
        if wrong:
            raise FailedPrecondition(
                f"fsdp2: under `padded` this rank's all-gathers differed from the group's: {'; '.join(wrong)}. "
                f"Another rank may wait in, or have paired with, a different collective: stop the job, and give "
                f"begin_microbatch the calls this rank makes (the plan it reported), inside a forward of the model")

    def gathered(self, module: str) -> bool:
        """Whether ``root`` holds ``module``'s units gathered now (False once released)."""
        return self._controlled[module].root_gathered

    def held_outside_bytes(self) -> int:
        """Bytes of the replicas this control holds outside the model now (for
        ``shardcoord.torch.CostMeter(held_outside=...)``: a measured room must count them)."""
        return sum(p.numel() * p.element_size() for c in self._controlled.values() if c.replica is not None
                   for p in c.replica.parameters())

    def release(self) -> None:
        """Frees every replica (outside a microbatch; local, no collective). The next ``replicate``
        decision gathers the module again."""
        if self._in_microbatch:
            raise FailedPrecondition("release() inside a microbatch; call end_microbatch first")
        for c in self._controlled.values():
            c.replica = None
            c.decision = "skip"


_warned: set = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _materialize(c: _Controlled, root: nn.Module) -> nn.Module:
    """A full, unsharded copy of the module, gathered with FSDP's own ``unshard()`` (the calls
    ``root`` makes, in manifest order on every rank) one unit at a time: each layer unit is
    gathered, copied into the replica and resharded before the next, then, when the module has a
    rest unit, the root unit that holds those parameters. Peak: the replica plus one unit.

    (Gathering parameter by parameter with ``DTensor.full_tensor()``, as at first, hung at the
    first ``replicate`` of a real Gemma 3 model at two Gloo ranks; gathering every unit before
    copying, as next, held the tower twice: 2502 MiB for a 1252 MiB Qwen2.5-VL tower. docs/GPU.md.)"""
    where = {id(m): name for name, m in c.module.named_modules()}
    replica: Optional[nn.Module] = None
    copied = set()

    def copy_from(module: nn.Module, prefix: str) -> None:
        nonlocal replica
        for pname, p in module.named_parameters():
            full_name = prefix + pname
            if full_name in copied or hasattr(p, "full_tensor"):  # Another unit's, still sharded.
                continue
            if replica is None:
                replica = copy.deepcopy(c.template).to_empty(device=p.device)
            with torch.no_grad():
                replica.get_parameter(full_name).copy_(p)
            copied.add(full_name)

    for unit in c.units:  # Same order on every rank.
        unit.unshard()
        copy_from(unit, where[id(unit)] + ".")
        unit.reshard()  # Local: no collective.
    if c.has_rest:
        owner = c.rest_owner if c.rest_owner is not None else root
        owner.unshard()
        copy_from(c.module, "")
        owner.reshard()
    assert replica is not None
    missing = [n for n, _ in replica.named_parameters() if n not in copied]
    if missing:
        raise FailedPrecondition(f"fsdp2: the replica of '{c.name}' lacks {len(missing)} parameters after gathering "
                                 f"its units ({', '.join(missing[:5])}): were they wrapped by another fully_shard? "
                                 f"Leave controlled modules' submodules to fsdp2.shard")
    with torch.no_grad():
        for pname, p in replica.named_parameters():
            p.requires_grad_(False)
        for bname, b in c.module.named_buffers():
            replica.get_buffer(bname).copy_(b)
    return replica


def _units_of(module: nn.Module, spec: ModuleSpec) -> List[nn.Module]:
    """The layer unit modules, in manifest order; the rest unit "" stays in the root unit."""
    return [module.get_submodule(u.name) for u in spec.units if u.name]


def _is_fsdp(module: nn.Module) -> bool:
    """Whether ``fully_shard`` made ``module`` an FSDP unit (a seam: the tests' stand-in has no class)."""
    return FSDPModule is not None and isinstance(module, FSDPModule)


class Towers:
    """Phase one of two (:func:`shard_towers`): the controlled modules' layer units are FSDP units of
    their own; the rest of the model is the framework's to wrap. :func:`attach` then takes the root
    the framework made. ``modules``: the controlled modules sharded per layer; ``left_in_root``: those
    without a layer list (they stay in whatever unit holds them: safe under every decision)."""

    def __init__(self, model: nn.Module, controlled: Dict[str, "_Controlled"], left_in_root: List[str], mesh):
        self.model = model
        self.controlled = controlled
        self.left_in_root = left_in_root
        self.mesh = mesh
        self.control: Optional[Fsdp2Control] = None  # Set by attach().

    @property
    def modules(self) -> List[str]:
        return list(self.controlled)

    def __repr__(self) -> str:
        units = ", ".join(f"{name}: {len(c.units)} layer units" for name, c in self.controlled.items())
        return f"Towers({units or 'none'}; left in their parent's unit: {self.left_in_root or 'none'})"


def _keep_out_of_backward_order(unit: nn.Module) -> None:
    """FSDP2 records every unit's forward (``FSDPParamGroup._record_post_forward``) and in backward
    each unit prefetches the one recorded before it. A tower's units are recorded only on the ranks
    that ran the tower, so the prefetch targets differed between ranks: on the GPU machine, with
    accelerate making the input embeddings a unit of their own, the ranks without images prefetched
    the embeddings at the first decoder layer's backward and the others at the embeddings' own, and
    the all-gathers and reduce-scatters crossed (both ranks hung). A frozen tower takes no part in
    backward, so its units are left out of the record on every rank."""
    state = getattr(unit, "_get_fsdp_state", None)
    group = getattr(state(), "_fsdp_param_group", None) if state is not None else None
    if group is None or not hasattr(group, "_record_post_forward"):
        _warn_once("shardcoord.fsdp2: this torch's FSDP2 has no FSDPParamGroup._record_post_forward, so a tower's "
                   "units stay in the backward prefetch order; ranks that skip the tower may then prefetch other "
                   "units than ranks that ran it (a hang with units before the tower, such as accelerate's input "
                   "embeddings)")
        return
    group._record_post_forward = lambda: None


def shard_towers(model: nn.Module, manifest: Iterable[ModuleSpec], mesh=None, **fully_shard_kwargs) -> Towers:
    """Phase one: applies ``fully_shard`` to each layer unit of every controlled module, on ``mesh``
    (the framework's FSDP mesh: 1-D, or 2-D ``(dp_replicate, dp_shard)`` for HSDP), and nothing
    else. Call it before the framework wraps the rest (accelerate's ``prepare``, Lightning's
    ``configure_model``, a torchtitan ``parallelize_fn``): frameworks skip modules that already are
    FSDP units. Then :func:`attach` the root the framework made. ``fully_shard_kwargs`` (``mp_policy``,
    ``offload_policy``, ...) should be the framework's, so the towers' units match the others;
    ``reshard_after_forward`` is forced on for them (see :func:`shard`)."""
    if fully_shard is None:
        raise FailedPrecondition(f"FSDP2 needs torch >= 2.6 (torch.distributed.fsdp.fully_shard); this is torch "
                                 f"{torch.__version__}: use shardcoord.torch.Executor instead")
    controlled: Dict[str, _Controlled] = {}
    left_in_root: List[str] = []
    kwargs = dict(fully_shard_kwargs)
    if mesh is not None:
        kwargs["mesh"] = mesh
    kwargs["reshard_after_forward"] = True
    for spec in manifest:
        module = model.get_submodule(spec.name)
        if _is_fsdp(module) or any(_is_fsdp(m) for m in module.modules()):
            raise FailedPrecondition(
                f"fsdp2: controlled module '{spec.name}' already holds FSDP units ("
                f"{', '.join(n or '<itself>' for n, m in module.named_modules() if _is_fsdp(m))}): shard the towers "
                f"before anything else wraps them (call shard_towers before the framework's prepare / fully_shard)")
        units = _units_of(module, spec)
        if not units:
            left_in_root.append(spec.name)
            continue
        c = _Controlled(spec.name, module, units, any(u.name == "" for u in spec.units),
                        bool(getattr(spec, "trainable", False)))
        for unit in units:
            # A controlled unit reshards after each forward whatever the caller asked for the
            # others: per_layer and padded count one all-gather per unit per call (a unit kept
            # gathered, or resharded to a smaller mesh, would issue fewer or other ones on the
            # ranks that call more, where padded's passes gather every time); root and
            # replicate set their own behaviour per microbatch.
            fully_shard(unit, **kwargs)
            if c.trainable:
                c.defer_reduce(unit)
            else:
                unit.set_unshard_in_backward(False)
                _keep_out_of_backward_order(unit)
        for unit, following in zip(units, units[1:]):
            # per_layer: gather the next unit while this one computes (FSDP2 prefetches only in
            # backward by default, and a frozen tower has no backward): every rank runs the
            # units in the same order, so the prefetches are the same on every rank. Under root
            # the units are already gathered (a no-op); skip and replicate run no unit.
            unit.set_modules_to_forward_prefetch([following])
        _route_forward(c)
        controlled[spec.name] = c
    return Towers(model, controlled, left_in_root, mesh)


def _owner_of_rest(c: "_Controlled", root: nn.Module, modules: Dict[int, str]) -> nn.Module:
    """The FSDP unit that holds a controlled module's rest unit: its nearest ancestor that is one
    (the root, or a unit the framework made around the tower's parent). Every rank gathers it
    whenever the forward reaches the tower's caller, so the rest issues the same collectives under
    every decision."""
    path = modules[id(c.module)]
    parts = path.split(".")
    for i in range(len(parts) - 1, -1, -1):
        candidate = root.get_submodule(".".join(parts[:i])) if i else root
        if _is_fsdp(candidate):
            return candidate
    raise FailedPrecondition(f"fsdp2: no FSDP unit holds the rest of '{c.name}' (its parameters outside the layer "
                             f"lists): wrap the model's root with fully_shard before attach()")


def _outermost_unit(model: nn.Module, towers: Towers) -> Optional[nn.Module]:
    """The shallowest FSDP unit inside ``model`` that holds every controlled module (a
    LightningModule's ``self.model``, a wrapper's inner model), or None."""
    held = [id(c.module) for c in towers.controlled.values()]
    for _, module in sorted(model.named_modules(), key=lambda item: item[0].count(".") + bool(item[0])):
        if _is_fsdp(module):
            inside = {id(m) for m in module.modules()}
            if all(h in inside for h in held):
                return module
    return None


def attach(towers: Towers, root: Optional[nn.Module] = None, fill_missing_grads: bool = True,
           root_release: str = "after_forward") -> Fsdp2Control:
    """Phase two: once the framework wrapped the rest of the model (its root an FSDP unit), returns
    the control that carries out decisions (:class:`Fsdp2Control`). ``root``: the model the
    framework returned (default: the one given to :func:`shard_towers`; ``fully_shard`` wraps in
    place). Checks that no other FSDP unit sits inside a controlled module (an auto-wrap policy that
    matched a tower's submodule: its all-gather would run on the ranks that call the tower only)
    and that the towers' units are still the ones :func:`shard_towers` made.
    ``fill_missing_grads``, ``root_release``: see :func:`shard`."""
    if root_release not in ROOT_RELEASES:
        raise InvalidArgument(f"root_release must be one of {', '.join(ROOT_RELEASES)}, got {root_release!r}")
    root = towers.model if root is None else getattr(root, "_orig_mod", root)  # torch.compile keeps the module
    if towers.control is not None:
        if towers.control._root is not root:
            raise FailedPrecondition("fsdp2: these towers are attached to another root already")
        return towers.control
    if not _is_fsdp(root):
        root = _outermost_unit(root, towers) or root
    if not _is_fsdp(root):
        raise FailedPrecondition(
            f"fsdp2: attach() needs the model's root wrapped by fully_shard (a {type(root).__name__} is not an FSDP "
            f"unit): let the framework wrap the model (accelerate's prepare with fsdp_version 2, Lightning's "
            f"configure_model, your parallelize_fn), or call fully_shard(model) first")
    modules = {id(m): n for n, m in root.named_modules()}
    for name, c in towers.controlled.items():
        if id(c.module) not in modules:
            raise FailedPrecondition(f"fsdp2: controlled module '{name}' is not in the root given to attach()")
        ours = {id(u) for u in c.units}
        foreign = [n or "<itself>" for n, m in c.module.named_modules() if _is_fsdp(m) and id(m) not in ours]
        if foreign:
            raise FailedPrecondition(
                f"fsdp2: the framework made FSDP units inside controlled module '{name}' besides its layer units: "
                f"{', '.join(foreign[:8])}. Their all-gathers would run only on the ranks that call '{name}' (a hang "
                f"when ranks differ): keep them out of the auto-wrap policy (accelerate: transformer_cls_names_to_wrap "
                f"without their classes; Lightning / torchtitan: do not fully_shard inside '{name}')")
        c.rest_owner = _owner_of_rest(c, root, modules) if c.has_rest else None
    if fill_missing_grads:
        _fill_missing_grads(root)
    if any(c.trainable for c in towers.controlled.values()):
        _inputs_need_grad(root)
    ctl = Fsdp2Control(towers.controlled, towers.left_in_root, root, root_release)
    # Padded's pad passes: registered after fully_shard, so it runs after FSDP's own pre-forward
    # hook (registered with prepend=True), once the root unit is gathered, as on a calling rank.
    root.register_forward_pre_hook(ctl._before_model_forward)
    towers.control = ctl
    return ctl


def shard(model: nn.Module, manifest: Iterable[ModuleSpec], mesh=None, fill_missing_grads: bool = True,
          root_release: str = "after_forward", **fully_shard_kwargs) -> Fsdp2Control:
    """Both phases in one call, for a loop that wraps the model itself: :func:`shard_towers`, then
    ``fully_shard(model)`` (the root unit), then :func:`attach`. Other submodules you want as
    separate units: ``fully_shard`` them yourself before calling this (not inside controlled
    modules). ``fill_missing_grads``: see the module's documentation (trainable parameters only
    media batches use). ``root_release``: when a ``root`` decision releases the gathered module,
    ``"after_forward"`` (after this rank's last planned call, when ``begin_microbatch`` is given the
    calls) or ``"end_of_microbatch"`` (after the backward)."""
    if root_release not in ROOT_RELEASES:
        raise InvalidArgument(f"root_release must be one of {', '.join(ROOT_RELEASES)}, got {root_release!r}")
    towers = shard_towers(model, manifest, mesh, **fully_shard_kwargs)
    kwargs = dict(fully_shard_kwargs)
    if mesh is not None:
        kwargs["mesh"] = mesh
    fully_shard(model, **kwargs)
    return attach(towers, model, fill_missing_grads, root_release)


def mesh_shard_ranks(mesh=None) -> List[int]:
    """The global ranks this rank shards parameters with on ``mesh`` (None: the world): a 1-D mesh's
    ranks, or the row of a 2-D ``(dp_replicate, dp_shard)`` mesh (HSDP) that holds this rank, the
    last dimension being the one FSDP shards over. That is the shard group shardcoord must decide
    for: ``Worker(group_size=len(mesh_shard_ranks(mesh)))``."""
    import torch.distributed as dist

    if mesh is None:
        return list(range(dist.get_world_size()))
    grid = mesh.mesh
    if grid.dim() == 1:
        return [int(r) for r in grid.tolist()]
    if grid.dim() != 2:
        raise InvalidArgument(f"fsdp2: a {grid.dim()}-D mesh; FSDP takes a 1-D mesh or a 2-D (dp_replicate, "
                              f"dp_shard) one: pass the FSDP dimensions (mesh['dp_shard'] or mesh['dp_replicate', "
                              f"'dp_shard'])")
    me = dist.get_rank()
    for row in grid.tolist():
        if me in row:
            return [int(r) for r in row]
    raise InvalidArgument(f"fsdp2: rank {me} is not in the mesh {grid.tolist()}")


def check_shard_group(worker, mesh=None) -> None:
    """Raises InvalidArgument when the worker's shard group (contiguous blocks of ``group_size``
    ranks) is not the group FSDP shards over on ``mesh`` (:func:`mesh_shard_ranks`): decisions
    would then be made for ranks that do not all-gather together."""
    wanted = sorted(mesh_shard_ranks(mesh))
    have = sorted(int(r) for r in worker.group.ranks)
    if wanted != have:
        raise InvalidArgument(
            f"shardcoord's shard group of rank {worker.rank} is ranks {have} (group_size {len(have)}, contiguous "
            f"blocks), but FSDP shards this rank's parameters over ranks {wanted}: give the Worker "
            f"group_size={len(wanted)}, with the mesh laid out (dp_replicate, dp_shard) so that each shard group is "
            f"a contiguous block of ranks")


def _fill_missing_grads(model: nn.Module) -> None:
    """Before FSDP2 reduces a unit after backward, a zero gradient for each trainable parameter of
    the unit that autograd left without one (see the module's documentation). Only while the unit
    is gathered (it was used in this forward: the same on every rank, since every rank gathers
    the same units), so a unit no rank used stays silent."""
    groups = []
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if state is not None else None
        if group is None:
            continue
        if not (hasattr(group, "post_backward") and hasattr(group, "fsdp_params") and hasattr(group, "is_unsharded")):
            warnings.warn(f"shardcoord.fsdp2: this torch {torch.__version__} has FSDP2 parameter groups without "
                          f"post_backward/fsdp_params/is_unsharded, so fill_missing_grads is off: a trainable "
                          f"parameter only media batches use can hang backward under root or replicate "
                          f"(freeze it, or make every rank use it)", stacklevel=3)
            return
        groups.append(group)
    for group in groups:
        if not any(p.requires_grad for fp in group.fsdp_params for p in [fp.sharded_param]):
            continue  # Frozen unit (a tower's layers): FSDP reduces nothing for it.
        original = group.post_backward

        def post_backward(*args, _group=group, _original=original):
            if _group.is_unsharded:
                for fp in _group.fsdp_params:
                    param = getattr(fp, "_unsharded_param", None)
                    if (param is not None and param.requires_grad and param.grad is None
                            and getattr(fp, "unsharded_accumulated_grad", None) is None):
                        param.grad = torch.zeros_like(param)
            return _original(*args)

        group.post_backward = post_backward


def _inputs_need_grad(root: nn.Module) -> None:
    """With a trainable tower or projector, the decoder's input needs grad on the ranks whose batch had
    media (their features join the embeddings) and not on the others (frozen embeddings): FSDP2 then
    reduce-scatters the first decoder unit from its autograd hook on the first and from its
    end-of-backward callback on the others, where it comes after the root unit's reduce-scatter (a
    mismatch whenever the root unit holds trainable parameters, such as a projector). The input
    embeddings' output is made to need grad on every rank, as transformers' own
    ``enable_input_require_grads`` does for adapters with checkpointing (no parameter's gradient
    changes)."""
    embeddings = getattr(root, "get_input_embeddings", None)
    module = embeddings() if callable(embeddings) else None
    if not isinstance(module, nn.Module):
        _warn_once("shardcoord.fsdp2: a trainable tower, and the model has no get_input_embeddings(): where the "
                   "decoder's input needs grad on the ranks with media only, FSDP2 reduces its first unit at other "
                   "points on the ranks without (a hang when the root unit has trainable parameters)")
        return

    def need_grad(_module, _args, output):
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and not output.requires_grad:
            output.requires_grad_(True)

    module.register_forward_hook(need_grad)


def _param_group(unit: nn.Module):
    """The FSDP2 parameter group of a unit made by ``fully_shard`` (None: none, or another torch)."""
    state = getattr(unit, "_get_fsdp_state", None)
    return getattr(state(), "_fsdp_param_group", None) if state is not None else None


def _zero_missing_grads(group) -> None:
    """Before reduce_pending() reduces a unit: a zero gradient for each trainable parameter this rank
    has none for (it did not run the unit since the last reduce-scatter), in the dtype the others
    hold (FSDP2's reduce-scatter takes one dtype per unit), so every rank reduces the same tensors."""
    for fp in group.fsdp_params:
        param = getattr(fp, "_unsharded_param", None)
        if param is None or not param.requires_grad:
            continue
        fp.accumulate_unsharded_grad_if_needed()
        if param.grad is None and fp.unsharded_accumulated_grad is None:
            param.grad = torch.zeros_like(param)
    if any(getattr(fp, "unsharded_accumulated_grad", None) is not None for fp in group.fsdp_params):
        for fp in group.fsdp_params:
            if hasattr(fp, "_unsharded_param"):
                fp.to_accumulated_grad_if_needed()


def _route_forward(c: _Controlled) -> None:
    """Under ``replicate`` the module's forward runs the replica (its FSDP units stay idle); under
    ``root`` it counts this rank's calls, releases after the last planned one and refuses a call
    after that."""
    original = c.module.forward

    # functools.wraps keeps the signature visible (inspect.signature follows __wrapped__):
    # Hugging Face models read their towers' forward signature to pass arguments such as
    # output_hidden_states.
    @functools.wraps(original)
    def forward(*args, **kwargs):
        c.before_call()  # Under every decision: the padded modules' order is checked.
        if c.decision == "replicate" and c.replica is not None:
            return c.replica(*args, **kwargs)
        output = original(*args, **kwargs)
        c.after_call(output)  # Root: released after this rank's last planned call.
        return output

    c.module.forward = forward


def parallelize(model: nn.Module, mesh=None, options=None, *, per_step: int = 1, fully_shard_kwargs=None,
                **kwargs) -> "Session":
    """For a hand-written FSDP2 loop shaped like torchtitan's: call it first in your ``parallelize_fn``,
    before ``fully_shard`` of the decoder layers and the root, with the FSDP mesh (``world_mesh['dp_shard']``,
    or ``world_mesh['dp_replicate', 'dp_shard']`` for HSDP) and your ``fully_shard`` keyword arguments
    (``mp_policy``, ...). It connects this rank's worker (shard group: the mesh's shard dimension,
    checked) and shards the towers' layer units; returns the
    :class:`shardcoord.integration.Session`. After your ``fully_shard(model)``, ``session.attach(model)``;
    then per step (torchtitan's ``train_step`` fetches every microbatch first)::

        session.microbatches.plan(microbatches)
        for mb in microbatches:
            with session.microbatches.run(mb):
                loss = loss_fn(model(**mb)); loss.backward()

    ``options`` / ``kwargs``: :class:`shardcoord.integration.Options` (``plan_fn`` for a model that is
    not a supported HF family)."""
    from .integration import Options, Session

    session = Session(Options.of(options, **kwargs), who="shardcoord.fsdp2")
    session.shard_towers(model, mesh, fully_shard_kwargs, per_step)
    return session
