"""shardcoord for Hugging Face ``Trainer`` and its subclasses (TRL's ``SFTTrainer``, ``DPOTrainer``,
``GRPOTrainer``, ...), exported as ``shardcoord.hf.TrainerMixin`` and ``shardcoord.hf.patch``.

What it hooks, and why there (transformers 5.x with accelerate 1.x; a ``TrainerCallback`` never
sees the batch, and its ``on_train_begin`` comes after the model is wrapped, so it cannot do this):

- ``accelerator.prepare`` (the Trainer's, wrapped on the instance): before the framework wraps the
  model, the frozen towers' layer units become FSDP units of their own on accelerate's FSDP2 mesh
  with its mixed-precision and offload policies (accelerate then skips them: its wrap loop passes
  over modules that already are FSDP units); after, the control is attached to the root accelerate
  made. Without FSDP (DDP, one process) the plain executor shards the frozen towers over the world
  instead. FSDP1 and DeepSpeed are refused, naming what to set.
- ``get_batch_samples``: it returns every gradient-accumulation microbatch of a step before the
  first forward; their plans (``shardcoord.hf.plan_fn(model)``, or ``plan_fn=``) are reported there.
- ``training_step`` (one microbatch's forward and backward): the group's decision is carried out
  around it. ``prediction_step`` (evaluation): each batch planned and decided on its own.
- ``train`` / ``evaluate``: an error ends the session as failed, with its text (operators and the
  other ranks see it). A training that ended well keeps the session for a later ``evaluate()``; it
  ends cleanly at interpreter exit, or at ``trainer.shardcoord_close()``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Optional

from .errors import FailedPrecondition
from .integration import Options, Session

__all__ = ["TrainerMixin", "patch"]


def _distributed_kind(accelerator: Any) -> str:
    """'fsdp2', 'plain' (DDP, CPU, one process); refuses what shardcoord cannot drive."""
    kind = str(getattr(accelerator, "distributed_type", "NO")).rsplit(".", 1)[-1].upper()
    if kind == "DEEPSPEED":
        raise FailedPrecondition(
            "shardcoord.hf: DeepSpeed gathers the frozen towers' parameters by its own hooks, which shardcoord does "
            "not drive; use FSDP2 (TrainingArguments(fsdp='full_shard', fsdp_config={'fsdp_version': 2}) or "
            "accelerate's FSDP2 plugin)")
    if kind == "FSDP":
        if not getattr(accelerator, "is_fsdp2", False):
            raise FailedPrecondition(
                "shardcoord.hf: FSDP1 is not supported (its flat parameters gather a unit whole on every rank); use "
                "FSDP2: fsdp_config={'fsdp_version': 2} (TrainingArguments) or fsdp_version: 2 (accelerate config)")
        return "fsdp2"
    if kind in ("XLA", "TPU", "MEGATRON_LM"):
        raise FailedPrecondition(f"shardcoord.hf: accelerate's {kind} mode is not supported; use FSDP2 or DDP")
    return "plain"


def resolve_wrap_policy(accelerator: Any, model: Any) -> None:
    """Has accelerate's FSDP plugin resolve its auto-wrap classes now, by name, while the towers' blocks
    still have their own class names. ``fully_shard`` turns a ``Qwen2_5_VLVisionBlock`` into an
    ``FSDPQwen2_5_VLVisionBlock``, and accelerate's ``set_auto_wrap_policy`` looks classes up by
    name: called first inside ``prepare``, after the towers were sharded, it raised "Could not find the
    transformer layer class Qwen2_5_VLVisionBlock in the model" (seen on the GPU machine with
    transformers 5.17 and accelerate 1.15). Once resolved, the plugin keeps the classes and does not
    look them up again; the sharded blocks are subclasses of them, and its wrap loop skips them as
    FSDP units already."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    resolve = getattr(plugin, "set_auto_wrap_policy", None)
    if callable(resolve):
        resolve(model)


def narrow_wrap_names(accelerator: Any, model: Any) -> None:
    """After the towers were sharded: keeps in the plugin's ``transformer_cls_names_to_wrap`` only the
    classes with modules outside the towers' FSDP units. accelerate's ``fsdp2_prepare_model`` looks
    the names up once more (``fsdp2_prepare_auto_wrap_policy``, by ``type(module).__name__``) and
    ``fully_shard``s every module of those classes that is not an FSDP unit itself. Seen on the GPU
    machine (accelerate 1.15): "Could not find the transformer layer class Qwen2_5_VLVisionBlock"
    (every block had become an ``FSDPQwen2_5_VLVisionBlock``, a unit already), and for Qwen2-Audio,
    whose ``_no_split_modules`` names ``Qwen2AudioAttention``, a ``fully_shard`` of the attention inside
    an encoder-layer unit, whose parameters were sharded already (torch: "value was None"). A class
    with modules both inside a tower and outside cannot be wrapped outside only: refused, naming it."""
    from . import fsdp2

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    names = getattr(plugin, "transformer_cls_names_to_wrap", None)
    if not names:
        return
    inside = set()
    for module in model.modules():
        if fsdp2._is_fsdp(module):
            inside.update(id(m) for m in module.modules())
    outside_names = {type(m).__name__ for m in model.modules() if id(m) not in inside}
    inside_names = {type(m).__name__ for m in model.modules() if id(m) in inside}
    both = sorted(n for n in names if n in outside_names and n in inside_names)
    if both:
        raise FailedPrecondition(
            f"shardcoord.hf: accelerate's FSDP2 wrap classes {both} have modules inside the controlled towers and "
            "outside them; accelerate would wrap the towers' ones inside the units shardcoord made. List the "
            "decoder's layer classes only: fsdp_config={'transformer_layer_cls_to_wrap': [...]} (TrainingArguments) "
            "or transformer_cls_names_to_wrap (the FSDP plugin)")
    kept = [n for n in names if n in outside_names]
    if not kept:
        raise FailedPrecondition(
            f"shardcoord.hf: every FSDP2 wrap class of accelerate's ({names}) is inside the controlled towers, so the "
            "rest of the model would be one unit, gathered whole in every forward. List the decoder's layer class: "
            "fsdp_config={'transformer_layer_cls_to_wrap': [...]} (TrainingArguments) or transformer_cls_names_to_wrap "
            "(the FSDP plugin)")
    plugin.transformer_cls_names_to_wrap = kept


class OptimizerHold:
    """The parameters that phase one replaced (a trainable tower's layers, now FSDP units' sharded
    parameters) held out of the optimizers across ``accelerator.prepare``, then put back as the
    sharded ones. accelerate switches an optimizer's parameters to the sharded ones it made by a map
    from the model's parameters at ``prepare`` (``fsdp2_switch_optimizer_parameters``); the optimizer
    still held the tower's unsharded ones, which that map lacks: seen on the GPU machine (accelerate
    1.15), "A parameter in the optimizer couldn't be switched to its sharded version". A frozen tower
    is not in the optimizer, so nothing is held for it.

    Make it before phase one; :meth:`take` after it, :meth:`put_back` with the prepared model."""

    def __init__(self, model: Any, objects: tuple):
        import torch

        self._names = {id(p): n for n, p in model.named_parameters()}
        self._model = model
        self._optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        self._held: list = []  # (optimizer, group index, position, parameter name)

    def take(self) -> None:
        now = {id(p) for p in self._model.parameters()}
        for opt in self._optimizers:
            for gi, group in enumerate(opt.param_groups):
                kept = []
                for pos, p in enumerate(group["params"]):
                    if id(p) in self._names and id(p) not in now:
                        self._held.append((opt, gi, pos, self._names[id(p)]))
                    else:
                        kept.append(p)
                group["params"] = kept

    def put_back(self, prepared: Any) -> None:
        params = dict(getattr(prepared, "_orig_mod", prepared).named_parameters())
        for opt, gi, pos, name in sorted(self._held, key=lambda h: (id(h[0]), h[1], h[2])):
            if name not in params:
                raise FailedPrecondition(f"shardcoord: parameter '{name}' of a trainable tower is not in the prepared "
                                         f"model, so the optimizer cannot be given its sharded version")
            opt.param_groups[gi]["params"].insert(pos, params[name])
        self._held = []


def fsdp2_phase_one(accelerator: Any, session: Session, model: Any, per_step: int) -> None:
    """Phase one under accelerate's FSDP2 plugin: the wrap classes resolved while the blocks keep their
    names, the towers sharded on the plugin's mesh with its policies, the names accelerate looks up
    again narrowed to those the model still has."""
    resolve_wrap_policy(accelerator, model)
    mesh, kwargs = fsdp2_settings(accelerator)
    session.shard_towers(model, mesh, kwargs, per_step=per_step)
    narrow_wrap_names(accelerator, model)


def fsdp2_settings(accelerator: Any) -> tuple:
    """(mesh, fully_shard kwargs) as accelerate's FSDP2 preparation uses them (its
    ``fsdp2_prepare_model``): the FSDP dimensions of its device mesh (None: the world), the plugin's
    mixed-precision and offload policies, so the towers' units match the units accelerate makes."""
    plugin = accelerator.state.fsdp_plugin
    mesh = getattr(accelerator, "torch_device_mesh", None)
    config = getattr(accelerator, "parallelism_config", None)
    if mesh is not None and config is not None and getattr(config, "fsdp_dim_names", None):
        mesh = mesh[tuple(config.fsdp_dim_names)]
    elif mesh is not None and "dp_shard" in (getattr(mesh, "mesh_dim_names", None) or ()):
        mesh = mesh["dp_shard"]
    kwargs = {}
    if getattr(plugin, "mixed_precision_policy", None) is not None:
        kwargs["mp_policy"] = plugin.mixed_precision_policy
    if getattr(plugin, "cpu_offload", None) is not None and not isinstance(plugin.cpu_offload, bool):
        kwargs["offload_policy"] = plugin.cpu_offload
    return mesh, kwargs


class _Hook:
    """The state of one trainer: its Session, and the wrapped methods' bodies."""

    def __init__(self, trainer: Any, options: Options):
        self.trainer = trainer
        self.session = Session(options, who="shardcoord.hf")
        self.kind: Optional[str] = None
        self._atexit = False

    # -- accelerator.prepare

    def install_prepare(self) -> None:
        accelerator = self.trainer.accelerator
        if getattr(accelerator.prepare, "_shardcoord", False):
            return
        original = accelerator.prepare

        @functools.wraps(original)
        def prepare(*args: Any, **kwargs: Any) -> Any:
            return self.prepare(original, *args, **kwargs)

        prepare._shardcoord = True  # type: ignore[attr-defined]
        accelerator.prepare = prepare

    def _model_in(self, args: tuple) -> Any:
        import torch

        models = [a for a in args if isinstance(a, torch.nn.Module)]
        return models[0] if models else None

    def prepare(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        model = self._model_in(args)
        hold = None
        if model is not None and not self.session.started:
            self.kind = _distributed_kind(self.trainer.accelerator)
            accum = max(1, int(getattr(self.trainer.args, "gradient_accumulation_steps", 1)))
            if self.kind == "fsdp2":
                hold = OptimizerHold(model, args)
                fsdp2_phase_one(self.trainer.accelerator, self.session, model, accum)
                hold.take()
            else:
                self.session.shard_plain(model, per_step=accum)
        out = original(*args, **kwargs)
        if model is not None and self.kind == "fsdp2":
            # accelerate returns a list for several objects (a tuple in some versions), the object for one.
            prepared = out[args.index(model)] if isinstance(out, (tuple, list)) else out
            if hold is not None:
                hold.put_back(prepared)
            self.session.attach(prepared)
        return out

    # -- the training loop

    def _microbatches(self):
        mbs = self.session.microbatches
        if mbs is None:
            raise FailedPrecondition("shardcoord.hf: the model was never prepared by the trainer's accelerator, so "
                                     "its towers are not sharded; use Trainer.train() (or accelerator.prepare)")
        return mbs

    def get_batch_samples(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        batches = out[0] if isinstance(out, tuple) else out
        if self.session.microbatches is not None and batches:
            self.session.microbatches.plan(list(batches))
        return out

    def training_step(self, original: Any, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        with self._microbatches().run(inputs):
            return original(model, inputs, *args, **kwargs)

    def prediction_step(self, original: Any, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if self.session.microbatches is None:  # Evaluation before training: nothing sharded yet.
            return original(model, inputs, *args, **kwargs)
        with self.session.microbatches.run_one(inputs):
            return original(model, inputs, *args, **kwargs)

    def train(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        self.install_prepare()
        return self._closing_on_error(original, *args, **kwargs)

    def evaluate(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        return self._closing_on_error(original, *args, **kwargs)

    def _closing_on_error(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """Runs ``original``; an error ends the session as failed, with its text. After a training that
        ended well the session stays open (``trainer.evaluate()`` after ``train()`` runs the towers
        too), and ends cleanly at interpreter exit or at ``shardcoord_close()``."""
        try:
            out = original(*args, **kwargs)
        except BaseException as e:
            self.session.close(e)
            raise
        if self.session.started and not self._atexit:
            import atexit

            atexit.register(self.session.close)
            self._atexit = True
        return out

    @property
    def decisions(self):
        mbs = self.session.microbatches
        return dict(mbs.decisions) if mbs is not None else {}


class _LiveDecisions(Mapping):
    """Decision kind -> count so far, read from the hook each time (str() shows a dict)."""

    def __init__(self, hook: "_Hook"):
        self._hook = hook

    def __getitem__(self, kind: str) -> int:
        return self._hook.decisions[kind]

    def __iter__(self):
        return iter(self._hook.decisions)

    def __len__(self) -> int:
        return len(self._hook.decisions)

    def __repr__(self) -> str:
        return repr(self._hook.decisions)


class TrainerMixin:
    """Put it first among the bases: ``class MyTrainer(shardcoord.hf.TrainerMixin, SFTTrainer)``, or
    ``shardcoord.hf.Trainer`` for ``transformers.Trainer`` itself. Every rank's trainer then reports
    its microbatches' plans and runs the group's decisions on the frozen towers, sharded per layer.
    ``shardcoord=`` takes an ``Options`` or a dict of its fields (``job_id``, ``plan_fn``, ``policy``,
    ...); the defaults fit a supported HF VLM under torchrun with ``$SHARDCOORD_ADDR`` set.
    ``self.shardcoord_decisions``: decision kind -> count, so far; ``self.shardcoord_close()``."""

    def __init__(self, *args: Any, shardcoord: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        options = shardcoord if isinstance(shardcoord, Options) else Options.of(**dict(shardcoord or {}))
        self._shardcoord = _Hook(self, options)
        self._shardcoord.install_prepare()

    def get_batch_samples(self, *args: Any, **kwargs: Any) -> Any:
        return self._shardcoord.get_batch_samples(super().get_batch_samples, *args, **kwargs)

    def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        return self._shardcoord.training_step(super().training_step, model, inputs, *args, **kwargs)

    def prediction_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        return self._shardcoord.prediction_step(super().prediction_step, model, inputs, *args, **kwargs)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        return self._shardcoord.train(super().train, *args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        return self._shardcoord.evaluate(super().evaluate, *args, **kwargs)

    @property
    def shardcoord_decisions(self):
        return self._shardcoord.decisions

    def shardcoord_close(self) -> None:
        """Ends this rank's shardcoord session now (otherwise at interpreter exit)."""
        self._shardcoord.session.close()


def patch(trainer: Any, options: Optional[Options] = None, **kwargs: Any) -> Any:
    """The same as :class:`TrainerMixin`, on a trainer already built (any ``Trainer`` subclass):
    ``trainer = shardcoord.hf.patch(SFTTrainer(...))``. Returns the trainer. ``options`` /
    ``kwargs``: :class:`shardcoord.integration.Options` fields."""
    if getattr(trainer, "_shardcoord", None) is not None:
        raise FailedPrecondition("shardcoord.hf.patch: this trainer is already under shardcoord")
    hook = _Hook(trainer, Options.of(options, **kwargs))
    trainer._shardcoord = hook
    trainer.shardcoord_close = hook.session.close
    # The decision counts so far, as TrainerMixin's property gives them: a live read-only mapping
    # (the trainer's class stays its own, so it pickles and compares as before).
    trainer.shardcoord_decisions = _LiveDecisions(hook)
    for name in ("get_batch_samples", "training_step", "prediction_step", "train", "evaluate"):
        original = getattr(trainer, name)
        setattr(trainer, name, functools.partial(getattr(hook, name), original))
    hook.install_prepare()
    return trainer
