#!/usr/bin/env python3
"""The smallest complete shardcoord training loop (README, Python): a model with a frozen two-layer
"vision tower", sharded per layer over the shard group by the plain torch.distributed executor, on
CPU with Gloo. Run it like any torchrun script; with no ``SHARDCOORD_ADDR`` rank 0 starts a
coordinator for the job (README, Install), with it the job uses that running shardcoordd::

    torchrun --nproc_per_node 2 --redirects 2 --tee 2 examples/python/minimal_loop.py
    SHARDCOORD_ADDR=127.0.0.1:7871 torchrun --nproc_per_node 2 --redirects 2 --tee 2 examples/python/minimal_loop.py

(or with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set by hand, or by srun). Every rank
prints one line per microbatch with the group's decision, then the hash of its trained
parameters, the same on every rank.
"""

import hashlib
import os

import torch
import torch.distributed as dist
from torch import nn

import shardcoord
import shardcoord.torch as sct


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = nn.Module()
        self.visual.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])  # frozen, sharded per layer
        self.head = nn.Linear(8, 1)                                              # trained

    def forward(self, x, images=None):
        if images is not None:  # only microbatches with images run the tower
            for block in self.visual.blocks:
                images = torch.tanh(block(images))
            x = x + images.mean(0)
        return self.head(x).pow(2).mean()


def main():
    rank, world, _ = shardcoord.launcher_rank()          # torchrun's RANK/WORLD_SIZE, or srun's
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)                                   # the same weights on every rank
    model = Model()
    model.visual.requires_grad_(False)
    specs = sct.manifest(model)                            # [model 'visual': units blocks.0, blocks.1]
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable, lr=0.1)
    with shardcoord.Worker(os.environ.get("JOB", "minimal"), specs, group_size=world) as worker:
        group = sct.shard_process_group(worker)
        executor = sct.Executor(model, specs, process_group=group, group=worker)
        gen = torch.Generator().manual_seed(rank)
        # Rank 0 sees images in every other microbatch, the others in every third: the groups agree
        # on some microbatches (per_layer or skip) and diverge on others (the fallback, root).
        batches = [(torch.randn(4, 8, generator=gen),
                    torch.randn(3, 8, generator=gen) if i % (2 if rank == 0 else 3) == 0 else None) for i in range(8)]
        plan = lambda b: {"visual": 0 if b[1] is None else 1}  # noqa: E731  (this rank's calls)
        plans = sct.PlanAhead(worker, sct.with_keys(batches, accum=2), plan)
        for step, mb, (x, images), decision in plans:
            executor.begin_microbatch(decision, calls=plans.plan)  # the calls reported: padded needs them
            loss = model(x, images)
            loss.backward()
            executor.end_microbatch()
            print(f"rank {rank} step {step} mb {mb} {decision['visual'].decision}", flush=True)
            if mb == 1:                                    # end of the step: average and apply
                for p in trainable:
                    with sct.collective(worker, "gradient all-reduce"):
                        dist.all_reduce(p.grad)
                    p.grad /= world
                opt.step()
                opt.zero_grad()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in trainable)).hexdigest()[:16]
    print(f"rank {rank} final params hash {digest}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
