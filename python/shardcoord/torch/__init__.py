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

One module per concern, everything public imported here: _manifest.py (the manifest of a model),
_plan_ahead.py (with_keys, PlanAhead), _failures.py (collectives that name the cause,
FailureWatch), _executor.py (the executor and the shard group's process group), _costs.py
(CostMeter: forward and gather seconds, memory headroom, measured on the rank for
``Worker.report_costs``).
"""

from ._costs import CostMeter
from ._executor import Executor, ModuleBytes, shard_process_group
from ._failures import FailureWatch, abort_process_group, collective, collective_failure, wait_collective
from ._manifest import DEFAULT_LAYER_LISTS, manifest
from ._plan_ahead import PlanAhead, with_keys

__all__ = [
    "CostMeter", "DEFAULT_LAYER_LISTS", "Executor", "FailureWatch", "ModuleBytes", "PlanAhead", "abort_process_group",
    "collective", "collective_failure", "manifest", "shard_process_group", "wait_collective", "with_keys",
]
