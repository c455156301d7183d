"""shardcoord.sampler (pure Python: no daemon, no torch) and the traces scripts/make_trace.py builds
with it.

Through ctest, PYTHONPATH holds the build tree's package; run alone (`python3 -m pytest
tests/python/test_sampler.py`), the module is loaded from the source tree."""

import collections
import importlib.util
import itertools
import json
import os
import random
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
SOURCE = os.path.join(ROOT, "python", "shardcoord", "sampler.py")

try:
    import shardcoord.sampler as scs
except ImportError:  # No built package on the path: the module is pure Python, load it alone.
    _spec = importlib.util.spec_from_file_location("shardcoord_sampler", SOURCE)
    scs = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(scs)


class Sample:
    """A sample compared by identity, so that the multiset checks see copies and losses."""

    def __init__(self, media):
        self.media = dict(media)

    def __repr__(self):
        return f"Sample({self.media})"


def media_of(sample):
    return sample.media


TOWERS = {"image": "visual", "video": "visual", "audio": "audio"}
KINDS = [{}, {"image": 1}, {"video": 1}, {"image": 3}, {"image": 1, "audio": 1}, {"audio": 1}, {"video": 1, "audio": 1}]


def random_step(rng, n, kinds=KINDS, text_share=0.3):
    return [Sample({} if rng.random() < text_share else rng.choice(kinds)) for _ in range(n)]


def calls_per_microbatch(mbs, calls="batched", tower_of="visual"):
    return [scs.tower_calls(mb, media_of, calls, tower_of) for mb in mbs]


def aim(samples, microbatches, calls, tower_of):
    """The documented aim, written again here: per tower, the first width = min(n, microbatches)
    microbatches call it, an amount of calls spread evenly over them, larger shares first (batched:
    width; per_item: the items; per_kind: width, or the microbatches the kinds fill at least if
    more, at most the number of kinds each); the others not at all."""
    room = -(-len(samples) // microbatches)
    need = collections.Counter()
    items = collections.Counter()
    kinds = collections.defaultdict(collections.Counter)
    for s in samples:
        towers = collections.Counter()
        for kind, k in s.media.items():
            if k:
                t = TOWERS[kind] if isinstance(tower_of, dict) else tower_of
                towers[t] += k
                kinds[t][kind] += 1
        for t, k in towers.items():
            need[t] += 1
            items[t] += k
    out = {}
    for t, n in need.items():
        width = min(n, microbatches)
        if calls == "per_item":
            amount = items[t]
        elif calls == "per_kind":
            fill = sum(-(-c // room) for c in kinds[t].values())
            amount = max(width, fill)
        else:
            amount = width
        shares = [amount // width + (j < amount % width) if j < width else 0 for j in range(microbatches)]
        out[t] = [min(x, len(kinds[t])) for x in shares] if calls == "per_kind" else shares
    return out


def distance(mbs, target, calls, tower_of):
    got = calls_per_microbatch(mbs, calls, tower_of)
    return sum(abs(got[j].get(t, 0) - want[j]) for t, want in target.items() for j in range(len(mbs)))


# ---------------------------------------------------------------------------------------------
# arrange_step


@pytest.mark.parametrize("calls", scs.CALL_MODES)
def test_arrange_step_keeps_the_samples_and_the_sizes(calls):
    rng = random.Random(11)
    for case in range(300):
        microbatches = rng.randint(1, 6)
        n = rng.randint(microbatches, 5 * microbatches)
        samples = random_step(rng, n)
        out = scs.arrange_step(samples, microbatches, media_of, calls, TOWERS)
        assert len(out) == microbatches
        # The same multiset, by identity: each sample exactly once.
        placed = [id(s) for mb in out for s in mb]
        assert sorted(placed) == sorted(id(s) for s in samples), f"case {case}"
        # A plain split's sizes: the first n % microbatches one larger.
        assert [len(mb) for mb in out] == [n // microbatches + (j < n % microbatches) for j in range(microbatches)]
        # Within a microbatch, the given order.
        position = {id(s): i for i, s in enumerate(samples)}
        for mb in out:
            assert [position[id(s)] for s in mb] == sorted(position[id(s)] for s in mb)


def test_arrange_step_respects_explicit_sizes():
    rng = random.Random(3)
    samples = random_step(rng, 10)
    out = scs.arrange_step(samples, 4, media_of, "batched", TOWERS, sizes=[4, 0, 3, 3])
    assert [len(mb) for mb in out] == [4, 0, 3, 3]
    assert sorted(id(s) for mb in out for s in mb) == sorted(id(s) for s in samples)


def test_arrange_step_is_deterministic():
    rng = random.Random(5)
    for _ in range(50):
        media = [dict(s.media) for s in random_step(rng, 12)]
        first = scs.arrange_step([Sample(m) for m in media], 4, media_of, "per_kind", TOWERS)
        again = scs.arrange_step([Sample(m) for m in media], 4, media_of, "per_kind", TOWERS)
        # Fresh objects with the same media in the same order: the same placement.
        assert [[s.media for s in mb] for mb in first] == [[s.media for s in mb] for mb in again]
        indices = list(range(12))
        by_index = scs.arrange_step(indices, 4, lambda i: media[i], "per_kind", TOWERS)
        assert [[media[i] for i in mb] for mb in by_index] == [[s.media for s in mb] for mb in first]


def test_every_microbatch_calls_the_tower_once_when_media_suffice():
    rng = random.Random(7)
    checked = 0
    for _ in range(500):
        microbatches = rng.randint(2, 8)
        per_mb = rng.randint(1, 4)
        samples = random_step(rng, microbatches * per_mb, kinds=[{"image": 1}, {"image": 2}, {"video": 1}],
                              text_share=rng.random())
        media = sum(1 for s in samples if s.media)
        if media < microbatches:
            continue
        checked += 1
        out = scs.arrange_step(samples, microbatches, media_of, "batched", "visual")
        assert calls_per_microbatch(out) == [{"visual": 1}] * microbatches, out
    assert checked > 100


def test_fewer_media_than_microbatches_go_first_one_each():
    rng = random.Random(8)
    checked = 0
    for _ in range(500):
        microbatches = rng.randint(2, 8)
        per_mb = rng.randint(1, 4)
        samples = random_step(rng, microbatches * per_mb, kinds=[{"image": 1}, {"video": 2}], text_share=0.9)
        media = sum(1 for s in samples if s.media)
        if media >= microbatches:
            continue
        checked += 1
        out = scs.arrange_step(samples, microbatches, media_of, "batched", "visual")
        assert [sum(1 for s in mb if s.media) for mb in out] == [1] * media + [0] * (microbatches - media), out
    assert checked > 100


def test_per_kind_keeps_kinds_apart():
    # Qwen2-VL calls `visual` once for images and once for videos: 6 videos and 6 images in four
    # microbatches of 4 fit one kind per microbatch (videos 4 + 2, images 4 + 2, or so).
    samples = [Sample({"video": 1}) for _ in range(6)] + [Sample({"image": 1}) for _ in range(6)] + \
        [Sample({}) for _ in range(4)]
    out = scs.arrange_step(samples, 4, media_of, "per_kind", "visual")
    assert calls_per_microbatch(out, "per_kind") == [{"visual": 1}] * 4, out
    # 13 images and 2 videos do not fit apart (the images fill all four microbatches): the one
    # microbatch with both kinds comes first.
    samples = [Sample({"image": 1}) for _ in range(13)] + [Sample({"video": 1}) for _ in range(2)] + [Sample({})]
    out = scs.arrange_step(samples, 4, media_of, "per_kind", "visual")
    assert calls_per_microbatch(out, "per_kind") == [{"visual": 2}] + [{"visual": 1}] * 3, out
    # Under batched the same samples just need media everywhere.
    out = scs.arrange_step(samples, 4, media_of, "batched", "visual")
    assert calls_per_microbatch(out, "batched") == [{"visual": 1}] * 4


def test_per_item_spreads_items_larger_shares_first():
    samples = [Sample({"image": 1}) for _ in range(7)] + [Sample({}) for _ in range(5)]
    out = scs.arrange_step(samples, 3, media_of, "per_item", "visual")
    assert [c.get("visual", 0) for c in calls_per_microbatch(out, "per_item")] == [3, 2, 2]


def test_two_towers_each_in_every_microbatch_when_they_suffice():
    # VITA-like: vision and audio towers, speech on some samples with or without images.
    samples = [Sample({"image": 1, "audio": 1}), Sample({"image": 1}), Sample({"audio": 1}), Sample({"video": 1}),
               Sample({"image": 1}), Sample({}), Sample({"audio": 1}), Sample({"image": 1}), Sample({"audio": 1}),
               Sample({}), Sample({}), Sample({})]
    out = scs.arrange_step(samples, 4, media_of, "batched", TOWERS)
    assert calls_per_microbatch(out, "batched", TOWERS) == [{"audio": 1, "visual": 1}] * 4, out


def _partitions(items, sizes):
    if not sizes:
        yield []
        return
    for chosen in itertools.combinations(range(len(items)), sizes[0]):
        rest = [x for k, x in enumerate(items) if k not in chosen]
        for tail in _partitions(rest, sizes[1:]):
            yield [[items[k] for k in chosen]] + tail


@pytest.mark.parametrize("calls", scs.CALL_MODES)
@pytest.mark.parametrize("microbatches,per_mb", [(3, 2), (2, 3), (2, 4)])
def test_arrange_step_reaches_the_best_possible_for_one_tower(calls, microbatches, per_mb):
    # Exhaustive over every split of the step into microbatches of per_mb: nothing gets closer to the aim.
    rng = random.Random(13)
    kinds = [{}, {"image": 1}, {"video": 1}, {"image": 3}, {"image": 2}, {"video": 2}]
    for _ in range(60):
        samples = [Sample(rng.choice(kinds)) for _ in range(microbatches * per_mb)]
        target = aim(samples, microbatches, calls, TOWERS)
        got = distance(scs.arrange_step(samples, microbatches, media_of, calls, TOWERS), target, calls, TOWERS)
        best = min(distance(p, target, calls, TOWERS) for p in _partitions(samples, [per_mb] * microbatches))
        assert got == best, (samples, got, best)


@pytest.mark.parametrize("calls", scs.CALL_MODES)
def test_arrange_step_with_two_towers_is_nearly_always_the_best_possible(calls):
    # Vision and audio towers: a local search, not exhaustive; on these 200 seeded steps it misses
    # the best split twice under per_kind, once under per_item, never under batched.
    rng = random.Random(13)
    missed = 0
    for _ in range(200):
        samples = [Sample(rng.choice(KINDS + [{"image": 2}])) for _ in range(6)]
        target = aim(samples, 3, calls, TOWERS)
        got = distance(scs.arrange_step(samples, 3, media_of, calls, TOWERS), target, calls, TOWERS)
        best = min(distance(p, target, calls, TOWERS) for p in _partitions(samples, [2, 2, 2]))
        plain = distance([samples[0:2], samples[2:4], samples[4:6]], target, calls, TOWERS)
        assert best <= got <= plain
        missed += got > best
    assert missed <= (0 if calls == "batched" else 4), missed


def test_arrange_step_refuses_bad_input():
    with pytest.raises(ValueError, match="cannot fill"):
        scs.arrange_step([Sample({})] * 3, 4, media_of)
    with pytest.raises(ValueError, match="microbatches must be"):
        scs.arrange_step([Sample({})], 0, media_of)
    with pytest.raises(ValueError, match="sizes must be"):
        scs.arrange_step([Sample({})] * 4, 2, media_of, sizes=[1, 2])
    with pytest.raises(ValueError, match="calls must be one of"):
        scs.arrange_step([Sample({})] * 4, 2, media_of, calls="twice")
    with pytest.raises(ValueError, match="no tower for media kind 'depth'"):
        scs.arrange_step([Sample({"depth": 1})] * 2, 2, media_of, tower_of=TOWERS)
    with pytest.raises(ValueError, match="non-negative int"):
        scs.arrange_step([Sample({"image": -1})] * 2, 2, media_of)


def test_tower_calls_by_mode():
    mb = [Sample({"image": 2}), Sample({"video": 1, "audio": 1}), Sample({"image": 1}), Sample({})]
    assert scs.tower_calls(mb, media_of, "batched", TOWERS) == {"audio": 1, "visual": 1}
    assert scs.tower_calls(mb, media_of, "per_kind", TOWERS) == {"audio": 1, "visual": 2}
    assert scs.tower_calls(mb, media_of, "per_item", TOWERS) == {"audio": 1, "visual": 4}
    assert scs.tower_calls([Sample({})], media_of, tower_of="model.visual") == {}


def test_tower_calls_needs_the_manifests_module_name():
    with pytest.raises(ValueError, match=r"tower_calls needs tower_of: .* e\.g\. tower_of='model\.visual'"):
        scs.tower_calls([Sample({"image": 1})], media_of)


def test_media_of_shorthands_and_what_it_refuses():
    samples = [True, False, 3, "video", None, {"audio": 2}]
    assert scs.tower_calls(samples, lambda s: s, "per_item", "model.visual") == {"model.visual": 7}
    assert scs.tower_calls([True, None], lambda s: s, "batched", "model.visual") == {"model.visual": 1}
    assert [len(mb) for mb in scs.arrange_step([True, False, False, True], 2, lambda s: s)] == [2, 2]
    with pytest.raises(TypeError, match=r"media_of\(sample\) must return kind -> items .* got float 1\.5"):
        scs.tower_calls([1.5], lambda s: s, tower_of="model.visual")


# ---------------------------------------------------------------------------------------------
# Agreement: the contract's rule on simulated groups


def decisions(plans, group_size, towers):
    """plans[rank][microbatch] = {tower: calls}; counts of per_layer / skip / fallback decisions."""
    counts = collections.Counter()
    for g in range(0, len(plans), group_size):
        for j in range(len(plans[0])):
            for t in towers:
                calls = {plans[r][j].get(t, 0) for r in range(g, g + group_size)}
                counts["skip" if calls == {0} else "per_layer" if len(calls) == 1 else "fallback"] += 1
    return counts


@pytest.mark.parametrize("per_mb,text_share", [(4, 0.3), (1, 0.3), (4, 0.6)])
def test_spread_makes_groups_agree_more_often(per_mb, text_share):
    rng = random.Random(17)
    world, group, microbatches, steps = 16, 4, 4, 30
    kinds = [{"image": 1}, {"image": 2}, {"video": 1}]
    before = collections.Counter()
    after = collections.Counter()
    for _ in range(steps):
        step = [random_step(rng, microbatches * per_mb, kinds, text_share) for _ in range(world)]
        plain = [calls_per_microbatch([s[j * per_mb:(j + 1) * per_mb] for j in range(microbatches)]) for s in step]
        spread = [calls_per_microbatch(scs.arrange_step(s, microbatches, media_of, "batched", "visual"))
                  for s in step]
        before += decisions(plain, group, ["visual"])
        after += decisions(spread, group, ["visual"])
    total = sum(before.values())
    assert sum(after.values()) == total
    # Spreading never moves a step away from agreement here, and removes most fallbacks where
    # ranks have several samples per microbatch.
    assert after["fallback"] < before["fallback"], (before, after)
    if per_mb > 1 and text_share < 0.5:
        assert after["fallback"] <= before["fallback"] // 4, (before, after)


def test_group_by_modality_steps_agree_but_for_the_leftover():
    # Every rank takes its share of the one global order, as a distributed loader deals it: the
    # groups fall back only in the first step, the mixed leftover (the dataset is a whole number of
    # steps here, so there is no partial one at the end).
    rng = random.Random(19)
    world, group, microbatches, per_mb, steps = 8, 4, 2, 2, 25
    step_size = world * microbatches * per_mb
    samples = random_step(rng, step_size * steps, kinds=[{"image": 1}, {"image": 2}], text_share=0.3)
    order = scs.group_by_modality(["image" if s.media else "text" for s in samples], world, microbatches, per_mb,
                                  seed=3)
    plans = [[[[] for _ in range(microbatches)] for _ in range(world)] for _ in range(steps)]
    for position, index in enumerate(order):
        batch = position // per_mb
        plans[batch // (world * microbatches)][batch % world][(batch // world) % microbatches].append(samples[index])
    falling_back = [step for step in range(steps)
                    if decisions([calls_per_microbatch(mbs) for mbs in plans[step]], group, ["visual"])["fallback"]]
    assert set(falling_back) <= {0}, falling_back
    # Without it, the same samples in the order drawn fall back in most steps.
    plain = 0
    for step in range(steps):
        ranks = [[samples[(step * world + r) * microbatches * per_mb + j * per_mb:][:per_mb] for j in range(microbatches)]
                 for r in range(world)]
        plain += bool(decisions([calls_per_microbatch(mbs) for mbs in ranks], group, ["visual"])["fallback"])
    assert plain > steps // 2


# ---------------------------------------------------------------------------------------------
# group_by_modality and its sampler


def test_group_by_modality_is_a_permutation_with_pure_megabatches():
    rng = random.Random(23)
    for _ in range(30):
        world, accum, batch = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 3)
        megabatch = world * accum * batch
        names = ["image", "video", "text"][:rng.randint(1, 3)]
        modalities = [rng.choice(names) for _ in range(rng.randint(1, 12 * megabatch))]
        order = scs.group_by_modality(modalities, world, accum, batch, seed=rng.randint(0, 99))
        assert sorted(order) == list(range(len(modalities)))
        cuts = [order[i:i + megabatch] for i in range(0, len(order), megabatch)]
        # Only the leftover (the last megabatch of each modality, concatenated) is mixed: its full
        # megabatches first (fewer than the modalities), its rest last; all between are pure.
        mixed = [k for k, mb in enumerate(cuts) if len({modalities[i] for i in mb}) > 1]
        assert all(k < len(set(modalities)) - 1 or k == len(cuts) - 1 for k in mixed), (mixed, len(cuts))


def test_group_by_modality_llava_lengths():
    # LLaVA's modality_lengths: > 0 multimodal, < 0 text only; each megabatch sorted by length and
    # dealt into world * accum chunks of balanced total length.
    rng = random.Random(29)
    world, accum, batch = 2, 2, 4
    megabatch = world * accum * batch
    lengths = [rng.choice([1, -1]) * rng.randint(10, 500) for _ in range(megabatch * 10)]
    order = scs.group_by_modality(lengths, world, accum, batch, seed=1)
    assert sorted(order) == list(range(len(lengths)))
    pure = 0
    for start in range(0, len(order), megabatch):
        mb = order[start:start + megabatch]
        if len({l > 0 for l in (lengths[i] for i in mb)}) == 1:
            pure += 1
            chunks = [sum(abs(lengths[i]) for i in mb[c:c + batch]) for c in range(0, megabatch, batch)]
            assert max(chunks) - min(chunks) <= max(abs(lengths[i]) for i in mb)
    assert pure >= 9
    with pytest.raises(ValueError, match="is 0"):
        scs.group_by_modality([5, 0, -3], 1, 1, 1)


def test_group_by_modality_same_seed_same_order_everywhere():
    modalities = [("image", 3), ("text", 5), ("video", 2)] * 40
    a = scs.group_by_modality(modalities, 4, 2, 1, seed=5)
    assert a == scs.group_by_modality(list(modalities), 4, 2, 1, seed=5)
    assert a != scs.group_by_modality(modalities, 4, 2, 1, seed=6)
    assert a != scs.group_by_modality(modalities, 4, 2, 1, seed=5, epoch=1)
    with pytest.raises(ValueError, match="world_size must be"):
        scs.group_by_modality(modalities, 0, 2, 1)


def test_modality_grouped_sampler():
    modalities = ["image", "text"] * 50
    sampler = scs.ModalityGroupedSampler(modalities, 4, 2, 2, seed=9)
    assert len(sampler) == 100
    first = list(sampler)
    assert first == scs.group_by_modality(modalities, 4, 2, 2, seed=9)
    assert list(sampler) == first
    sampler.set_epoch(1)
    assert list(sampler) != first and sorted(sampler) == list(range(100))
    with pytest.raises(ValueError, match="accum must be"):
        scs.ModalityGroupedSampler(modalities, 4, 0, 2)
    with pytest.raises(ValueError, match=r"modalities\[3\]"):
        scs.ModalityGroupedSampler(["image", "text", "image", 0.5], 4, 1, 2)


def test_the_module_imports_neither_torch_nor_the_binding():
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('s', {SOURCE!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "list(m.ModalityGroupedSampler(['image', 'text'] * 8, 2, 2, 1))\n"
            "m.arrange_step([{}, {'image': 1}], 2, lambda s: s)\n"
            "bad = [n for n in sys.modules if n == 'torch' or n.startswith('shardcoord')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---------------------------------------------------------------------------------------------
# scripts/make_trace.py


def make_trace(*args):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_trace.py"), *args], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    return [json.loads(line) for line in out.splitlines()]


def test_make_trace_without_mix_still_writes_the_bundled_trace():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_trace.py"), "--world-size", "8",
                          "--group-size", "4", "--steps", "10", "--microbatches", "4", "--seed", "7"],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    with open(os.path.join(ROOT, "examples", "traces", "mixed_8ranks.jsonl")) as f:
        assert out == f.read()


def test_make_trace_arrangements_place_the_same_samples():
    # per_item calls count every media item: per rank and step (spread) or over the whole trace
    # (group_by_modality, which moves samples between ranks), the totals must not change.
    common = ["--mix", "vita15_audio_sft", "--world-size", "8", "--steps", "6", "--microbatches", "4",
              "--samples-per-microbatch", "3", "--calls", "per_item", "--seed", "4"]
    traces = {a: make_trace(*common, "--arrange", a) for a in ("none", "spread", "group_by_modality")}

    def totals(lines):
        t = collections.Counter()
        for line in lines:
            for module, calls in line["calls"].items():
                t[(line["rank"], line["step"], module)] += calls
        return t

    assert len(traces["none"]) == 8 * 6 * 4
    assert totals(traces["spread"]) == totals(traces["none"])
    summed = [sum(v for (_, _, m), v in totals(traces[a]).items() if m == mod) for a in traces
              for mod in ("model.visual", "model.audio_tower")]
    assert summed[0:2] == summed[2:4] == summed[4:6] and summed[0] > 0 and summed[1] > 0
