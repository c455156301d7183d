"""One rank of the two-rank Executor check (run by test_trainer.py; not a test module itself).

    executor_ranks.py INIT_METHOD RANK WORLD

Both ranks build the same model (odd unit sizes: padding; a float64 unit; NaN and -0.0 values),
shard it with shardcoord.torch.Executor over Gloo, and check under each decision that what the
all-gathers materialize, and the forward outputs, are bitwise those of the unsharded copy, that
each rank keeps only its 1/G shard, and the byte counts. Prints "ok" and exits 0, or fails."""

import copy
import sys

import torch
import torch.distributed as dist
from torch import nn

import shardcoord.torch as sct


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(5, 3), nn.Linear(3, 3), nn.Linear(3, 2)])  # 18, 12, 8 elements

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = Tower()
        self.audio_projector = nn.Linear(3, 3).double()  # 12 float64: one "" unit
        self.head = nn.Linear(2, 2)
        self.visual.requires_grad_(False)
        self.audio_projector.requires_grad_(False)


def bits(t):
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def main():
    init, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(3)
    model = Model()
    with torch.no_grad():
        model.visual.blocks[2].bias[1] = float("nan")  # In the padded tail unit, on rank 1's shard.
        model.visual.blocks[0].weight[0, 0] = -0.0
    reference = copy.deepcopy(model)
    specs = sct.manifest(model)
    assert [s.name for s in specs] == ["audio_projector", "visual"], specs
    ex = sct.Executor(model, specs)

    def chunk(n, size):
        return -(-n // world) * size

    shard = ex.bytes
    assert shard["visual"].shard == chunk(18, 4) + chunk(12, 4) + chunk(8, 4), shard
    assert shard["audio_projector"].shard == chunk(12, 8), shard
    assert all(p.numel() == 0 for p in model.visual.parameters())
    assert all(p.numel() == 0 for p in model.audio_projector.parameters())

    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        expected = reference.visual(x)
        expected_projection = reference.audio_projector(torch.ones(2, 3, dtype=torch.float64))

    for kind in ("root", "per_layer", "replicate", "replicate", "skip", "per_layer"):
        ex.begin_microbatch({"visual": kind, "audio_projector": "root"})
        if kind in ("root", "replicate"):
            for p, q in zip(model.visual.parameters(), reference.visual.parameters()):
                assert bits(p) == bits(q), (kind, p, q)
        for p, q in zip(model.audio_projector.parameters(), reference.audio_projector.parameters()):
            assert bits(p) == bits(q), ("audio_projector", p, q)
        with torch.no_grad():
            if kind != "skip":
                assert bits(model.visual(x)) == bits(expected), kind
            assert bits(model.audio_projector(torch.ones(2, 3, dtype=torch.float64))) == bits(expected_projection)
        ex.end_microbatch()
        if kind != "replicate":
            assert all(p.numel() == 0 for p in model.visual.parameters()), kind

    visual_full = (chunk(18, 4) + chunk(12, 4) + chunk(8, 4)) * world
    b = ex.bytes["visual"]
    # root, per_layer, replicate (once), per_layer: four full gathers; the last replicate was
    # dropped at skip.
    assert b.gathered == 4 * visual_full, (b, visual_full)
    assert b.resident == b.shard and b.peak == b.shard + visual_full, b
    assert ex.gathers == 3 + 3 + 3 + 3 + 6 * 1, ex.gathers  # visual units per gathering kind + the projector
    dist.barrier()
    print(f"ok rank {rank} gathered {b.gathered} peak {b.peak}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
