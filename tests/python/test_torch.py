"""shardcoord.torch in one process: the manifest (the contract's classifier on real modules),
PlanAhead against a real shardcoordd, and the Executor on a Gloo group of one (gathers are copies;
the two-rank checks are in test_trainer.py)."""

import copy
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
