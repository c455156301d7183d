"""shardcoord.hf: plans from real batches, for Hugging Face ``transformers`` vision- and audio-language
models.

A plan says how often the model's forward will call each controlled module (fully frozen, or opted
in as trainable) in a microbatch; a wrong count is a collective one rank issues and another does
not (an NCCL hang).
For the families below this module reads the count off the batch the HF processor made, with the
rule the model's own forward applies (the same tests: ``is not None``, ``size(0) > 0``, ...)::

    import shardcoord.hf, shardcoord.torch as sct
    from shardcoord.hf import Trainer                # transformers.Trainer, made safe (TrainerMixin; patch)
    plans = sct.PlanAhead(worker, sct.with_keys(loader, accum), shardcoord.hf.plan_fn(model))
    shardcoord.hf.tower_calls(model, batch)          # {"model.visual": 2} for images and videos
    shardcoord.hf.tower_calls("qwen2_vl", batch)     # by family name, with the canonical paths

The family comes from ``model.config.model_type`` or the class name (``Qwen2VLForConditionalGeneration``,
``Qwen2VLModel``, subclasses too); nothing here imports ``transformers`` or ``torch``. Module paths are
the model's own (``named_modules()``): ``model.visual`` for the ``...ForConditionalGeneration`` class,
``visual`` for the inner ``...Model``, ``base_model.model.model.visual`` under PEFT. Given a model,
only controlled modules are named: the contract's tower or projector names (plus ``extra_towers`` /
``extra_projectors``, as given to :func:`shardcoord.torch.manifest`) whose parameters are all frozen,
the modules :func:`shardcoord.torch.manifest` registers. Given a family name, every tower and
projector the forward calls is named (the usual fine-tune: towers and projectors frozen).

The rules, read from ``transformers`` 5.17 (``models/<family>/modeling_<family>.py``: ``<X>Model.forward``
and its ``get_image_features`` / ``get_video_features``) and checked against the real classes by
``scripts/gpu/hf_calls_check.py``; a tower call is one call of its projector where the family has one:

- llava, gemma3, internvl: ``model.vision_tower`` and ``model.multi_modal_projector`` once if
  ``pixel_values is not None`` (every image of the microbatch goes through one call).
- llava_next: the same, if ``pixel_values is not None and pixel_values.size(0) > 0``.
- llava_onevision: ``pixel_values is not None`` + ``pixel_values_videos is not None`` calls (2 with
  images and videos).
- qwen2_vl, qwen2_5_vl: ``model.visual`` (patch_embed, blocks, merger: no separate projector),
  ``pixel_values is not None`` + ``pixel_values_videos is not None`` calls.
- idefics3, smolvlm: ``model.vision_model`` and ``model.connector`` once if ``pixel_values is not None``
  (SmolVLM also when every image is padding). ``connector`` is a controlled module where the contract's
  projector names (``shardcoord.BUILTIN_PROJECTOR_NAMES``) include it; elsewhere only with
  ``extra_projectors=("connector",)``, given to manifest() too.
- mllama: ``model.vision_model`` and ``model.multi_modal_projector`` once if ``pixel_values is not
  None`` (precomputed ``cross_attention_states`` instead: none).
- qwen2_audio: ``model.audio_tower`` and ``model.multi_modal_projector`` once if ``inputs_embeds is None
  and input_features is not None and input_ids.shape[1] != 1``.

A batch the forward cannot run raises InvalidArgument here, at plan time, before any rank enters a
tower: ``pixel_values`` with ``image_hidden_states`` or with ``cross_attention_states``, Mllama's
``pixel_values`` without ``aspect_ratio_ids``, Qwen2-Audio's ``input_features`` without
``feature_attention_mask``, a media key (``pixel_values``, ``pixel_values_videos``, ``input_features``)
holding no elements -- every family's forward fails on that, most after entering the tower --, and
Idefics3 ``pixel_values`` that are all padding (all zeros; this one reads the values). Leave a medium's
keys out, or None, for a microbatch without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import shardcoord as _shardcoord_pkg  # Its builtin names load the binding at first use, not here.
from .errors import InvalidArgument

__all__ = ["FAMILIES", "Options", "Trainer", "TrainerMixin", "family_of", "patch", "plan_fn", "tower_calls"]

_Get = Callable[[str], Any]


def _present(value: Any) -> bool:
    return value is not None


def _rows(value: Any) -> int:
    """``value.size(0)`` as the forward reads it (a tensor's first dimension; a list's length)."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else 1
    return len(value)


def _empty(value: Any) -> bool:
    """A tensor (or list) with no elements."""
    numel = getattr(value, "numel", None)
    if callable(numel):
        return int(numel()) == 0
    shape = getattr(value, "shape", None)
    if shape is not None:
        return any(int(d) == 0 for d in shape)
    return len(value) == 0


def _reject_empty(get: _Get, *keys: str) -> None:
    """Media keys that are present but hold nothing: every family's forward fails on them (transformers
    5.17: a reshape of an empty tensor in the tower, a torch.cat of no features, ...), some after
    entering the tower, so no count is right; a microbatch without that medium leaves the key out."""
    for key in keys:
        value = get(key)
        if value is not None and _empty(value):
            raise InvalidArgument(f"the batch has '{key}' with no elements: the model's forward fails on that "
                                  f"(after entering the tower, in some families); leave the key out, or None, for a "
                                  f"microbatch without that input")


def _llava(get: _Get) -> Tuple[int, int]:
    _reject_empty(get, "pixel_values")
    n = int(_present(get("pixel_values")))
    return n, n


def _llava_next(get: _Get) -> Tuple[int, int]:
    _reject_empty(get, "pixel_values")  # size(0) == 0 skips the tower, then the forward fails at its end
    pixel_values = get("pixel_values")
    n = int(pixel_values is not None and _rows(pixel_values) > 0)
    return n, n


def _images_and_videos(get: _Get) -> Tuple[int, int]:
    _reject_empty(get, "pixel_values", "pixel_values_videos")
    n = int(_present(get("pixel_values"))) + int(_present(get("pixel_values_videos")))
    return n, n


def _idefics3(get: _Get, keeps_one: bool = False) -> Tuple[int, int]:
    pixel_values = get("pixel_values")
    if pixel_values is not None and _present(get("image_hidden_states")):
        raise InvalidArgument("the batch has both pixel_values and image_hidden_states: the model's forward raises "
                              "ValueError for that (pass one of them)")
    _reject_empty(get, "pixel_values")
    if pixel_values is not None and not keeps_one and hasattr(pixel_values, "any") and not bool(pixel_values.any()):
        # Idefics3 drops the all-zero (padding) images and runs the tower on none: it fails there.
        # SmolVLM keeps one empty image and runs.
        raise InvalidArgument("every image of the batch's pixel_values is padding (all zeros): Idefics3's forward "
                              "then runs the vision model on no image and fails; leave pixel_values out for a "
                              "microbatch without images")
    n = int(pixel_values is not None)
    return n, n


def _smolvlm(get: _Get) -> Tuple[int, int]:
    return _idefics3(get, keeps_one=True)


def _mllama(get: _Get) -> Tuple[int, int]:
    if _present(get("pixel_values")):
        if _present(get("cross_attention_states")):
            raise InvalidArgument("the batch has both pixel_values and cross_attention_states: the model's forward "
                                  "raises ValueError for that (pass one of them)")
        if not _present(get("aspect_ratio_ids")):
            raise InvalidArgument("the batch has pixel_values without aspect_ratio_ids: the model's forward raises "
                                  "ValueError for that (the Mllama processor makes both)")
    _reject_empty(get, "pixel_values")
    n = int(_present(get("pixel_values")))
    return n, n


def _qwen2_audio(get: _Get) -> Tuple[int, int]:
    if not _present(get("input_features")):
        return 0, 0
    if not _present(get("feature_attention_mask")):
        raise InvalidArgument("the batch has input_features without feature_attention_mask: the model's forward "
                              "needs both (the Qwen2-Audio processor makes both)")
    if _present(get("inputs_embeds")):
        return 0, 0  # The forward merges audio only while it embeds input_ids itself.
    input_ids = get("input_ids")
    if input_ids is None:
        raise InvalidArgument("the batch has input_features but neither input_ids nor inputs_embeds")
    shape = getattr(input_ids, "shape", None)
    length = int(shape[1]) if shape is not None else len(input_ids[0])
    if length == 1:
        return 0, 0  # A generation step: the audio was merged at the first step.
    _reject_empty(get, "input_features")
    return 1, 1


@dataclass(frozen=True)
class _Family:
    name: str
    classes: Tuple[str, ...]  # Class-name prefixes: "<prefix>ForConditionalGeneration", "<prefix>Model".
    tower: str  # Canonical path under the ...ForConditionalGeneration class.
    projector: Optional[str]  # Called once per tower call; None where the tower holds it.
    rule: Callable[[_Get], Tuple[int, int]]  # (tower calls, projector calls)


_FAMILY_LIST = (
    _Family("llava", ("Llava",), "model.vision_tower", "model.multi_modal_projector", _llava),
    _Family("llava_next", ("LlavaNext",), "model.vision_tower", "model.multi_modal_projector", _llava_next),
    _Family("llava_onevision", ("LlavaOnevision",), "model.vision_tower", "model.multi_modal_projector",
            _images_and_videos),
    _Family("qwen2_vl", ("Qwen2VL",), "model.visual", None, _images_and_videos),
    _Family("qwen2_5_vl", ("Qwen2_5_VL",), "model.visual", None, _images_and_videos),
    _Family("gemma3", ("Gemma3",), "model.vision_tower", "model.multi_modal_projector", _llava),
    _Family("idefics3", ("Idefics3",), "model.vision_model", "model.connector", _idefics3),
    _Family("smolvlm", ("SmolVLM",), "model.vision_model", "model.connector", _smolvlm),
    _Family("internvl", ("InternVL",), "model.vision_tower", "model.multi_modal_projector", _llava),
    _Family("mllama", ("Mllama",), "model.vision_model", "model.multi_modal_projector", _mllama),
    _Family("qwen2_audio", ("Qwen2Audio",), "model.audio_tower", "model.multi_modal_projector", _qwen2_audio),
)
_FAMILIES = {f.name: f for f in _FAMILY_LIST}
_BY_CLASS = {f"{prefix}{suffix}": f for f in _FAMILY_LIST for prefix in f.classes
             for suffix in ("ForConditionalGeneration", "Model")}

FAMILIES = tuple(sorted(_FAMILIES))
"""The supported families, as ``config.model_type`` names them."""


def _unknown(what: str) -> InvalidArgument:
    return InvalidArgument(
        f"shardcoord.hf does not know how often the forward of {what} calls its frozen modules; it knows the "
        f"families {', '.join(FAMILIES)} (by config.model_type, or the class <X>ForConditionalGeneration / <X>Model). "
        f"For another model write the plan function by hand: a callable batch -> {{module path: calls}} naming the "
        f"modules of shardcoord.torch.manifest(model), with the count the model's forward makes, e.g. "
        f"lambda b: {{'model.visual': (b.get('pixel_values') is not None) + "
        f"(b.get('pixel_values_videos') is not None)}}")


def _normalize(name: str) -> str:
    return name.strip().lower().replace("-", "_").replace(".", "_")


def _identify(module: Any) -> Optional[_Family]:
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    if isinstance(model_type, str) and model_type in _FAMILIES:
        return _FAMILIES[model_type]
    for cls in type(module).__mro__:
        family = _BY_CLASS.get(cls.__name__)
        if family is not None:
            return family
    return None


def _family(model_or_family: Any) -> _Family:
    if isinstance(model_or_family, str):
        family = _FAMILIES.get(_normalize(model_or_family))
        if family is None:
            raise _unknown(f"family '{model_or_family}'")
        return family
    family = _identify(model_or_family)
    model_type = getattr(getattr(model_or_family, "config", None), "model_type", None)
    if family is None and model_type is None:
        # A wrapper without a config of its own (DDP's module, FSDP1's _fsdp_wrapped_module, ...): the
        # shallowest module that identifies. A model with another model_type is not taken for its parts.
        named = getattr(model_or_family, "named_modules", None)
        inner = sorted(named(), key=lambda item: item[0].count(".") + bool(item[0])) if callable(named) else []
        family = next((f for f in (_identify(m) for _, m in inner) if f is not None), None)
    if family is not None:
        return family
    what = f"a {type(model_or_family).__name__}"
    if isinstance(model_type, str):
        what += f" (config.model_type '{model_type}')"
    raise _unknown(what)


def family_of(model_or_family: Any) -> str:
    """The family name (one of :data:`FAMILIES`) of a model or a family name; InvalidArgument if unknown."""
    return _family(model_or_family).name


def _getter(batch: Any) -> _Get:
    if batch is None:
        return lambda key: None
    if isinstance(batch, Mapping) or (hasattr(batch, "get") and hasattr(batch, "keys")):
        return lambda key: batch.get(key)
    return lambda key: getattr(batch, key, None)


def _controlled_name(path: str, extra_towers: Iterable[str], extra_projectors: Iterable[str]) -> bool:
    last = path.rsplit(".", 1)[-1]
    return last in _shardcoord_pkg.BUILTIN_TOWER_NAMES or last in _shardcoord_pkg.BUILTIN_PROJECTOR_NAMES \
        or last in tuple(extra_towers) \
        or last in tuple(extra_projectors)


def _calls(family: _Family, batch: Any) -> List[Tuple[str, int]]:
    tower, projector = family.rule(_getter(batch))
    out = [(family.tower, tower)]
    if family.projector is not None:
        out.append((family.projector, projector))
    return out


def _resolve(canonical: str, names: Sequence[str]) -> Optional[str]:
    """The model's path of a canonical module path: itself, or a path ending in it (PEFT, wrappers); for
    the inner <X>Model, the path without its leading "model."."""
    for wanted in (canonical, canonical.split(".", 1)[1] if canonical.startswith("model.") else None):
        if wanted is None:
            continue
        hits = [n for n in names if n == wanted or n.endswith("." + wanted)]
        if hits:
            return min(hits, key=lambda n: (n.count("."), n))
    return None


def _fully_frozen(module: Any) -> bool:
    params = list(module.parameters())
    return bool(params) and not any(p.requires_grad for p in params)


def plan_fn(model_or_family: Any, *, extra_towers: Sequence[str] = (),
            extra_projectors: Sequence[str] = (), trainable: Any = False) -> Callable[[Any], Dict[str, int]]:
    """A plan function for :class:`shardcoord.torch.PlanAhead`: ``batch -> {module path: calls}``.

    Given a model, the module paths are resolved and the controlled ones (contract names, all
    parameters frozen, or opted in by ``trainable`` as in ``manifest(model, trainable=...)``) chosen
    once, now: freeze before calling it, as before ``manifest(model)``.
    Given a family name, the canonical paths of every tower and projector it calls (filtered by the
    contract's names and the extras). InvalidArgument for an unknown family, or a model whose tower is
    not where its family keeps it."""
    from .torch._manifest import opted_in, trainable_names

    family = _family(model_or_family)
    extra_towers, extra_projectors = tuple(extra_towers), tuple(extra_projectors)
    opt_in = trainable_names(trainable)
    if isinstance(model_or_family, str):
        keep = {path: path for path, _ in _calls(family, None)
                if _controlled_name(path, extra_towers, extra_projectors)}
    else:
        modules = dict(model_or_family.named_modules())
        names = sorted(modules)
        keep = {}
        for canonical, _ in _calls(family, None):
            path = _resolve(canonical, names)
            if path is None:
                if canonical == family.tower:
                    raise InvalidArgument(
                        f"the {type(model_or_family).__name__} is of family '{family.name}' but has no module "
                        f"'{canonical}' (nor one ending in '{canonical.split('.', 1)[-1]}'): a transformers version "
                        f"whose layout shardcoord.hf does not know; write the plan function by hand")
                continue
            if _controlled_name(path, extra_towers, extra_projectors) and (_fully_frozen(modules[path]) or
                                                                           opted_in(path, opt_in)):
                keep[canonical] = path

    def plan(batch: Any) -> Dict[str, int]:
        return {keep[canonical]: calls for canonical, calls in _calls(family, batch) if canonical in keep}

    plan.family = family.name  # type: ignore[attr-defined]
    plan.modules = tuple(sorted(keep.values()))  # type: ignore[attr-defined]
    return plan


def tower_calls(model_or_family: Any, batch: Any, *, extra_towers: Sequence[str] = (),
                extra_projectors: Sequence[str] = ()) -> Dict[str, int]:
    """How often the forward of ``model_or_family`` calls each controlled module on ``batch`` (a dict
    or ``BatchFeature`` as the HF processor makes it; missing keys are None): ``{"model.visual": 2}``.
    See :func:`plan_fn` for which modules are named; for a model, build ``plan_fn(model)`` once and call
    it per batch instead (this resolves the paths on every call)."""
    return plan_fn(model_or_family, extra_towers=extra_towers, extra_projectors=extra_projectors)(batch)


# The Trainer integration (_hf_trainer.py): importing it loads neither torch nor transformers.
from ._hf_trainer import TrainerMixin, patch  # noqa: E402
from .integration import Options  # noqa: E402


def __getattr__(name: str) -> Any:
    """``shardcoord.hf.Trainer``: ``transformers.Trainer`` with :class:`TrainerMixin`, made on first
    use (``import shardcoord.hf`` does not import transformers)."""
    if name == "Trainer":
        import transformers

        value = type("Trainer", (TrainerMixin, transformers.Trainer), {"__module__": __name__, "__doc__":
                     "transformers.Trainer under shardcoord (TrainerMixin's documentation)."})
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shardcoord.hf' has no attribute '{name}'")
