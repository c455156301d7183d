"""shardcoord.torch: the manifest from a ``torch.nn.Module``, plans kept ahead of the training loop,
and a plain ``torch.distributed`` executor that carries decisions out on the real frozen parameters.

On every rank, in the same order::

    import shardcoord, shardcoord.torch as sct
    specs = sct.manifest(model)                                  # controlled (fully frozen) modules
    worker = shardcoord.Worker("run-42", specs, group_size=G)    # RANK / WORLD_SIZE from torchrun
    pg = sct.shard_process_group(worker)                         # this rank's shard group
    ex = sct.Executor(model, specs, worker, pg)                  # frozen parameters sharded now
    plan = lambda batch: {"model.visual": 1 if batch.images is not None else 0}  # this rank's calls
    plans = sct.PlanAhead(worker, sct.with_keys(loader, accum), plan)
    for step, mb, batch, decision in plans:
        ex.begin_microbatch(decision, calls=plans.plan)          # the calls reported; root / replicate: gathered here;
                                                                 # padded: pad passes issued (from) here
        loss = model(batch).loss                                 # per_layer, padded: hooks gather each unit
        loss.backward()
        ex.end_microbatch()                                      # root: released

The executor mirrors the C++ ``shardcoord::torchx::FrozenShardExecutor`` (worker/torch/): each unit
(an entry of a controlled module's layer lists, or its rest unit "": the parameters outside them,
such as a Hugging Face tower's embeddings, norms, merger or pooling head, or the whole module when
it has no layer list) is one flat buffer padded to a multiple of the group size; each rank keeps
its 1/G shard; materializing all-gathers the buffer (as raw bytes, so the values are bitwise those
of the unsharded parameters) and points the parameters at views of it. Under ``per_layer`` the rest
unit is gathered when the module's forward starts and released when it ends, each layer around its
own forward: the peak is the rest plus one layer. Under ``padded`` (ranks call the module unequally
often; every rank makes K all-gather passes over it, K the most calls any rank makes) the rank's own
calls gather as under ``per_layer``; the other K - c passes (c: the rank's planned calls, given as
``calls``) are pad passes, each unit gathered and released at once in the order a forward gathers
them, issued by ``begin_microbatch`` or, with several padded modules (a chain in manifest order),
after this rank's last call of the padded module before: the peak stays one unit, and the padded
modules must be the first users of the shard process group in the forward, called in manifest
order (``Executor`` says what else it assumes). ``skip`` gathers nothing; ``root`` and
``replicate`` gather the whole module in ``begin_microbatch``. torch is imported lazily:
``import shardcoord`` works without it.

One module per concern, everything public imported here: _manifest.py (the manifest of a model),
_plan_ahead.py (with_keys, PlanAhead), _failures.py (collectives that name the cause,
FailureWatch), _executor.py (the executor and the shard group's process group), _costs.py
(CostMeter: forward and gather seconds, memory headroom, measured on the rank for
``Worker.report_costs``).
"""

from ._costs import CostMeter
from ._executor import Executor, ModuleBytes, shard_process_group
from ._failures import FailureWatch, abort_process_group, collective, collective_failure, leave, wait_collective
from ._manifest import DEFAULT_LAYER_LISTS, manifest
from ._plan_ahead import PlanAhead, with_keys

__all__ = [
    "CostMeter", "DEFAULT_LAYER_LISTS", "Executor", "FailureWatch", "ModuleBytes", "PlanAhead", "abort_process_group",
    "collective", "collective_failure", "leave", "manifest", "shard_process_group", "wait_collective", "with_keys",
]
