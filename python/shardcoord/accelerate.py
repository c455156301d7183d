"""shardcoord for loops written with Hugging Face ``accelerate`` (the HF ``Trainer`` has its own:
``shardcoord.hf.TrainerMixin``). Two changes to an accelerate loop::

    model, optimizer, loader, sc = shardcoord.accelerate.prepare(accelerator, model, optimizer, loader)
    for batch in sc.iterate(loader, accum):              # was: for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step(); optimizer.zero_grad()
    sc.close()                                           # or: with sc: ...

:func:`prepare` is ``accelerator.prepare`` with the two phases around it: under accelerate's FSDP2
plugin (``fsdp_version: 2``) the frozen towers' layer units are sharded first, on accelerate's mesh
with its mixed-precision and offload policies, then accelerate wraps the rest (it skips modules that
already are FSDP units) and the control is attached to its root; without FSDP (DDP, CPU, one process)
the plain executor shards the towers over the world. ``sc.iterate`` fetches each step's ``accum``
batches ahead, reports their plans and runs each inside the group's decision. FSDP1 and DeepSpeed are
refused with what to set. ``options`` / keyword arguments: ``shardcoord.integration.Options``.
"""

from __future__ import annotations

from typing import Any, Optional

from ._hf_trainer import OptimizerHold, _distributed_kind, fsdp2_phase_one, fsdp2_settings
from .errors import InvalidArgument
from .integration import Options, Session

__all__ = ["fsdp2_settings", "prepare", "shard_towers"]


def shard_towers(accelerator: Any, model: Any, options: Optional[Options] = None, per_step: int = 1,
                 **kwargs: Any) -> Session:
    """Phase one alone: the Session with the towers sharded (FSDP2) or the plain executor in place;
    call ``accelerator.prepare`` yourself, then ``session.attach(prepared_model)`` (a no-op without
    FSDP2)."""
    session = Session(Options.of(options, **kwargs), who="shardcoord.accelerate")
    if _distributed_kind(accelerator) == "fsdp2":
        fsdp2_phase_one(accelerator, session, model, per_step)
    else:
        session.shard_plain(model, per_step=per_step)
    return session


def prepare(accelerator: Any, model: Any, *objects: Any, options: Optional[Options] = None, per_step: int = 0,
            **kwargs: Any) -> tuple:
    """``accelerator.prepare(model, *objects)`` with shardcoord's two phases around it; returns the
    prepared objects followed by the :class:`shardcoord.integration.Session`. ``per_step``: the
    microbatches a step plans together (default: the accelerator's gradient accumulation steps)."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise InvalidArgument(f"shardcoord.accelerate.prepare: the first object must be the model (a torch.nn.Module), "
                              f"got {type(model).__name__}")
    per_step = per_step or max(1, int(getattr(accelerator, "gradient_accumulation_steps", 1)))
    hold = OptimizerHold(model, objects)  # A trainable tower's parameters, replaced by phase one.
    session = shard_towers(accelerator, model, options, per_step, **kwargs)
    try:
        hold.take()
        out = accelerator.prepare(model, *objects)
        # accelerate returns a list for several objects (a tuple in some versions), the object for one.
        out = tuple(out) if objects and isinstance(out, (tuple, list)) else (out,)
        hold.put_back(out[0])
        if session.towers is not None:
            session.attach(out[0])
    except BaseException as e:
        session.close(e)
        raise
    return (*out, session)
