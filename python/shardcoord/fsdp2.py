"""FSDP2 integration: carry out shardcoord decisions on a model sharded with ``fully_shard`` (DESIGN 10).

Needs torch >= 2.6 (``torch.distributed.fsdp.fully_shard``). Usage, on every rank::

    from shardcoord import fsdp2
    manifest = shardcoord.torch.manifest(model)                 # controlled (frozen) modules
    ctl = fsdp2.shard(model, manifest, mesh=mesh)               # instead of your fully_shard calls
    ...
    for step, mb, batch, decision in plan_ahead:                # shardcoord.torch.PlanAhead
        ctl.begin_microbatch(decision)
        loss = model(**batch).loss
        loss.backward()
        ctl.end_microbatch()

What each decision does, so that every rank of the shard group issues the same collectives
(why each mechanism is needed, and the 2-GPU check of each, are in docs/GPU.md):

- Every layer unit of a controlled module is its own FSDP unit with ``set_unshard_in_backward(False)``:
  a frozen tower takes no part in backward, and without this FSDP's backward prefetch follows each
  rank's own forward order (ranks that skipped the tower would gather other units than ranks that
  ran it).
- ``per_layer``: FSDP's own per-unit all-gather before each unit's forward (each unit prefetches
  the next one: measured 2 x H200, without it per_layer was 30 % slower than root), reshard after.
- ``skip``: nothing; no rank calls the module, so no rank gathers it.
- ``root``: every rank gathers every unit up front (``unshard()``, in manifest order) with
  reshard-after-forward off for the microbatch, so a unit's forward issues no all-gather whether or
  not this rank calls it; ``end_microbatch`` reshards (local, no collective).
- ``replicate``: a full copy that FSDP does not manage, made (one all-gather per parameter, same
  order on every rank) at the first replicate decision and kept while decisions stay replicate; the
  module's forward runs the copy, so its FSDP units issue nothing. Holding FSDP units unsharded
  instead hangs at the second microbatch (the end-of-backward callback reshards them).

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
"""

import copy
import functools
from typing import Dict, Iterable, List, Optional

import torch
from torch import nn

from .errors import FailedPrecondition, InvalidArgument
from .worker import Decision, ModuleSpec

try:
    from torch.distributed.fsdp import fully_shard  # torch >= 2.6
except Exception:  # pragma: no cover - ImportError before 2.6; torch 1.13 on Python 3.11 fails in dataclasses
    fully_shard = None


def available() -> bool:
    """True when this torch has FSDP2's public API (torch >= 2.6)."""
    return fully_shard is not None


class _Controlled:
    """One controlled module with a layer list: its FSDP units and its replica."""

    def __init__(self, name: str, module: nn.Module, units: List[nn.Module], has_rest: bool):
        self.name = name
        self.module = module
        self.units = units
        self.has_rest = has_rest  # Parameters outside the layer units, in the root unit.
        self.template = copy.deepcopy(module).to("meta")  # Structure for the replica; no memory.
        self.replica: Optional[nn.Module] = None
        self.decision = "skip"
        self.root_gathered = False


class Fsdp2Control:
    """Returned by :func:`shard`. Not thread-safe: call from the training loop."""

    def __init__(self, controlled: Dict[str, _Controlled], left_in_root: List[str], root: nn.Module):
        self._root = root  # The model: its root unit holds the rest units' parameters.
        self._controlled = controlled
        self.left_in_root = left_in_root  # Controlled modules without a layer list.
        self._in_microbatch = False

    def begin_microbatch(self, decision: Decision) -> None:
        """Applies the group's decision before the microbatch's forward. Identical on every rank."""
        if self._in_microbatch:
            raise FailedPrecondition("begin_microbatch called twice; call end_microbatch after each backward")
        for name, c in self._controlled.items():
            md = decision.modules.get(name)
            if md is None:
                raise InvalidArgument(f"the decision names no module '{name}'; the manifest registered with the "
                                      f"coordinator must be the one given to fsdp2.shard")
            c.decision = md.decision
            if md.decision != "replicate" and c.replica is not None:
                c.replica = None  # Back to sharded: free the copy.
            if md.decision == "root":
                for unit in c.units:
                    unit.set_reshard_after_forward(False, recurse=False)
                for unit in c.units:  # Same order on every rank.
                    unit.unshard()
                c.root_gathered = True
            elif md.decision == "replicate" and c.replica is None:
                c.replica = _materialize(c, self._root)
        self._in_microbatch = True

    def end_microbatch(self) -> None:
        """After the microbatch's backward: releases what ``root`` gathered (local, no collective)."""
        for c in self._controlled.values():
            if c.root_gathered:
                for unit in c.units:
                    unit.reshard()
                    unit.set_reshard_after_forward(True, recurse=False)
                c.root_gathered = False
        self._in_microbatch = False

    def release(self) -> None:
        """Frees every replica (outside a microbatch; local, no collective). The next ``replicate``
        decision gathers the module again."""
        if self._in_microbatch:
            raise FailedPrecondition("release() inside a microbatch; call end_microbatch first")
        for c in self._controlled.values():
            c.replica = None
            c.decision = "skip"


def _materialize(c: _Controlled, root: nn.Module) -> nn.Module:
    """A full, unsharded copy of the module, gathered with FSDP's own ``unshard()`` (the calls
    ``root`` makes, in manifest order on every rank): each layer unit, then, when the module has
    a rest unit, the root unit that holds those parameters; each resharded once copied.

    (Gathering parameter by parameter with ``DTensor.full_tensor()``, as before, hung at the
    first ``replicate`` of a real Gemma 3 model at two Gloo ranks, where ``per_layer`` and ``root``
    had passed; not diagnosed further in that session. The unshard path is the one ``root``
    decisions use; it has not yet run on the GPU machine: docs/GPU.md.)"""
    gathered = list(c.units) + ([root] if c.has_rest else [])
    for unit in gathered:  # Same order on every rank.
        unit.unshard()
    replica = copy.deepcopy(c.template)
    device = None
    full = {}
    for pname, p in c.module.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        full[pname] = t
        device = t.device
    replica = replica.to_empty(device=device)
    with torch.no_grad():
        for pname, p in replica.named_parameters():
            p.copy_(full[pname])
            p.requires_grad_(False)
        for bname, b in c.module.named_buffers():
            replica.get_buffer(bname).copy_(b)
    del full
    for unit in gathered:  # Local: no collective.
        unit.reshard()
    return replica


def _units_of(module: nn.Module, spec: ModuleSpec) -> List[nn.Module]:
    """The layer unit modules, in manifest order; the rest unit "" stays in the root unit."""
    return [module.get_submodule(u.name) for u in spec.units if u.name]


def shard(model: nn.Module, manifest: Iterable[ModuleSpec], mesh=None, **fully_shard_kwargs) -> Fsdp2Control:
    """Applies ``fully_shard`` to each layer unit of every controlled module and then to ``model``
    (the root unit), and returns the controller that carries out decisions. Other submodules you
    want as separate units: ``fully_shard`` them yourself before calling this (not inside
    controlled modules)."""
    if fully_shard is None:
        raise FailedPrecondition(f"FSDP2 needs torch >= 2.6 (torch.distributed.fsdp.fully_shard); this is torch "
                                 f"{torch.__version__}: use shardcoord.torch.Executor instead")
    controlled: Dict[str, _Controlled] = {}
    left_in_root: List[str] = []
    kwargs = dict(fully_shard_kwargs)
    if mesh is not None:
        kwargs["mesh"] = mesh
    for spec in manifest:
        module = model.get_submodule(spec.name)
        units = _units_of(module, spec)
        if not units:
            left_in_root.append(spec.name)
            continue
        c = _Controlled(spec.name, module, units, any(u.name == "" for u in spec.units))
        for unit in units:
            fully_shard(unit, **kwargs)
            unit.set_unshard_in_backward(False)
        for unit, following in zip(units, units[1:]):
            # per_layer: gather the next unit while this one computes (FSDP2 prefetches only in
            # backward by default, and a frozen tower has no backward): every rank runs the
            # units in the same order, so the prefetches are the same on every rank. Under root
            # the units are already gathered (a no-op); skip and replicate run no unit.
            unit.set_modules_to_forward_prefetch([following])
        _route_forward(c)
        controlled[spec.name] = c
    fully_shard(model, **kwargs)
    return Fsdp2Control(controlled, left_in_root, model)


def _route_forward(c: _Controlled) -> None:
    """Under ``replicate`` the module's forward runs the replica (its FSDP units stay idle)."""
    original = c.module.forward

    # functools.wraps keeps the signature visible (inspect.signature follows __wrapped__):
    # Hugging Face models read their towers' forward signature to pass arguments such as
    # output_hidden_states.
    @functools.wraps(original)
    def forward(*args, **kwargs):
        if c.decision == "replicate" and c.replica is not None:
            return c.replica(*args, **kwargs)
        return original(*args, **kwargs)

    c.module.forward = forward
