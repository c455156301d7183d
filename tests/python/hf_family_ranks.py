"""One rank of the two-rank check of real-tower layouts (run by test_hf_sharding.py; not a test module).

    hf_family_ranks.py INIT_METHOD RANK WORLD FAMILY [FAMILY ...]

For each family of hf_lookalikes.py (module trees laid out as Hugging Face ``transformers`` 5.x
builds them, parameters outside the towers' layer lists included), every rank builds the same
model, freezes its towers and projector, and takes ``shardcoord.torch.manifest(model)`` with no
``layer_lists``: each tower must come out as its rest unit ``""`` plus its layers. The towers are
then sharded with ``shardcoord.torch.Executor`` over Gloo and one microbatch runs under each
decision, on batches of the family's own kinds, rank-asymmetric where the decision allows it:

- ``per_layer``: both ranks run the tower (twice where one batch holds images and videos);
- ``root`` and ``replicate``: rank 0 has media, rank 1 has text only;
- ``skip``: both text only.

Checked: the logits are bitwise those of the unsharded model on the same batch; no frozen
parameter stays gathered after the microbatch (except under replicate); and the sequence of
all-gathers (module, unit) of every microbatch is identical on every rank, the rest unit first.
Prints "ok FAMILY ..." per family and exits 0, or raises."""

import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_lookalikes as hfl  # noqa: E402

import shardcoord.torch as sct  # noqa: E402


def bits(t):
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def media_kind(name):
    return next(k for k in hfl.KINDS[name] if k != "text")


def check_family(name, rank, world):
    model = hfl.freeze_towers(hfl.FAMILIES[name](seed=1))
    reference = copy.deepcopy(model)
    specs = sct.manifest(model)
    frozen = set(hfl.FROZEN[name])
    assert {s.name for s in specs} == frozen, (name, [s.name for s in specs])
    tower = next(s for s in specs if s.name == hfl.FROZEN[name][0])
    names = [u.name for u in tower.units]
    assert names[0] == "" and len(names) >= 3, (name, names)  # The rest unit, then the layers.
    assert tower.units[0].param_bytes > 0, (name, "a real tower has parameters outside its layers")

    ex = sct.Executor(model, specs)
    log = []
    original = ex._materialize

    def logged(mod, unit):
        if unit.full is None:
            log.append((mod.spec.name, unit.name))
        return original(mod, unit)

    ex._materialize = logged

    both = "image+video" if "image+video" in hfl.KINDS[name] else media_kind(name)
    plan = [("per_layer", both, both), ("root", media_kind(name), "text"),
            ("replicate", media_kind(name), "text"), ("replicate", "text", media_kind(name)),
            ("skip", "text", "text"), ("per_layer", media_kind(name), media_kind(name))]
    logs = []
    for i, (kind, kind0, kind1) in enumerate(plan):
        batch = hfl.make_batch(name, kind0 if rank == 0 else kind1, seed=100 * i + rank)
        log.clear()
        ex.begin_microbatch({s.name: kind for s in specs})
        out = model(**batch).logits
        expected = reference(**batch).logits
        assert bits(out) == bits(expected), (name, kind, "logits differ from the unsharded model")
        ex.end_microbatch()
        if kind != "replicate":
            stuck = [n for s in specs for n, p in model.get_submodule(s.name).named_parameters() if p.numel()]
            assert not stuck, (name, kind, "still gathered", stuck[:4])
        if kind == "per_layer":
            assert log and log[0] == (tower.name, ""), (name, "the rest unit is gathered first", log[:3])
            layer_gathers = sum(1 for m, u in log if m == tower.name and u)
            calls = 2 if (rank == 0 and kind0 == "image+video") or (rank == 1 and kind1 == "image+video") else 1
            assert layer_gathers == calls * (len(names) - 1), (name, layer_gathers, calls, len(names))
        logs.append(list(log))
        if i == 0:  # per_layer first: its peak holds the rest unit and one layer, not the tower.
            units = ex._modules[tower.name].units
            rest_full, widest = units[0].full_bytes, max(u.full_bytes for u in units[1:])
            per_layer_peak = ex.bytes[tower.name].peak - ex.bytes[tower.name].shard
            assert per_layer_peak == rest_full + widest, (name, per_layer_peak, rest_full, widest)
        if i == 1:
            root_peak = ex.bytes[tower.name].peak - ex.bytes[tower.name].shard
            assert root_peak == sum(u.full_bytes for u in ex._modules[tower.name].units), (name, root_peak)
    everyone = [None] * world
    dist.all_gather_object(everyone, logs)
    for r, other in enumerate(everyone):
        assert other == logs, (name, f"rank {r} gathered {other} but rank {rank} gathered {logs}")
    return (f"ok {name}: {len(names) - 1} layers + rest unit {tower.units[0].param_bytes} B; frozen bytes gathered "
            f"at peak: per_layer {per_layer_peak}, root {root_peak}")


def main():
    init, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    for name in sys.argv[4:]:
        print(check_family(name, rank, world), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
