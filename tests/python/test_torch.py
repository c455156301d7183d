"""shardcoord.torch in one process: the manifest (the contract's classifier on real modules),
PlanAhead against a real shardcoordd, and the Executor on a Gloo group of one (gathers are copies;
the two-rank checks are in test_trainer.py)."""

import copy
import functools
import select
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardcoord
import shardcoord.torch as sct


class Tower(nn.Module):
    def __init__(self, sizes=((4, 3), (3, 3)), attr="blocks"):
        super().__init__()
        setattr(self, attr, nn.ModuleList([nn.Linear(i, o) for i, o in sizes]))
        self._attr = attr

    def forward(self, x):
        for b in getattr(self, self._attr):
            x = torch.tanh(b(x))
        return x


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])


class AudioTower(nn.Module):  # Whisper-like: encoder.layers
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = Tower()
        self.multi_modal_projector = nn.Linear(3, 3)
        self.language_model = nn.Linear(3, 3)


class Vlm(nn.Module):
    """Hugging Face layout: model.visual (blocks), model.multi_modal_projector, model.language_model, lm_head."""

    def __init__(self, frozen_projector=False):
        super().__init__()
        self.model = Inner()
        self.audio_tower = AudioTower()
        self.embed_vision = nn.Linear(2, 2)  # A projector without a layer list: one "" unit.
        self.lm_head = nn.Linear(3, 2)
        self.model.visual.requires_grad_(False)
        self.audio_tower.requires_grad_(False)
        self.embed_vision.requires_grad_(False)
        if frozen_projector:
            self.model.multi_modal_projector.requires_grad_(False)

    def forward(self, x):
        return self.lm_head(self.model.multi_modal_projector(self.model.visual(x)))


def nbytes(*shapes):
    n = 0
    for i, o in shapes:
        n += (i * o + o) * 4
    return n


# -- manifest

def test_the_placement_kinds_are_the_native_tables_and_both_executors_share_one_home():
    """decisions.def is the one list of kinds: Python's (shardcoord.torch._placement) is the same,
    and the plain executor and shardcoord.fsdp2 use that module's rules, not copies."""
    from shardcoord._native import native
    from shardcoord.torch import _executor, _placement
    import shardcoord.fsdp2 as fsdp2

    assert set(_placement.DECISIONS) == set(native().DECISIONS), (_placement.DECISIONS, native().DECISIONS)
    assert set(_placement.PER_LAYER_HOOKS) <= set(_placement.DECISIONS)
    for name in ("PadChain", "decision_of", "padded_plan", "requires_grad"):
        assert getattr(_executor, name) is getattr(_placement, name), name
        assert getattr(fsdp2, name) is getattr(_placement, name), name
    assert _placement.decision_of("m", ("padded", 3)) == ("padded", 3)
    with pytest.raises(shardcoord.InvalidArgument, match="unknown decision 'sideways'"):
        _placement.decision_of("m", "sideways")


def test_manifest_names_units_and_bytes_and_excludes_a_trainable_projector():
    specs = sct.manifest(Vlm())
    assert [s.name for s in specs] == ["audio_tower", "embed_vision", "model.visual"]
    audio, embed, visual = specs
    assert [u.name for u in audio.units] == ["encoder.layers.0", "encoder.layers.1"]  # Auto-detected.
    assert embed.units == (shardcoord.LayerUnit("", nbytes((2, 2))),)
    assert visual.units == (shardcoord.LayerUnit("blocks.0", nbytes((4, 3))),
                            shardcoord.LayerUnit("blocks.1", nbytes((3, 3))))
    assert visual.param_bytes == nbytes((4, 3), (3, 3))
    assert not visual.outside_inner_root
    # The projector is controlled once frozen (fully frozen modules only).
    assert "model.multi_modal_projector" in [s.name for s in sct.manifest(Vlm(frozen_projector=True))]


def test_manifest_layer_lists_and_extra_names():
    model = Vlm()
    specs = {s.name: s for s in sct.manifest(model, layer_lists={"model.visual": "", "audio_tower": "encoder.layers"})}
    assert [u.name for u in specs["model.visual"].units] == [""]
    model.my_adapter = nn.Linear(2, 2).requires_grad_(False)
    assert "my_adapter" not in [s.name for s in sct.manifest(model)]
    assert "my_adapter" in [s.name for s in sct.manifest(model, extra_projectors=["my_adapter"])]
    # A tower whose layers live under "layers" (the C++ default) is found too.
    model.vision_tower = Tower(attr="layers").requires_grad_(False)
    specs = {s.name: s for s in sct.manifest(model)}
    assert [u.name for u in specs["vision_tower"].units] == ["layers.0", "layers.1"]


def test_manifest_puts_parameters_outside_the_layer_lists_in_a_rest_unit():
    model = Vlm()
    model.model.visual.patch_embed = nn.Linear(4, 4).requires_grad_(False)  # Outside `blocks`.
    model.model.visual.post_norm = nn.LayerNorm(3).requires_grad_(False)
    specs = {s.name: s for s in sct.manifest(model)}
    visual = specs["model.visual"]
    # The rest unit "" first (gathered when the module's forward starts), then the layers.
    assert visual.units == (shardcoord.LayerUnit("", nbytes((4, 4)) + 2 * 3 * 4),
                            shardcoord.LayerUnit("blocks.0", nbytes((4, 3))),
                            shardcoord.LayerUnit("blocks.1", nbytes((3, 3))))
    assert visual.param_bytes == sum(u.param_bytes for u in visual.units)
    # The whole module as one unit, when asked.
    specs = {s.name: s for s in sct.manifest(model, layer_lists={"model.visual": ""})}
    assert specs["model.visual"].units == (shardcoord.LayerUnit("", visual.param_bytes),)
    # A parameter tied between two units belongs to neither alone.
    tied = Vlm()
    tied.model.visual.blocks[1].weight = tied.model.visual.blocks[0].weight
    with pytest.raises(shardcoord.InvalidArgument, match=r"shared by several of its layers: 'blocks.0.weight'"):
        sct.manifest(tied)


def test_manifest_finds_nested_and_several_layer_lists():
    class Mllama(nn.Module):  # Mllama's vision model: a local and a global transformer.
        def __init__(self):
            super().__init__()
            self.patch_embedding = nn.Linear(2, 2)
            self.transformer = Encoder()
            self.global_transformer = Encoder()
            self.transformer.layers[0].extra = nn.ModuleList([nn.Linear(1, 1)])  # Inside a layer: that layer's.

    model = Vlm()
    model.vision_model = Mllama().requires_grad_(False)
    spec = {s.name: s for s in sct.manifest(model)}["vision_model"]
    assert [u.name for u in spec.units] == ["", "transformer.layers.0", "transformer.layers.1",
                                            "global_transformer.layers.0", "global_transformer.layers.1"]
    assert spec.units[0].param_bytes == nbytes((2, 2))
    assert spec.units[1].param_bytes == nbytes((2, 2), (1, 1))
    # Named by hand: one list; the other's layers then belong to the rest unit.
    spec = {s.name: s for s in sct.manifest(model, layer_lists={"vision_model": ["transformer.layers"]})}["vision_model"]
    assert [u.name for u in spec.units] == ["", "transformer.layers.0", "transformer.layers.1"]
    assert spec.units[0].param_bytes == nbytes((2, 2), (2, 2), (2, 2))


def test_manifest_that_controls_nothing_says_which_frozen_modules_it_saw():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.vision = Tower().requires_grad_(False)  # A tower under a name the classifier does not know.
            self.head = nn.Linear(3, 2)

    with pytest.warns(RuntimeWarning, match=r"no controlled module in Model.*frozen modules seen: 'vision' "
                                            r"\(0.0 MiB\).*extra_towers=\['vision'\]"):
        assert sct.manifest(Model()) == []
    assert [s.name for s in sct.manifest(Model(), extra_towers=["vision"])] == ["vision"]


def test_manifest_rejects_bad_layer_lists():
    with pytest.raises(shardcoord.InvalidArgument, match=r"does not have: 'model.visaul'"):
        sct.manifest(Vlm(), layer_lists={"model.visaul": "blocks"})
    with pytest.raises(shardcoord.InvalidArgument, match=r"has no submodule 'stages'"):
        sct.manifest(Vlm(), layer_lists={"model.visual": "stages"})
    with pytest.raises(shardcoord.InvalidArgument, match=r"is a Linear, not a torch.nn.ModuleList"):
        sct.manifest(Vlm(), layer_lists={"model.visual": "blocks.0"})


def test_import_shardcoord_and_its_torch_module_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import shardcoord, shardcoord.torch\n"
            "assert shardcoord.torch.with_keys\n"
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_import_shardcoord_loads_no_native_code_until_first_use():
    """Imports at the top of a script must not load gRPC, protobuf, ... before torch (python/shardcoord/_native.py)."""
    code = ("import sys, shardcoord, shardcoord.torch, shardcoord.hf, shardcoord.sampler\n"
            "from shardcoord.torch import *  # Every public name of its modules.\n"
            "assert 'shardcoord._shardcoord' not in sys.modules, 'loaded at import'\n"
            "assert shardcoord.__version__\n"
            "assert 'shardcoord._shardcoord' not in sys.modules, 'loaded for __version__'\n"
            "assert 'visual' in shardcoord.BUILTIN_TOWER_NAMES\n"
            "assert 'shardcoord._shardcoord' in sys.modules\n"
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# -- PlanAhead

MODULES = [shardcoord.ModuleSpec("model.visual", 64, (shardcoord.LayerUnit("blocks.0", 32),
                                                      shardcoord.LayerUnit("blocks.1", 32)))]


def connect(daemon, rank, **kw):
    return shardcoord.Worker("job", MODULES, 2, rank=rank, world_size=2, address=daemon.address, connect_timeout=10,
                             **kw)


def run_ranks(fns, timeout=60):
    """Runs one function per rank in threads; returns their results or raises the first error."""
    results, errors = [None] * len(fns), []

    def run(i):
        try:
            results[i] = fns[i]()
        except BaseException as e:  # noqa: B902 - reported to the test thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), f"a rank did not finish within {timeout} s"
    if errors:
        raise errors[0]
    return results


def test_plan_ahead_keeps_lookahead_plans_reported_and_yields_in_order(daemon):
    # Images per (rank, microbatch): uniform, none, divergent, uniform, divergent, none, uniform.
    media = {0: [1, 0, 1, 1, 0, 0, 1], 1: [1, 0, 0, 1, 1, 0, 1]}
    accum = 2
    with connect(daemon, 0, lookahead=3) as w0, connect(daemon, 1, lookahead=3) as w1:

        def rank(worker, r):
            batches = sct.with_keys([{"rank": r, "i": i, "images": m} for i, m in enumerate(media[r])], accum)
            ahead = sct.PlanAhead(worker, batches, lambda b: {"model.visual": b["images"]})
            assert ahead.lookahead == 3  # The group's window, as registered.
            seen = []
            for step, mb, batch, decision in ahead:
                # The plans of this and the next lookahead - 1 microbatches are reported.
                assert ahead.reported == min(len(media[r]), batch["i"] + 3)
                assert ahead.pending == [(j // accum, j % accum) for j in range(batch["i"] + 1, ahead.reported)]
                assert ahead.plan == {"model.visual": batch["images"]}, "the plan reported for this microbatch"
                seen.append(((step, mb), batch["i"], decision))
            return seen

        seen0, seen1 = run_ranks([lambda: rank(w0, 0), lambda: rank(w1, 1)])
    assert [s[0] for s in seen0] == [(i // accum, i % accum) for i in range(7)]
    assert [s[1] for s in seen0] == list(range(7))
    assert [s[2] for s in seen0] == [s[2] for s in seen1], "one identical decision per microbatch"
    kinds = [s[2]["model.visual"].decision for s in seen0]
    assert kinds == ["per_layer", "skip", "root", "per_layer", "root", "skip", "per_layer"]
    assert [s[2].seq for s in seen0] == list(range(7))


def test_plan_ahead_errors_are_the_workers(daemon):
    with connect(daemon, 0) as w0, connect(daemon, 1) as w1:
        with pytest.raises(shardcoord.InvalidArgument, match=r"lookahead 9 must be in 1..4"):
            sct.PlanAhead(w0, [], lambda b: {}, lookahead=9)
        with pytest.raises(shardcoord.InvalidArgument, match=r"unknown module 'model.vison'"):
            next(sct.PlanAhead(w0, sct.with_keys(["b"], 1), lambda b: {"model.vison": 1}))
        with pytest.raises(shardcoord.InvalidArgument, match=r"\(step, microbatch, batch\) tuples"):
            next(sct.PlanAhead(w0, ["not a tuple"], lambda b: {}))
        # Rank 1 never plans (0, 0): the wait ends at the deadline, naming it.
        ahead = sct.PlanAhead(w1, [(0, 0, "b")], lambda b: {"model.visual": 1}, timeout=0.3)
        with pytest.raises(shardcoord.DeadlineExceeded, match="has not reported its plan"):
            next(ahead)
        assert ahead.key == (0, 0)
        with pytest.raises(StopIteration):
            next(ahead)
        # Keys that do not increase: the worker's out-of-order error.
        with pytest.raises(shardcoord.FailedPrecondition, match="out-of-order"):
            next(sct.PlanAhead(w1, [(0, 0, "b")], lambda b: {}))


def test_with_keys():
    assert list(sct.with_keys("abcde", 2, start_step=3)) == [(3, 0, "a"), (3, 1, "b"), (4, 0, "c"), (4, 1, "d"),
                                                             (5, 0, "e")]
    with pytest.raises(shardcoord.InvalidArgument):
        list(sct.with_keys("a", 0))


# -- Executor on a group of one

@pytest.fixture(scope="module")
def group_of_one(tmp_path_factory):
    torch.set_num_threads(1)
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def bits(t):
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def frozen_vlm():
    torch.manual_seed(0)
    model = Vlm(frozen_projector=True)
    with torch.no_grad():  # Values whose bits matter: NaN payloads and signed zeros survive a gather.
        model.model.visual.blocks[0].weight[0, 0] = float("nan")
        model.model.visual.blocks[0].weight[0, 1] = -0.0
    return model


def decide(visual, others="skip"):
    names = ["audio_tower", "embed_vision", "model.multi_modal_projector"]
    return {"model.visual": visual, **{n: others for n in names}}


def test_executor_gathers_bitwise_and_releases_per_decision(group_of_one):
    model = frozen_vlm()
    reference = copy.deepcopy(model)
    specs = sct.manifest(model)
    ex = sct.Executor(model, specs)
    visual, ref_visual = model.model.visual, reference.model.visual
    for p in visual.parameters():
        assert p.numel() == 0 and isinstance(p, nn.Parameter), "sharded away until needed"
    x = torch.randn(5, 4)
    with torch.no_grad():
        expected = reference(x)

    # root: everything gathered at the start, bitwise, released by end_microbatch.
    ex.begin_microbatch(decide("root", "root"))
    assert ex.gathers == 2 + 2 + 1 + 1
    for p, q in zip(visual.parameters(), ref_visual.parameters()):
        assert bits(p) == bits(q)
    with torch.no_grad():
        assert bits(model(x)) == bits(expected)
    ex.end_microbatch()
    assert all(p.numel() == 0 for p in model.parameters() if not p.requires_grad)

    # per_layer: the model's own calls gather each unit right before it runs and release it after.
    seen = []
    hooks = [b.register_forward_pre_hook(lambda m, i: seen.append([p.numel() for p in visual.parameters()]))
             for b in visual.blocks]  # Run after the executor's pre-hook: what the unit's forward sees.
    ex.begin_microbatch(decide("per_layer", "per_layer"))
    assert ex.gathers == 6, "per_layer gathers nothing up front"
    with torch.no_grad():
        assert bits(model(x)) == bits(expected)
    assert seen == [[12, 3, 0, 0], [0, 0, 9, 3]], "one unit at a time"
    assert all(p.numel() == 0 for p in visual.parameters())
    ex.end_microbatch()
    for h in hooks:
        h.remove()

    # skip: running the module anyway is a precise error, not a silent wrong result.
    ex.begin_microbatch(decide("skip"))
    with pytest.raises(shardcoord.FailedPrecondition, match=r"'model.visual' is decided `skip`.*plan said 0 calls"):
        visual(x)
    ex.end_microbatch()
    with pytest.raises(shardcoord.FailedPrecondition, match=r"outside a microbatch"):
        visual(x)

    # replicate: gathered once, then resident; a later decision that is not replicate frees it.
    before = ex.gathers
    for _ in range(2):
        ex.begin_microbatch(decide("replicate"))
        with torch.no_grad():
            assert bits(visual(x)) == bits(ref_visual(x))
        ex.end_microbatch()
    assert ex.gathers == before + 2, "two units, gathered once"
    assert bits(visual.blocks[0].weight) == bits(ref_visual.blocks[0].weight)
    ex.begin_microbatch(decide("skip"))
    assert visual.blocks[0].weight.numel() == 0
    ex.end_microbatch()

    full = nbytes((4, 3), (3, 3))
    b = ex.bytes["model.visual"]
    assert (b.shard, b.resident, b.peak) == (full, full, 2 * full)  # A group of one keeps everything.
    assert b.gathered == 3 * full  # root, per_layer, replicate once.
    usage = dict((m, (r, p, g)) for m, r, p, g in ex.memory_usage())
    assert usage["model.visual"] == (full, 2 * full, 3 * full)
    assert [m for m, *_ in ex.memory_usage()] == sorted(s.name for s in specs)


def test_executor_catches_misuse(group_of_one):
    model = frozen_vlm()
    ex = sct.Executor(model, sct.manifest(model))
    with pytest.raises(shardcoord.InvalidArgument, match=r"no entry for module 'embed_vision'"):
        ex.begin_microbatch({"audio_tower": "skip"})
    ex.begin_microbatch(decide("per_layer"))
    with pytest.raises(shardcoord.FailedPrecondition, match="begin_microbatch called twice"):
        ex.begin_microbatch(decide("per_layer"))
    # Under per_layer the weights are gone after the forward: an output backward would need is refused.
    with pytest.raises(shardcoord.FailedPrecondition, match="requires grad"):
        model.model.visual(torch.randn(2, 4, requires_grad=True))
    assert all(p.numel() == 0 for p in model.model.visual.parameters())
    ex.end_microbatch()


def test_executor_padded_in_the_mapping_form(group_of_one):
    model = frozen_vlm()
    reference = copy.deepcopy(model)
    ex = sct.Executor(model, sct.manifest(model))
    visual, x = model.model.visual, torch.randn(5, 4)
    # ("padded", K), K = 3 passes, this rank planned 1 call: 2 pad passes over the 2 units now.
    ex.begin_microbatch(decide(("padded", 3)), calls={"model.visual": 1})
    assert ex.current("model.visual") == "padded"
    assert ex.gathers == 2 * 2 and all(p.numel() == 0 for p in visual.parameters()), "pads gather and release"
    with torch.no_grad():
        assert bits(visual(x)) == bits(reference.model.visual(x))
    assert ex.gathers == 3 * 2 and all(p.numel() == 0 for p in visual.parameters()), "the real call as per_layer"
    ex.end_microbatch()
    full = nbytes((4, 3), (3, 3))
    b = ex.bytes["model.visual"]
    assert (b.resident, b.gathered) == (full, 3 * full)
    assert b.peak == full + nbytes((4, 3)), "one unit at a time, never the whole module"
    # A list works as the pair; a rank that planned K calls pads nothing.
    ex.begin_microbatch(decide(["padded", 2]), calls={"model.visual": 2, "not.controlled": 5})
    assert ex.gathers == 3 * 2
    with torch.no_grad():
        visual(x)
        visual(x)
    ex.end_microbatch()
    assert ex.gathers == 5 * 2


def test_executor_padded_refuses_what_would_not_pair(group_of_one):
    model = frozen_vlm()
    ex = sct.Executor(model, sct.manifest(model))
    visual, x = model.model.visual, torch.randn(5, 4)
    refusals = [
        (decide("padded"), {"model.visual": 1}, shardcoord.InvalidArgument,
         r"module 'model.visual' is decided \"padded\" without its number of passes: give \(\"padded\", K\)"),
        (decide(("padded", 0)), {"model.visual": 0}, shardcoord.InvalidArgument, r"K must be >= 1"),
        (decide(("per_layer", 2)), None, shardcoord.InvalidArgument, r"`per_layer` with 2 passes: only `padded`"),
        (decide(("padded", "2")), None, shardcoord.InvalidArgument, r"must be a decision name, \(\"padded\", K\)"),
        (decide(("paded", 2)), None, shardcoord.InvalidArgument, r"unknown decision 'paded' for module 'model.visual'"),
        (decide(("padded", 2)), None, shardcoord.InvalidArgument,
         r"'model.visual' is decided `padded` \(2 all-gather passes on every rank\) but begin_microbatch got no calls"),
        (decide(("padded", 2)), {"audio_tower": 1}, shardcoord.InvalidArgument, r"no calls for it: pass calls="),
        (decide(("padded", 2)), {"model.visual": -1}, shardcoord.InvalidArgument, r"non-negative int"),
        (decide(("padded", 2)), {"model.visual": 3}, shardcoord.FailedPrecondition,
         r"planned 3 calls of 'model.visual', but the group's `padded` decision makes 2 passes.*disagree"),
    ]
    for decision, calls, error, message in refusals:
        with pytest.raises(error, match=message):
            ex.begin_microbatch(decision, calls=calls)
        assert ex.gathers == 0, "refused before anything gathers"
    # Fewer calls than planned: end_microbatch releases, then says the all-gathers no longer matched.
    ex.begin_microbatch(decide(("padded", 2)), calls={"model.visual": 2})
    # Runs after the executor's pre-hook gathered blocks.0.
    visual.blocks[0].register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
        visual(x)  # A forward that fails with a unit gathered.
    assert visual.blocks[0].weight.numel() == 12
    with pytest.raises(shardcoord.FailedPrecondition, match=r"'model.visual' ran 1 call\(s\), planned 2.*no longer "
                                                             r"matched the group's"):
        ex.end_microbatch()
    assert ex.resident_total_bytes == sum(b.shard for b in ex.bytes.values()), "released before raising"
    assert ex.current("model.visual") is None
    ex.begin_microbatch(decide("skip"))  # The executor goes on.
    ex.end_microbatch()


def test_executor_padded_in_the_module_decision_form(group_of_one):
    if not hasattr(shardcoord.ModuleDecision, "calls"):
        pytest.skip("this build's binding has no ModuleDecision.calls (it predates `padded`): rebuild it")
    model = frozen_vlm()
    ex = sct.Executor(model, sct.manifest(model))
    skip = shardcoord.ModuleDecision("skip", "all_skip")
    assert skip.calls == 0
    modules = {n: skip for n in decide("skip")}
    modules["model.visual"] = shardcoord.ModuleDecision("padded", "divergent", calls=2)
    d = shardcoord.Decision(0, 3, 1, 0, 7, 0, modules)
    with pytest.raises(shardcoord.InvalidArgument, match=r"got no calls for it"):
        ex.begin_microbatch(d)
    ex.begin_microbatch(d, calls={"model.visual": 0})
    assert ex.gathers == 2 * 2 and ex.current("model.visual") == "padded"
    ex.end_microbatch()
    modules["model.visual"] = shardcoord.ModuleDecision("padded", "divergent")
    with pytest.raises(shardcoord.InvalidArgument, match=r"`padded` with 0 passes: K must be >= 1"):
        ex.begin_microbatch(shardcoord.Decision(0, 3, 2, 0, 8, 0, modules), calls={"model.visual": 0})


class TwoTowers(nn.Module):
    """audio_tower, multi_modal_projector, vision_tower in manifest (path) order; the forward calls
    the audio tower once per audio input, then the vision tower once per image, then the projector."""

    def __init__(self):
        super().__init__()
        self.audio_tower = Tower(sizes=((4, 3), (3, 3))).requires_grad_(False)   # Units of 60 and 48 bytes.
        self.vision_tower = Tower(sizes=((4, 4), (4, 3))).requires_grad_(False)  # 80 and 60.
        self.multi_modal_projector = nn.Linear(3, 3).requires_grad_(False)       # 48.
        self.head = nn.Linear(3, 2)

    def forward(self, audio, images):
        x = torch.zeros(2, 3)
        for a in audio:
            x = x + self.audio_tower(a)
        for image in images:
            x = x + self.vision_tower(image)[:, :3]
        return self.head(self.multi_modal_projector(x))


def logged_executor(model):
    """An Executor on ``model`` and the log of the units it gathers ("module/unit"), in order."""
    ex = sct.Executor(model, sct.manifest(model))
    log, materialize = [], ex._materialize

    def logged(mod, unit):
        log.append(f"{mod.spec.name}/{unit.name}")
        materialize(mod, unit)

    ex._materialize = logged
    return ex, log


AUDIO = ["audio_tower/blocks.0", "audio_tower/blocks.1"]
VISION = ["vision_tower/blocks.0", "vision_tower/blocks.1"]


def test_executor_pads_several_modules_as_a_chain_in_manifest_order(group_of_one):
    torch.manual_seed(3)
    model = TwoTowers()
    reference = copy.deepcopy(model)
    ex, log = logged_executor(model)
    audio, images = [torch.randn(2, 4) for _ in range(2)], [torch.randn(2, 4)]
    # Both towers padded, the projector per_layer: this rank calls the audio tower 1 of 2 times
    # and the vision tower not at all (the other rank: 2 and 1).
    ex.begin_microbatch({"audio_tower": ("padded", 2), "vision_tower": ("padded", 1),
                         "multi_modal_projector": "per_layer"}, calls={"audio_tower": 1, "vision_tower": 0})
    assert log == AUDIO, "the audio tower's pad, then the chain waits for this rank's audio call"
    with torch.no_grad():
        out = model(audio[:1], [])
        assert bits(out) == bits(reference(audio[:1], []))
    ex.end_microbatch()
    assert log == AUDIO + AUDIO + VISION + ["multi_modal_projector/"], "the vision pad after the audio call"
    # The reverse: this rank pads the audio tower and calls the vision tower.
    del log[:]
    ex.begin_microbatch({"audio_tower": ("padded", 1), "vision_tower": ("padded", 1),
                         "multi_modal_projector": "per_layer"}, calls={"audio_tower": 0, "vision_tower": 1})
    with torch.no_grad():
        assert bits(model([], images)) == bits(reference([], images))
    ex.end_microbatch()
    assert log == AUDIO + VISION + ["multi_modal_projector/"]
    # Both called: no pad at all; neither: every pad at begin_microbatch.
    for calls, pads in (({"audio_tower": 1, "vision_tower": 1}, []), ({"audio_tower": 0, "vision_tower": 0},
                                                                        AUDIO + VISION)):
        del log[:]
        ex.begin_microbatch({"audio_tower": ("padded", 1), "vision_tower": ("padded", 1),
                             "multi_modal_projector": "skip"}, calls=calls)
        assert log == pads
        with torch.no_grad():
            for _ in range(calls["audio_tower"]):
                model.audio_tower(audio[0])
            for _ in range(calls["vision_tower"]):
                model.vision_tower(images[0])
        ex.end_microbatch()
        assert log == AUDIO + VISION
    assert ex.peak_total_bytes == sum(b.shard for b in ex.bytes.values()) + 80, "one unit at a time"


def test_executor_refuses_calls_out_of_the_chains_order(group_of_one):
    model = TwoTowers()
    ex, log = logged_executor(model)
    x = torch.randn(2, 4)
    padded = {"audio_tower": ("padded", 1), "vision_tower": ("padded", 1), "multi_modal_projector": "per_layer"}
    ex.begin_microbatch(padded, calls={"audio_tower": 1, "vision_tower": 0})
    # (a) A padded module before an earlier one's calls ended.
    with pytest.raises(shardcoord.FailedPrecondition,
                       match=r"'vision_tower' is called while padded module 'audio_tower' has not finished its 1 "
                             r"planned call\(s\) of the microbatch \(0 begun\).*'audio_tower' before 'vision_tower'.*"
                             r"make the forward run every call of 'audio_tower' before the first of 'vision_tower', "
                             r"or order the manifest"):
        model.vision_tower(x)
    # (b) Another controlled module while a padded module has calls left.
    with pytest.raises(shardcoord.FailedPrecondition,
                       match=r"'multi_modal_projector' is called while padded module 'audio_tower' has not finished.*"
                             r"'multi_modal_projector' is decided `per_layer`: every rank makes the padded modules' "
                             r"passes before any other controlled module's call.*run the padded modules"):
        model.multi_modal_projector(torch.randn(2, 3))
    assert log == [] and all(p.numel() == 0 for p in model.parameters() if not p.requires_grad), \
        "refused before anything gathered"
    with torch.no_grad():
        model.audio_tower(x)  # The chain goes on: the vision tower's pad; then everything is in order.
        model.multi_modal_projector(torch.randn(2, 3))
        with pytest.raises(shardcoord.FailedPrecondition, match=r"'audio_tower' is called under `padded` \(call 2 "
                                                                 r"of the microbatch\), but this rank planned 1"):
            model.audio_tower(x)
    assert log == AUDIO + VISION + ["multi_modal_projector/"]
    with pytest.raises(shardcoord.FailedPrecondition, match=r"'audio_tower' ran 2 call\(s\), planned 1"):
        ex.end_microbatch()
    # A rank that never makes its audio call holds the vision tower's pad back: end_microbatch says so.
    ex.begin_microbatch(padded, calls={"audio_tower": 1, "vision_tower": 0})
    with pytest.raises(shardcoord.FailedPrecondition,
                       match=r"'audio_tower' ran 0 call\(s\), planned 1.*; 'vision_tower': the chain stopped at "
                             r"'audio_tower', whose planned calls were not all made, so its 1 pad pass\(es\) were not "
                             r"issued\. Its all-gathers no longer matched"):
        ex.end_microbatch()
    # Only a padded module's own calls are ordered: with none padded, any order goes.
    ex.begin_microbatch({name: "per_layer" for name in padded})
    with torch.no_grad():
        model.vision_tower(x)
        model.audio_tower(x)
    ex.end_microbatch()


def test_executor_rejects_what_it_cannot_shard(group_of_one):
    model = frozen_vlm()
    specs = sct.manifest(model)
    with pytest.raises(shardcoord.InvalidArgument, match=r"'no_such_module' is not in the model"):
        sct.Executor(model, specs + [shardcoord.ModuleSpec("no_such_module", 0)])
    model.model.visual.blocks[1].bias.requires_grad_(True)
    with pytest.raises(shardcoord.InvalidArgument, match=r"trainable parameters 'blocks.1.bias'"):
        sct.Executor(model, specs)
    model = frozen_vlm()
    model.model.visual.blocks[1].double()
    model.model.visual.blocks[1].bias.data = model.model.visual.blocks[1].bias.data.float()
    with pytest.raises(shardcoord.InvalidArgument, match=r"unit 'blocks.1' of 'model.visual' mixes dtypes"):
        sct.Executor(model, specs)
    model = frozen_vlm()
    model.model.visual.extra = nn.Linear(1, 1).requires_grad_(False)
    # A manifest made before the model grew a parameter outside its layers has no rest unit for it.
    with pytest.raises(shardcoord.InvalidArgument, match=r"outside the units its manifest names: 'extra.weight'"):
        sct.Executor(model, specs)
    # Nothing was sharded by a refused construction (other modules were fine).
    assert model.model.visual.blocks[0].weight.numel() == 12
    assert model.audio_tower.encoder.layers[0].weight.numel() == 4
    with pytest.raises(shardcoord.InvalidArgument, match=r"the shard group has ranks \[0, 1\]"):
        sct.Executor(model, specs, shardcoord.GroupInfo(0, [0, 1], 0, "auto", "root", 4, []))


# -- a failed collective names the cause

class FakeWorker:
    """health() as the worker's: raises once the coordinator failed the group."""

    def __init__(self, fails_after=None):
        self.fails_at = None if fails_after is None else time.monotonic() + fails_after

    def health(self):
        if self.fails_at is not None and time.monotonic() >= self.fails_at:
            raise shardcoord.GroupFailed("group 0 of job 'j' failed at epoch 0: rank 1 declared dead: session lost")

    job_health = health  # No other groups here.


def test_a_failed_collective_raises_the_coordinators_verdict():
    # The verdict arrives shortly after the socket error: it is what the trainer sees.
    with pytest.raises(shardcoord.GroupFailed, match="rank 1 declared dead") as info:
        with sct.collective(FakeWorker(fails_after=0.2), "gradient all-reduce", wait=5):
            raise RuntimeError("[gloo] Connection closed by peer")
    assert isinstance(info.value.__cause__, RuntimeError)
    # No verdict within the wait (e.g. the lost rank is in another shard group): the collective's error.
    start = time.monotonic()
    with pytest.raises(shardcoord.GroupFailed, match=r"gradient all-reduce failed: \[gloo\] Connection closed"):
        with sct.collective(FakeWorker(), "gradient all-reduce", wait=0.2):
            raise RuntimeError("[gloo] Connection closed by peer")
    assert time.monotonic() - start < 5
    with pytest.raises(shardcoord.GroupFailed, match="all-gather failed: boom"):
        with sct.collective(None, "all-gather"):
            raise RuntimeError("boom")
    # Other errors pass through unchanged.
    with pytest.raises(shardcoord.DeadlineExceeded):
        with sct.collective(FakeWorker(0), "x"):
            raise shardcoord.DeadlineExceeded("late")
    with pytest.raises(KeyError):
        with sct.collective(FakeWorker(0), "x"):
            raise KeyError("k")


# -- FailureWatch: the coordinator's verdict reaches a training loop that is busy elsewhere

RANK_ONE = """
import sys, time, shardcoord
units = (shardcoord.LayerUnit("blocks.0", 32), shardcoord.LayerUnit("blocks.1", 32))
w = shardcoord.Worker("job", [shardcoord.ModuleSpec("model.visual", 64, units)], 2, rank=1, world_size=2,
                      address=sys.argv[1], connect_timeout=10)
print("registered", flush=True)
time.sleep(120)
"""


def test_failure_watch_keeps_the_verdict_naming_the_killed_rank(daemon, wait_for):
    rank1 = subprocess.Popen([sys.executable, "-c", RANK_ONE, daemon.address], stdout=subprocess.PIPE, text=True)
    try:
        with connect(daemon, 0) as w0:
            ready, _, _ = select.select([rank1.stdout], [], [], 30)  # Bounded: never wait forever.
            assert ready and rank1.stdout.readline().strip() == "registered", f"rank 1 exited {rank1.poll()}"
            aborted = []
            watch = sct.FailureWatch(w0, process_groups=["pg"], poll=0.02)
            watch._abort = aborted.append  # The seam: which groups it aborts (torch 1.13 cannot abort Gloo).
            with watch:
                watch.check()  # No failure yet: returns.
                assert watch.verdict is None
                rank1.kill()
                wait_for(lambda: watch.verdict is not None, 15, "the watch to see the group failure")
                with pytest.raises(shardcoord.GroupFailed, match="rank 1 declared dead"):
                    watch.check()
                # The watch publishes the verdict, then aborts the groups (on its own thread).
                wait_for(lambda: aborted == ["pg"], 15, "the watch to abort the process group")
    finally:
        rank1.kill()
        rank1.wait(10)


def test_failure_watch_is_quiet_when_the_worker_closes(daemon, wait_for):
    with connect(daemon, 0) as w0, connect(daemon, 1) as w1:
        aborted = []
        watch = sct.FailureWatch(w0, process_groups=[None], poll=0.02)
        watch._abort = aborted.append
        watch.start()
        w0.close()  # A clean end while the watch still runs: no verdict, nothing aborted.
        polls = watch.polls
        wait_for(lambda: watch.polls >= polls + 5 or not watch.running, 15, "the watch to poll the closed worker")
        watch.stop()
        w1.close()
    assert watch.verdict is None and aborted == []
    with pytest.raises(shardcoord.InvalidArgument, match="poll must be > 0"):
        sct.FailureWatch(w0, poll=0)


def test_abort_process_group_on_this_torch(group_of_one):
    # torch 1.13 with Gloo has no abort: False, and the group still works; torch >= 2.6 aborts.
    pg = dist.new_group([0])
    can = sct.abort_process_group(pg)
    assert can == hasattr(dist.distributed_c10d, "_abort_process_group")
    if not can:
        t = torch.ones(2)
        dist.all_reduce(t, group=pg)
        assert t.tolist() == [1.0, 1.0]


class _WorkCompletingRightAfterThePollTimedOut:
    """A torch.distributed Work whose collective completes (successfully) just after a poll's
    wait timed out: wait(timeout) raises "Operation timed out!", is_completed() is then True."""

    def __init__(self):
        self.polls = 0

    def wait(self, timeout=None):
        if timeout is not None:
            self.polls += 1
            raise RuntimeError("Operation timed out!")
        return True

    def is_completed(self):
        return self.polls > 0


class _HealthyWorker:
    def job_health(self):
        return None


def test_a_collective_completing_just_after_a_poll_timed_out_is_no_failure():
    """Issue 25: python.trainer failed once on a loaded host with "gradient all-reduce failed:
    Operation timed out!": the poll's own timeout, taken for the collective's failure because
    the collective completed between the poll's timeout and the completion check."""
    work = _WorkCompletingRightAfterThePollTimedOut()
    sct.wait_collective(work, _HealthyWorker(), "gradient all-reduce", verdict_wait=0.01)
    assert work.polls == 1


class _FailedWork(_WorkCompletingRightAfterThePollTimedOut):
    def wait(self, timeout=None):
        if timeout is not None:
            self.polls += 1
        raise RuntimeError("Connection closed by peer")


def test_a_collective_that_failed_raises_its_own_error():
    with pytest.raises(shardcoord.GroupFailed, match="gradient all-reduce failed: Connection closed by peer"):
        sct.wait_collective(_FailedWork(), _HealthyWorker(), "gradient all-reduce", verdict_wait=0.01)


# -- fsdp2's `padded` with stand-in FSDP units (torch 1.13 has no FSDP2; the real two-rank check
#    with FSDP2 is tests/gpu/fsdp2_check.py, padded_divergent)

class _FakeFsdp:
    """What shardcoord.fsdp2.shard uses of fully_shard, on one module: its pre-forward hook
    (registered at fully_shard, so before any hook registered later) all-gathers the unit unless
    unsharded and prefetches the next one, its post-forward hook reshards it. Each all-gather is
    logged by the unit's name."""

    def __init__(self, module, name, log):
        self.module, self.name, self.log = module, name, log
        self.unsharded, self.reshard_after_forward, self.prefetch = False, True, []
        module.register_forward_pre_hook(lambda m, a: self.pre_forward())
        module.register_forward_hook(lambda m, a, o: self.reshard() if self.reshard_after_forward else None)
        for method in ("unshard", "reshard", "set_reshard_after_forward", "set_unshard_in_backward",
                       "set_modules_to_forward_prefetch"):
            setattr(module, method, getattr(self, method))

    def unshard(self, async_op=False):
        if not self.unsharded:
            self.log.append(self.name)
            self.unsharded = True

    def reshard(self):
        self.unsharded = False

    def pre_forward(self):
        self.unshard()
        for following in self.prefetch:
            following.unshard()

    def set_reshard_after_forward(self, value, recurse=True):
        self.reshard_after_forward = value

    def set_unshard_in_backward(self, value):
        pass

    def set_modules_to_forward_prefetch(self, modules):
        self.prefetch = modules


class _PaddedVlm(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = Tower(sizes=((4, 4), (4, 4), (4, 4))).requires_grad_(False)
        self.head = nn.Linear(4, 2)

    def forward(self, images):
        x = torch.zeros(1, 4)
        for image in images:
            x = x + self.visual(image)
        return self.head(x)


def _fsdp2_rank(monkeypatch, model_class=_PaddedVlm):
    """A model sharded by fsdp2.shard over the stand-in, its control and its all-gather log."""
    from shardcoord import fsdp2

    log, wrapped = [], set()

    def fake_fully_shard(m, **kw):
        _FakeFsdp(m, "root" if m is model else names[id(m)], log)
        wrapped.add(id(m))

    monkeypatch.setattr(fsdp2, "fully_shard", fake_fully_shard)
    monkeypatch.setattr(fsdp2, "_is_fsdp", lambda m: id(m) in wrapped)
    model = model_class()
    names = {id(m): n for n, m in model.named_modules()}
    ctl = fsdp2.shard(model, sct.manifest(model))
    return model, ctl, log


def test_fsdp2_padded_issues_the_busiest_ranks_passes_after_the_root_gather(monkeypatch):
    blocks = ["visual.blocks.0", "visual.blocks.1", "visual.blocks.2"]
    for calls in ([2, 0], [3, 1], [1, 2]):
        logs = []
        for rank in range(2):
            model, ctl, log = _fsdp2_rank(monkeypatch)
            ctl.begin_microbatch({"visual": ("padded", max(calls))}, calls={"visual": calls[rank]})
            assert log == [], "pads come in the model's forward, after FSDP's root all-gather"
            with torch.no_grad():
                model([torch.randn(1, 4) for _ in range(calls[rank])])
            ctl.end_microbatch()
            logs.append(log)
        assert logs[0] == logs[1] == ["root"] + blocks * max(calls), (calls, logs)
    # A forward with no microbatch (evaluation) pads nothing; the next microbatch still pads.
    model, ctl, log = _fsdp2_rank(monkeypatch)
    with torch.no_grad():
        model([])
    ctl.begin_microbatch({"visual": ("padded", 1)}, calls={"visual": 0})
    model([])
    ctl.end_microbatch()
    assert log == ["root", "root"] + blocks


def test_fsdp2_padded_refuses_what_would_not_pair(monkeypatch):
    model, ctl, log = _fsdp2_rank(monkeypatch)
    with pytest.raises(shardcoord.InvalidArgument, match=r"without its number of passes: give \("):
        ctl.begin_microbatch({"visual": "padded"}, calls={"visual": 1})
    with pytest.raises(shardcoord.InvalidArgument, match=r"'visual' is decided `padded` .* got no calls for it"):
        ctl.begin_microbatch({"visual": ("padded", 2)})
    with pytest.raises(shardcoord.FailedPrecondition, match=r"planned 3 calls of 'visual', but .* makes 2 passes"):
        ctl.begin_microbatch({"visual": ("padded", 2)}, calls={"visual": 3})
    # Called before the model's forward: the pads would come after this call's all-gathers.
    ctl.begin_microbatch({"visual": ("padded", 2)}, calls={"visual": 1})
    with pytest.raises(shardcoord.FailedPrecondition, match=r"before the model's forward started"):
        model.visual(torch.randn(1, 4))
    with pytest.raises(shardcoord.FailedPrecondition, match=r"the model's forward never ran, so its 1 pad pass"):
        ctl.end_microbatch()
    # A call beyond the plan is refused before it gathers; end_microbatch says so too.
    ctl.begin_microbatch({"visual": ("padded", 2)}, calls={"visual": 1})
    del log[:]
    with pytest.raises(shardcoord.FailedPrecondition, match=r"\(call 2 of the microbatch\), but this rank planned 1"), \
            torch.no_grad():
        model([torch.randn(1, 4), torch.randn(1, 4)])
    assert log == ["root"] + ["visual.blocks.0", "visual.blocks.1", "visual.blocks.2"] * 2
    with pytest.raises(shardcoord.FailedPrecondition, match=r"'visual' ran 2 call\(s\), planned 1.*stop the job"):
        ctl.end_microbatch()
    # Fewer calls than planned.
    ctl.begin_microbatch({"visual": ("padded", 2)}, calls={"visual": 2})
    with torch.no_grad():
        model([torch.randn(1, 4)])
    with pytest.raises(shardcoord.FailedPrecondition, match=r"'visual' ran 1 call\(s\), planned 2"):
        ctl.end_microbatch()
    ctl.begin_microbatch({"visual": "per_layer"})  # It goes on.
    ctl.end_microbatch()


def test_fsdp2_pads_several_modules_as_a_chain_in_manifest_order(monkeypatch):
    audio, vision = ["audio_tower.blocks.0", "audio_tower.blocks.1"], ["vision_tower.blocks.0", "vision_tower.blocks.1"]
    # [rank 0, rank 1] calls of (audio_tower, vision_tower): one rank calls the audio tower and pads
    # the vision tower, the other the reverse; one calls both (and more), the other neither.
    for calls in ([(1, 0), (0, 1)], [(2, 1), (0, 0)], [(0, 2), (1, 1)]):
        k = [max(c[i] for c in calls) for i in range(2)]
        logs = []
        for rank in range(2):
            model, ctl, log = _fsdp2_rank(monkeypatch, TwoTowers)
            a, v = calls[rank]
            ctl.begin_microbatch({"audio_tower": ("padded", k[0]), "vision_tower": ("padded", k[1]),
                                  "multi_modal_projector": "per_layer"}, calls={"audio_tower": a, "vision_tower": v})
            with torch.no_grad():
                model([torch.randn(2, 4)] * a, [torch.randn(2, 4)] * v)
            ctl.end_microbatch()
            logs.append(log)
        assert logs[0] == logs[1] == ["root"] + audio * k[0] + vision * k[1], (calls, logs)


def test_fsdp2_refuses_calls_out_of_the_chains_order(monkeypatch):
    model, ctl, log = _fsdp2_rank(monkeypatch, TwoTowers)
    assert ctl.left_in_root == ["multi_modal_projector"], "no layer list: in the root unit, gathers nothing itself"
    padded = {"audio_tower": ("padded", 1), "vision_tower": ("padded", 1), "multi_modal_projector": "per_layer"}
    x = torch.randn(2, 4)
    ctl.begin_microbatch(padded, calls={"audio_tower": 1, "vision_tower": 0})
    with pytest.raises(shardcoord.FailedPrecondition, match=r"'audio_tower' is called before the model's forward "
                                                            r"started while modules are decided `padded`"):
        model.audio_tower(x)
    # (a) A forward that calls the vision tower before the audio tower.
    with pytest.raises(shardcoord.FailedPrecondition,
                       match=r"fsdp2: 'vision_tower' is called while padded module 'audio_tower' has not finished its "
                             r"1 planned call\(s\).*'audio_tower' before 'vision_tower'"), torch.no_grad():
        model([], [x])
    assert log == ["root"], "refused before its units gathered (the audio tower: no pad, 1 call of 1 planned)"
    with pytest.raises(shardcoord.FailedPrecondition, match=r"'audio_tower' ran 0 call\(s\), planned 1.*'vision_tower'"
                                                            r": the chain stopped at 'audio_tower'"):
        ctl.end_microbatch()
    # (b) A module that is not padded, called while a padded one has calls left.
    ctl.begin_microbatch({"audio_tower": "per_layer", "vision_tower": ("padded", 1),
                          "multi_modal_projector": "per_layer"}, calls={"audio_tower": 1, "vision_tower": 1})
    with pytest.raises(shardcoord.FailedPrecondition,
                       match=r"fsdp2: 'audio_tower' is called while padded module 'vision_tower' has not finished.*"
                             r"'audio_tower' is decided `per_layer`: every rank makes the padded modules' passes "
                             r"before any other"), torch.no_grad():
        model([x], [x])
    assert log == ["root"], "refused before its units gathered (the stand-in's root stayed gathered: it raised)"
    with pytest.raises(shardcoord.FailedPrecondition, match=r"'vision_tower' ran 0 call\(s\), planned 1"):
        ctl.end_microbatch()
    # In order: the vision tower's pad comes after the audio call ends.
    del log[:]
    ctl.begin_microbatch(padded, calls={"audio_tower": 1, "vision_tower": 0})
    with torch.no_grad():
        model([x], [])
    ctl.end_microbatch()
    assert [u for u in log if u != "root"] == ["audio_tower.blocks.0", "audio_tower.blocks.1",
                                               "vision_tower.blocks.0", "vision_tower.blocks.1"]


# -- fsdp2 with a trainable tower, over stand-in FSDP2 parameter groups (torch 1.13 has no FSDP2;
#    the real check is scripts/gpu/trainable_tower_check.py). The stand-in reduce-scatters a
#    unit's gradients in post_backward when reduce_grads is set, as FSDP2 does, and logs it: every
#    rank of a group must log the same reduce-scatters, whatever it called.

class _FakeParamGroup:
    """What shardcoord.fsdp2 uses of FSDP2's FSDPParamGroup for a trainable unit."""

    def __init__(self, name, unit, fake, log):
        import enum
        from types import SimpleNamespace

        self.name, self.log, self._fake = name, log, fake
        self.states = enum.Enum("TrainingState", "IDLE POST_BACKWARD")
        self.fsdp_params = [SimpleNamespace(_unsharded_param=p, sharded_param=p, unsharded_accumulated_grad=None,
                                            accumulate_unsharded_grad_if_needed=lambda: None,
                                            to_accumulated_grad_if_needed=lambda: None) for p in unit.parameters()]
        self.reduce_grads, self.reshard_after_backward = True, True
        self._training_state = self.states.IDLE
        self.comm_ctx = SimpleNamespace(reduce_scatter_state=None)
        self.recorded = 0
        unit._get_fsdp_state = lambda: SimpleNamespace(_fsdp_param_group=self)

    @property
    def is_unsharded(self):
        return self._fake.unsharded

    def _record_post_forward(self):
        self.recorded += 1

    def post_backward(self, *unused):
        self._training_state = self.states.POST_BACKWARD
        if not self.reduce_grads:
            return  # Accumulated: the gradients stay on the parameters.
        held = [fp._unsharded_param for fp in self.fsdp_params if fp._unsharded_param.grad is not None]
        for p in held:
            p.grad = None
        if held:
            self.log.append(f"reduce_scatter {self.name}")
        if self.reshard_after_backward:
            self._fake.reshard()

    def finalize_backward(self):
        pass


class _TrainableVlm(_PaddedVlm):
    def __init__(self):
        super().__init__()
        self.visual.requires_grad_(True)
        self.embed_tokens = nn.Embedding(8, 4).requires_grad_(False)  # Frozen input embeddings.

    def get_input_embeddings(self):
        return self.embed_tokens


def _fsdp2_trainable_rank(monkeypatch):
    """The trainable tower sharded by fsdp2.shard over the stand-ins: (model, control, step), where
    step(calls, decision, sync) runs one microbatch as FSDP2 would (its autograd post-backward per
    call of a unit, in reverse, then its final callback on every unit not yet reduced) and returns
    the reduce-scatters logged."""
    from shardcoord import fsdp2

    log, wrapped, groups, ran = [], set(), {}, []

    def forward_ran(name, *unused):  # FSDP2's post-forward: the forward order recorded.
        ran.append(name)
        groups[name]._record_post_forward()

    def fake_fully_shard(m, **kw):
        name = "root" if m is model else names[id(m)]
        fake = _FakeFsdp(m, name, [])
        wrapped.add(id(m))
        if m is not model:
            groups[name] = _FakeParamGroup(name, m, fake, log)
            m.register_forward_hook(functools.partial(forward_ran, name))

    monkeypatch.setattr(fsdp2, "fully_shard", fake_fully_shard)
    monkeypatch.setattr(fsdp2, "_is_fsdp", lambda m: id(m) in wrapped)
    model = _TrainableVlm()
    names = {id(m): n for n, m in model.named_modules()}
    specs = sct.manifest(model, trainable=["visual"])
    assert [(s.name, s.trainable) for s in specs] == [("visual", True)]
    ctl = fsdp2.shard(model, specs)

    def step(calls, decision, sync=True):
        del log[:], ran[:]
        for g in groups.values():
            g.reduce_grads = sync  # What set_requires_gradient_sync (accelerate's no_sync) sets.
        ctl.begin_microbatch({"visual": decision}, calls={"visual": calls})
        model([torch.ones(1, 4)] * calls).sum().backward()
        for name in reversed(ran):  # FSDP2's post-backward hook, per call of a unit.
            groups[name].post_backward()
        for g in groups.values():  # Its final callback.
            if g._training_state != g.states.POST_BACKWARD:
                g.post_backward()
            g._training_state = g.states.IDLE
        ctl.end_microbatch()
        return list(log)

    return model, ctl, step, groups


def test_fsdp2_trainable_tower_reduce_scatters_alike_on_every_rank(monkeypatch):
    units = [f"reduce_scatter visual.blocks.{i}" for i in range(3)]
    # root: one rank calls the tower twice, the other not at all; both reduce each unit once, in
    # manifest order, after the backward (the one that did not call it with zeros).
    _, _, busy, _ = _fsdp2_trainable_rank(monkeypatch)
    _, _, idle, _ = _fsdp2_trainable_rank(monkeypatch)
    assert busy(2, "root") == idle(0, "root") == units
    # per_layer: every rank calls it alike, and FSDP reduces each unit after its backward.
    assert busy(1, "per_layer") == idle(1, "per_layer") == list(reversed(units))
    # skip with nothing pending: nothing.
    assert busy(0, "skip") == idle(0, "skip") == []
    # Accumulation: a root microbatch without sync, then a skip that syncs: the busy rank's
    # pending gradients are reduced with the idle rank's zeros, at the end of the syncing one.
    assert busy(1, "root", sync=False) == idle(0, "root", sync=False) == []
    assert busy(0, "skip") == idle(0, "skip") == units
    # per_layer without sync, then skip with sync: the same.
    assert busy(1, "per_layer", sync=False) == idle(1, "per_layer", sync=False) == []
    assert busy(0, "skip") == idle(0, "skip") == units


def test_fsdp2_trainable_tower_records_its_forward_only_under_per_layer(monkeypatch):
    _, _, step, groups = _fsdp2_trainable_rank(monkeypatch)
    step(1, "root")
    assert [g.recorded for g in groups.values()] == [0, 0, 0], "no backward prefetch under root"
    step(1, "per_layer")
    assert [g.recorded for g in groups.values()] == [1, 1, 1]


def test_fsdp2_trainable_tower_makes_the_decoder_input_need_grad_on_every_rank(monkeypatch):
    # With frozen embeddings the decoder's input would need grad only where media joined it, and
    # FSDP2 would reduce the first decoder unit at another point on the other ranks.
    model, _, _, _ = _fsdp2_trainable_rank(monkeypatch)
    ids = torch.tensor([[1, 2]])
    out = model.get_input_embeddings()(ids)
    assert out.requires_grad and out.grad_fn is None, "a leaf that needs grad: no parameter's gradient changes"
    with torch.no_grad():
        assert not model.get_input_embeddings()(ids).requires_grad
    # A frozen tower: the embeddings are left as they are.
    frozen, _, _ = _fsdp2_rank(monkeypatch, model_class=lambda: _TrainableVlm().requires_grad_(False))
    assert not frozen.get_input_embeddings()(ids).requires_grad


def test_fsdp2_trainable_tower_refuses_padded_and_replicate(monkeypatch):
    _, ctl, _, _ = _fsdp2_trainable_rank(monkeypatch)
    for decision in (("padded", 2), "replicate"):
        with pytest.raises(shardcoord.FailedPrecondition, match=r"trainable module\(s\) 'visual' \((padded|replicate)\)"):
            ctl.begin_microbatch({"visual": decision}, calls={"visual": 1})


def test_manifest_opts_trainable_towers_in_by_name_and_refuses_unknown_names():
    model = _TrainableVlm()
    with pytest.warns(RuntimeWarning, match=r"opt them in with trainable=True or trainable=\['visual'\]"):
        assert sct.manifest(model) == []
    assert [s.trainable for s in sct.manifest(model, trainable=True)] == [True]
    with pytest.raises(shardcoord.InvalidArgument, match=r"trainable names 'vision', which the model has no tower"):
        sct.manifest(model, trainable=["vision"])
    model.visual.requires_grad_(False)
    assert [s.trainable for s in sct.manifest(model, trainable=True)] == [False], "frozen stays frozen"


def test_the_plain_executor_takes_a_trainable_tower_opted_in_and_refuses_padded_and_replicate_for_it():
    model = _TrainableVlm()
    with pytest.raises(shardcoord.InvalidArgument, match=r"only fully frozen modules are controlled, and those opted "
                                                         r"in as trainable"):
        sct.Executor(model, [shardcoord.ModuleSpec("visual", 0, (shardcoord.LayerUnit("", 0),))],
                     rank_in_group=0, group_size=1)
    ex = sct.Executor(model, sct.manifest(model, trainable=True), rank_in_group=0, group_size=1)
    assert model.visual.blocks[0].weight.numel() == 16, "trainable parameters are not sharded"
    for decision in (("padded", 2), "replicate"):
        with pytest.raises(shardcoord.FailedPrecondition, match=r"trainable module\(s\) 'visual'"):
            ex.begin_microbatch({"visual": decision}, calls={"visual": 1})
