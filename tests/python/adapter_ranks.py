"""One rank of the two-rank check of a tower that trains through adapters on a frozen base, under
the plain executor (run by test_trainer.py; not a test module itself).

    adapter_ranks.py INIT_METHOD RANK WORLD [checkpoint]

Both ranks build the same model: a tower `visual` whose frozen patch embedding (the rest unit) and
three frozen layers carry a trainable adapter each (LoRA-like: the layer's output plus the
adapter's), and a trainable head. The executor shards the frozen weights only; the adapters and the
head stay replicated, their gradients all-reduced here as DDP would (every rank, zeros where it has
none). Each microbatch the ranks call the tower CALLS times and get the decision the coordinator
gives a trainable module (per_layer when equal, root when not, skip when neither calls it). After
each microbatch the mean gradients and then, after an SGD step, the parameters must equal those of
the unsharded model trained on both ranks' batches, and both ranks must have made the same
all-gathers. With ``checkpoint``, each layer runs under activation checkpointing (non-reentrant:
its forward runs again in the backward, and the executor's hooks with it): the same must hold, with
no further all-gather. Prints one line "result JSON" and exits 0, or fails."""

import copy
import datetime
import json
import sys

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

import shardcoord.torch as sct

# Calls of the tower per microbatch, [rank 0, rank 1].
CALLS = [[1, 1], [2, 0], [0, 0], [1, 2], [2, 2], [0, 1]]


class Block(nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.base = nn.Linear(i, o)  # Frozen, sharded.
        self.adapter = nn.Linear(i, o, bias=False)  # Trainable, replicated.

    def forward(self, x):
        return torch.tanh(self.base(x) + self.adapter(x))


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch_embed = nn.Linear(6, 5)  # The rest unit "" (frozen).
        self.blocks = nn.ModuleList([Block(5, 4), Block(4, 4), Block(4, 3)])
        self.checkpoint = False

    def forward(self, x):
        x = self.patch_embed(x)
        for b in self.blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False) if self.checkpoint else b(x)
        return x


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = Tower()
        self.head = nn.Linear(3, 2)
        self.visual.requires_grad_(False)
        for b in self.visual.blocks:
            b.adapter.requires_grad_(True)

    def forward(self, images):
        feats = torch.ones(2, 3)
        for image in images:
            feats = feats + self.visual(image)
        return self.head(feats).pow(2).sum()


def decision(calls):
    kind = "skip" if not any(calls) else "per_layer" if len(set(calls)) == 1 else "root"
    return {"visual": kind}


def images(mb, rank, n):
    g = torch.Generator().manual_seed(1000 * mb + 10 * rank)
    return [torch.randn(2, 6, generator=g) for _ in range(n)]


def trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def main():
    init, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    checkpoint = sys.argv[4:] == ["checkpoint"]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = Model()
    ref = copy.deepcopy(model)  # Unsharded, trained on both ranks' batches.
    model.visual.checkpoint = checkpoint
    specs = sct.manifest(model, trainable=True)
    assert [(s.name, s.trainable) for s in specs] == [("visual", True)], specs
    ex = sct.Executor(model, specs, rank_in_group=rank, group_size=world)
    assert model.visual.blocks[0].base.weight.numel() == 0, "the frozen base is sharded"
    assert model.visual.blocks[0].adapter.weight.numel() == 20, "the adapter stays whole"
    opt, ref_opt = torch.optim.SGD([p for _, p in trainable(model)], lr=0.1), \
        torch.optim.SGD([p for _, p in trainable(ref)], lr=0.1)
    gathers, worst = [], 0.0
    for mb, calls in enumerate(CALLS):
        opt.zero_grad()
        before = ex.gathers
        ex.begin_microbatch(decision(calls), calls={"visual": calls[rank]})
        model(images(mb, rank, calls[rank])).backward()
        ex.end_microbatch()
        gathers.append(ex.gathers - before)
        for _, p in trainable(model):  # As DDP would: every rank, zeros where it has no gradient.
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= world
        ref_opt.zero_grad()
        for r in range(world):
            (ref(images(mb, r, calls[r])) / world).backward()
        for (name, p), (_, q) in zip(trainable(model), trainable(ref)):
            q_grad = q.grad if q.grad is not None else torch.zeros_like(q)
            worst = max(worst, float((p.grad - q_grad).abs().max()))
            assert torch.allclose(p.grad, q_grad, atol=1e-6, rtol=1e-5), (mb, name, p.grad, q_grad)
        opt.step()
        ref_opt.step()
    for (name, p), (_, q) in zip(trainable(model), trainable(ref)):
        assert torch.equal(p, q), (name, p, q)  # After six steps.
    seen = [None] * world
    dist.all_gather_object(seen, gathers)
    assert seen[0] == seen[1], f"the ranks made different all-gathers per microbatch: {seen}"
    # Each unit (the rest and three layers) gathered once a microbatch, whatever the calls, and kept
    # through the backward; nothing under skip.
    assert gathers == [0 if decision(c)["visual"] == "skip" else 4 for c in CALLS], gathers
    print("result " + json.dumps({"rank": rank, "gathers": gathers, "worst_grad_diff": worst,
                                  "checkpoint": checkpoint}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
