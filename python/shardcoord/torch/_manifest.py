"""The manifest from a ``torch.nn.Module``: its controlled towers and projectors (fully frozen ones,
and the trainable ones the user opts in), by the contract's classifier, each with its units (the entries of its layer lists, and the rest
unit "" for every parameter outside them). The executor takes a module's units apart the same way
(_UnitParams, _rest_of)."""

from __future__ import annotations

import collections
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from .. import classify
from ..errors import InvalidArgument

if TYPE_CHECKING:  # pragma: no cover
    import torch as _torch_t

    from ..worker import ModuleSpec

# Where a tower keeps its layers: ModuleLists with one of these names, anywhere in the module and
# not inside another such list (Qwen-VL `blocks`; Whisper / Gemma `layers`; CLIP / SigLIP
# `encoder.layers`; ViT / InternViT `encoder.layer`; Mllama's vision model has two,
# `transformer.layers` and `global_transformer.layers`). Parameters outside them (patch embeddings,
# position embeddings, pre / post norms, mergers, pooling heads) form the module's rest unit.
DEFAULT_LAYER_LISTS = ("layers", "blocks", "layer")

_MAX_NAMES = 16  # Error messages list at most this many names, as the coordinator's do.


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:_MAX_NAMES])
    return shown + (f" ... ({len(names) - _MAX_NAMES} more)" if len(names) > _MAX_NAMES else "")


def _param_bytes(params: Iterable[Any]) -> int:
    return sum(p.numel() * p.element_size() for p in params)




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


Trainable = Union[bool, str, Sequence[str]]


def trainable_names(trainable: Trainable) -> Union[bool, Tuple[str, ...]]:
    """``trainable`` as given to :func:`manifest`: True / False, or the names opted in (a path such as
    ``"model.visual"``, or its last components, ``"visual"``)."""
    if isinstance(trainable, bool):
        return trainable
    names = (trainable,) if isinstance(trainable, str) else tuple(trainable)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise InvalidArgument(f"trainable must be True, False or module names (paths such as 'model.visual', or their "
                              f"last components such as 'visual'), got {trainable!r}")
    return names


def opted_in(path: str, trainable: Union[bool, Tuple[str, ...]]) -> bool:
    """Whether the module at ``path`` is opted in as trainable by ``trainable`` (:func:`trainable_names`)."""
    if isinstance(trainable, bool):
        return trainable
    return any(path == t or path.endswith("." + t) for t in trainable)


def _check_opted_in(classified: Sequence[Tuple[str, str, bool]], trainable: Union[bool, Tuple[str, ...]]) -> None:
    """InvalidArgument for a name in ``trainable`` that is no tower or projector of the model."""
    if isinstance(trainable, bool):
        return
    paths = [path for path, _, _ in classified]
    unknown = [t for t in trainable if not any(path == t or path.endswith("." + t) for path in paths)]
    if unknown:
        raise InvalidArgument(f"trainable names {_names(unknown)}, which the model has no tower or projector of "
                              f"(its towers and projectors: {_names(paths) or 'none'}); a module with another name "
                              f"is named with extra_towers=[...] or extra_projectors=[...] too")


def candidates(modules: Mapping[str, Any], extra_towers: Sequence[str] = (),
               extra_projectors: Sequence[str] = ()) -> List[Tuple[str, str, bool]]:
    """The contract's classification of ``modules`` (``dict(model.named_modules())``): (path, "tower"
    | "projector", fully_frozen) of every tower- or projector-named module, the model itself left
    out as the C++ BuildManifest does (include_self=false)."""
    nodes = []
    for path, m in modules.items():
        if path:
            params = list(m.parameters())
            nodes.append((path, len(params), sum(1 for p in params if p.requires_grad)))
    return classify(nodes, extra_towers, extra_projectors)


def manifest(model: "_torch_t.nn.Module", layer_lists: Optional[Mapping[str, Union[str, Sequence[str]]]] = None,
             extra_towers: Sequence[str] = (), extra_projectors: Sequence[str] = (),
             trainable: Trainable = False) -> List[ModuleSpec]:
    """The controlled modules of ``model`` (fully frozen towers and projectors, by the contract's
    classifier, and the trainable ones opted in), with their parameter bytes and units, in path order.

    ``trainable``: towers and projectors with trainable parameters (the whole tower, or LoRA adapters
    on a frozen one) are controlled too when opted in: True for all of them, or their names (paths,
    or last components: ``["visual"]``). Their ``ModuleSpec.trainable`` is set, and the coordinator
    decides them skip, per_layer or root only (DESIGN 10, "Towers that train"); ``shardcoord.fsdp2``
    carries that out in forward and backward. Not opted in, they keep plain FSDP sharding (no
    decisions), as before.

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
    from ..worker import LayerUnit, ModuleSpec  # The binding's types, loaded at first use (worker.py).

    layer_lists = dict(layer_lists or {})
    modules = dict(model.named_modules())
    unknown = sorted(set(layer_lists) - set(modules))
    if unknown:
        raise InvalidArgument(f"layer_lists names modules the model does not have: {_names(unknown)}")
    classified = candidates(modules, extra_towers, extra_projectors)
    opt_in = trainable_names(trainable)
    _check_opted_in(classified, opt_in)
    specs = []
    for path, _kind, fully_frozen in classified:
        if not fully_frozen and not opted_in(path, opt_in):
            continue  # A trainable tower or projector not opted in keeps normal FSDP sharding: no decisions.
        module = modules[path]
        units = _units(path, module, _layer_lists(module, path, layer_lists.get(path)))
        specs.append(ModuleSpec(path, _param_bytes(module.parameters()),
                                tuple(LayerUnit(u.name, _param_bytes(p for _, p in u.params)) for u in units),
                                trainable=not fully_frozen))
    if not specs:
        frozen = _frozen_roots(model, [])
        seen = ", ".join(f"'{p}' ({b / 2**20:.1f} MiB)" for p, b in frozen[:8]) or "none"
        unfrozen = [f"'{path}'" for path, _kind, fully_frozen in classified if not fully_frozen]
        also = (f"; seen with trainable parameters (not controlled: freeze them with requires_grad_(False), or opt "
                f"them in with trainable=True or trainable=['{unfrozen[0][1:-1].rsplit('.', 1)[-1]}']): "
                f"{', '.join(unfrozen[:8])}") if unfrozen else ""
        warnings.warn(f"shardcoord.torch.manifest: no controlled module in {type(model).__name__}: none of its fully "
                      f"frozen modules has a tower or projector name (frozen modules seen: {seen}){also}; pass their "
                      f"last name component as extra_towers=[...] or extra_projectors=[...], e.g. "
                      f"extra_towers=['{frozen[0][0].rsplit('.', 1)[-1] if frozen else 'vision'}']",
                      RuntimeWarning, stacklevel=2)
    return specs

