"""shardcoord for Lightning (``lightning`` or ``pytorch_lightning`` >= 2.4) with FSDP2, that is
``ModelParallelStrategy``, whose ``configure_model`` the user writes with ``fully_shard``. One line
in the Trainer's callbacks::

    trainer = L.Trainer(strategy=ModelParallelStrategy(), callbacks=[shardcoord.lightning.Shardcoord()])

- ``setup`` (after the strategy made its device mesh, before ``configure_model``): the frozen
  towers' layer units become FSDP units on the mesh's data-parallel dimension, and the worker
  registers (its shard group that dimension, checked). Your ``configure_model`` then wraps the rest
  as usual (``fully_shard`` on the decoder layers and the model; leave the towers' modules alone).
- ``on_fit_start``: the control is attached to the outermost FSDP unit holding the towers.
- ``on_train_batch_start`` / ``on_train_batch_end`` (and the validation ones): each batch's plan is
  reported and the group's decision carried out around its forward and backward (one round trip
  per batch: Lightning fetches no step ahead).
- ``on_exception`` / ``teardown``: the session ends, as failed with the error when there was one.

The LightningModule's model is found as ``pl_module.model`` when it has one (else the module itself);
``Shardcoord(model_attr=...)`` names another attribute. Lightning's FSDPStrategy is FSDP1: refused,
use ModelParallelStrategy. Without a ModelParallelStrategy (DDP, one device) the plain executor shards
the towers over the world. ``options`` / keyword arguments: ``shardcoord.integration.Options``.
"""

from __future__ import annotations

from typing import Any, Optional

from .errors import FailedPrecondition
from .integration import Options, Session

try:  # The base class: Lightning's, where installed (either package name).
    from lightning.pytorch.callbacks import Callback as _Callback
except Exception:  # pragma: no cover - depends on what is installed
    try:
        from pytorch_lightning.callbacks import Callback as _Callback
    except Exception:
        _Callback = object

__all__ = ["Shardcoord"]


class Shardcoord(_Callback):  # type: ignore[misc,valid-type]
    """The callback (see the module's documentation). ``mesh_dim``: the device mesh dimension FSDP
    shards over (ModelParallelStrategy's ``data_parallel``). ``self.decisions``: kind -> count."""

    def __init__(self, options: Optional[Options] = None, *, model_attr: str = "model",
                 mesh_dim: str = "data_parallel", **kwargs: Any):
        self.session = Session(Options.of(options, **kwargs), who="shardcoord.lightning")
        self.model_attr = model_attr
        self.mesh_dim = mesh_dim
        self._running: Any = None

    def _model(self, pl_module: Any) -> Any:
        return getattr(pl_module, self.model_attr, None) or pl_module

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit" or self.session.started:
            return
        strategy = type(trainer.strategy).__name__
        accum = max(1, int(getattr(trainer, "accumulate_grad_batches", 1)))
        model = self._model(pl_module)
        if strategy in ("FSDPStrategy",):
            raise FailedPrecondition("shardcoord.lightning: FSDPStrategy is FSDP1 (flat parameters, a unit gathered "
                                     "whole); use ModelParallelStrategy with fully_shard in configure_model (FSDP2)")
        if strategy == "ModelParallelStrategy":
            mesh = getattr(trainer.strategy, "device_mesh", None)
            if mesh is not None and self.mesh_dim in (getattr(mesh, "mesh_dim_names", None) or ()):
                mesh = mesh[self.mesh_dim]
            self.session.shard_towers(model, mesh, per_step=accum)
        else:
            self.session.shard_plain(model, per_step=accum)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.session.towers is not None:
            self.session.attach(self._model(pl_module))  # attach() finds the outermost FSDP unit in it

    def _begin(self, batch: Any) -> None:
        mbs = self.session.microbatches
        if mbs is None:
            raise FailedPrecondition("shardcoord.lightning: a batch before the towers were sharded; add the callback "
                                     "to the Trainer's callbacks and train with trainer.fit")
        self._running = mbs.run_one(batch)
        self._running.__enter__()

    def _end(self) -> None:
        running, self._running = self._running, None
        if running is not None:
            running.__exit__(None, None, None)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._begin(batch)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._end()

    def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        if self.session.microbatches is not None:
            self._begin(batch)

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        self._end()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        running, self._running = self._running, None
        if running is not None:
            try:
                running.__exit__(type(exception), exception, None)
            except Exception:
                pass
        self.session.close(exception)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._end()
            self.session.close()

    @property
    def decisions(self):
        mbs = self.session.microbatches
        return dict(mbs.decisions) if mbs is not None else {}

