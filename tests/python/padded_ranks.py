"""One rank of the two-rank `padded` check (run by test_trainer.py; not a test module itself).

    padded_ranks.py INIT_METHOD RANK WORLD

Both ranks build the same model: a frozen tower `visual` with a rest unit (patch_embed) and three
layers of different sizes (a mispaired all-gather then fails on a size instead of passing
silently), a frozen `audio_projector` (one "" unit, decided root throughout) and a trainable head.
Each microbatch the ranks call the tower a different number of times; the tower is decided
("padded", K), K the most calls, and each rank gives begin_microbatch its own calls. Per
microbatch each rank records its all-gathers (count, and the byte size of each, in order), and
asserts that every tower output is bitwise what the unsharded copy computes. Then the error of a
rank that runs a call beyond its plan, and a microbatch after it (the group still pairs).

Then the pad chain (several padded modules in one microbatch): a second model whose forward calls
`audio_tower` (a rest unit and two layers) then `vision_tower` (two layers), all five units of
other sizes, in manifest order; per microbatch the ranks call them CHAIN_CALLS times (one rank
calls the audio tower and pads the vision tower, the other the reverse; one calls both, the other
neither; ...), each tower padded unless both ranks call it equally. Recorded and checked as the
first. Prints one line "result JSON" and exits 0, or fails."""

import copy
import datetime
import json
import sys

import torch
import torch.distributed as dist
from torch import nn

import shardcoord
import shardcoord.torch as sct

# Calls of the tower per microbatch, [rank 0, rank 1]: padded unless every rank calls it equally.
CALLS = [[2, 0], [3, 1], [1, 2], [2, 2], [0, 0], [2, 0]]


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch_embed = nn.Linear(6, 5)  # The rest unit "": 35 elements.
        self.blocks = nn.ModuleList([nn.Linear(5, 4), nn.Linear(4, 4), nn.Linear(4, 3)])  # 24, 20, 15

    def forward(self, x):
        x = self.patch_embed(x)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = Tower()
        self.audio_projector = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)
        self.visual.requires_grad_(False)
        self.audio_projector.requires_grad_(False)

    def forward(self, images):
        feats = torch.zeros(2, 3)
        outputs = []
        for x in images:  # One call of the tower per image batch: ranks differ in how many they have.
            out = self.visual(x)
            outputs.append(out)
            feats = feats + out
        return self.head(self.audio_projector(feats)), outputs


# Calls of (audio_tower, vision_tower) per microbatch, [rank 0, rank 1].
CHAIN_CALLS = [[(1, 0), (0, 1)], [(2, 1), (0, 0)], [(0, 2), (1, 1)], [(1, 1), (0, 1)], [(0, 0), (2, 0)]]


class AudioTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Linear(7, 6)  # The rest unit "": 48 elements.
        self.layers = nn.ModuleList([nn.Linear(6, 5), nn.Linear(5, 3)])  # 35, 18

    def forward(self, x):
        x = self.conv(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class VisionTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(3, 8), nn.Linear(8, 3)])  # 32, 27 elements; no rest unit.

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


class TwoTowers(nn.Module):
    def __init__(self):
        super().__init__()
        self.audio_tower = AudioTower()
        self.vision_tower = VisionTower()
        self.head = nn.Linear(3, 2)
        self.audio_tower.requires_grad_(False)
        self.vision_tower.requires_grad_(False)

    def forward(self, audio, images):
        feats, outputs = torch.zeros(2, 3), []
        for x in audio:  # Every audio call before the first vision call: the manifest's order.
            outputs.append(self.audio_tower(x))
            feats = feats + outputs[-1]
        for x in images:
            outputs.append(self.vision_tower(x))
            feats = feats + outputs[-1]
        return self.head(feats), outputs


def bits(t):
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def record_all_gathers():
    """Every all-gather this process issues, as the byte size of its output, in order."""
    sizes = []
    original = dist.all_gather

    def recorded(outputs, tensor, *args, **kwargs):
        sizes.append(sum(o.numel() * o.element_size() for o in outputs))
        return original(outputs, tensor, *args, **kwargs)

    dist.all_gather = recorded
    return sizes


def decision(calls):
    k = max(calls)
    visual = "skip" if k == 0 else "per_layer" if min(calls) == k else ("padded", k)
    return {"visual": visual, "audio_projector": "root"}


def images_for(rank, mb, n):
    gen = torch.Generator().manual_seed(1000 * mb + 10 * rank)
    return [torch.randn(2, 6, generator=gen) for _ in range(n)]


def run_microbatch(model, reference, ex, sizes, rank, mb, calls):
    before_gathers, before_sizes = ex.gathers, len(sizes)
    ex.begin_microbatch(decision(calls), calls={"visual": calls[rank]})
    images = images_for(rank, mb, calls[rank])
    loss_out, outputs = model(images)
    with torch.no_grad():
        for x, out in zip(images, outputs):
            assert bits(out) == bits(reference.visual(x)), f"microbatch {mb}: a tower output differs from the reference"
    loss_out.pow(2).mean().backward()
    ex.end_microbatch()
    assert all(p.numel() == 0 for p in model.visual.parameters()), f"microbatch {mb}: the tower is still gathered"
    return {"gathers": ex.gathers - before_gathers, "sizes": sizes[before_sizes:], "peak": ex.bytes["visual"].peak}


def call_beyond_the_plan(model, ex, rank):
    """Rank 0 plans 1 call and runs 2: the second is refused before it gathers, and
    end_microbatch says the rank's all-gathers no longer matched. Rank 1 pads the one pass."""
    calls = [1, 0]
    ex.begin_microbatch(decision(calls), calls={"visual": calls[rank]})
    refused, ended = "", ""
    if rank == 0:
        model.visual(torch.ones(2, 6))
        try:
            model.visual(torch.ones(2, 6))
        except shardcoord.FailedPrecondition as e:
            refused = str(e)
    try:
        ex.end_microbatch()
    except shardcoord.FailedPrecondition as e:
        ended = str(e)
    return {"refused": refused, "ended": ended, "resident": ex.bytes["visual"].resident}


def chain_decision(calls):
    """Each tower: padded (K: the most calls) unless both ranks call it equally."""
    decision = {}
    for i, name in enumerate(("audio_tower", "vision_tower")):
        per_rank = [c[i] for c in calls]
        k = max(per_rank)
        decision[name] = "skip" if k == 0 else "per_layer" if min(per_rank) == k else ("padded", k)
    return decision


def run_chain(sizes, rank):
    """The pad chain scenario: per microbatch the byte sizes of this rank's all-gathers, each tower
    output checked bitwise against the unsharded copy."""
    torch.manual_seed(6)
    model = TwoTowers()
    reference = copy.deepcopy(model)
    specs = sct.manifest(model)
    assert [(s.name, [u.name for u in s.units]) for s in specs] == [
        ("audio_tower", ["", "layers.0", "layers.1"]), ("vision_tower", ["blocks.0", "blocks.1"])], specs
    ex = sct.Executor(model, specs)
    result = {"shard": sum(b.shard for b in ex.bytes.values()), "microbatches": []}
    for mb, calls in enumerate(CHAIN_CALLS):
        before = len(sizes)
        a, v = calls[rank]
        ex.begin_microbatch(chain_decision(calls), calls={"audio_tower": a, "vision_tower": v})
        gen = torch.Generator().manual_seed(100 * mb + rank)
        audio, images = [torch.randn(2, 7, generator=gen) for _ in range(a)], [torch.randn(2, 3, generator=gen)
                                                                              for _ in range(v)]
        loss_out, outputs = model(audio, images)
        with torch.no_grad():
            expected = [reference.audio_tower(x) for x in audio] + [reference.vision_tower(x) for x in images]
        assert [bits(o) for o in outputs] == [bits(o) for o in expected], f"chain microbatch {mb}: outputs differ"
        loss_out.pow(2).mean().backward()
        ex.end_microbatch()
        result["microbatches"].append({"sizes": sizes[before:], "peak": ex.peak_total_bytes})
    return result


def main():
    init, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    # A mismatch of collectives fails within the timeout instead of hanging.
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    torch.manual_seed(5)
    model = Model()
    reference = copy.deepcopy(model)
    specs = sct.manifest(model)
    assert [[u.name for u in s.units] for s in specs] == [[""], ["", "blocks.0", "blocks.1", "blocks.2"]], specs
    ex = sct.Executor(model, specs)
    sizes = record_all_gathers()
    result = {"rank": rank, "shard": ex.bytes["visual"].shard, "microbatches": []}
    for mb, calls in enumerate(CALLS):
        result["microbatches"].append(run_microbatch(model, reference, ex, sizes, rank, mb, calls))
    result["beyond_plan"] = call_beyond_the_plan(model, ex, rank)
    result["after_error"] = run_microbatch(model, reference, ex, sizes, rank, len(CALLS), [0, 2])
    result["chain"] = run_chain(sizes, rank)
    dist.barrier()
    print("result " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
