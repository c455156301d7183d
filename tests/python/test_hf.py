"""shardcoord.hf: the plans it reads off processor batches equal the calls the model's forward makes.

Every family of tests/python/hf_lookalikes.py (the module trees and call rules of transformers 5.x,
checked against the real classes by scripts/gpu/hf_calls_check.py) runs every batch kind (text only,
one image, several images, video, images and videos, audio, ...) with forward pre-hooks counting the
calls of its tower, projector and connector; tower_calls must say the same. No daemon, no
transformers."""

import functools
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import hf_lookalikes as L
import shardcoord
import shardcoord.hf as hf
import shardcoord.torch as sct

CASES = [(name, kind) for name in L.FAMILIES for kind in L.KINDS[name]]
# Idefics3 / SmolVLM's ``model.connector``: a controlled module only where the contract's projector
# names include "connector" (else only with extra_projectors=("connector",)).
CONNECTOR = "connector" in shardcoord.BUILTIN_PROJECTOR_NAMES


@functools.lru_cache(maxsize=None)
def frozen_model(name):
    return L.freeze_towers(L.FAMILIES[name]())


def run_counting(model, paths, batch):
    """Runs the forward; returns ({path: calls}, the exception it raised or None). A call is counted when
    the module is entered (a pre-hook), as the executor gathers there."""
    counts = {p: 0 for p in paths}
    hooks = [model.get_submodule(p).register_forward_pre_hook(
        lambda module, args, p=p: counts.__setitem__(p, counts[p] + 1)) for p in paths]
    try:
        model(**batch)
        raised = None
    except Exception as e:  # noqa: BLE001 -- the failing kinds
        raised = e
    finally:
        for h in hooks:
            h.remove()
    return counts, raised


@pytest.mark.parametrize("name,kind", CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_tower_calls_equal_the_forwards_calls(name, kind):
    model = frozen_model(name)
    batch = L.make_batch(name, kind)
    counts, raised = run_counting(model, L.FROZEN[name], batch)
    if (name, kind) in L.FAILING:
        # The forward cannot run this batch (as transformers' cannot); the plan is refused up front.
        assert raised is not None
        with pytest.raises(shardcoord.InvalidArgument):
            hf.tower_calls(model, batch, extra_projectors=("connector",))
        return
    assert raised is None
    assert hf.tower_calls(model, batch, extra_projectors=("connector",)) == counts
    # Without the extra name, the connector is controlled only where the contract names it.
    expected = {p: n for p, n in counts.items() if CONNECTOR or not p.endswith(".connector")}
    assert hf.tower_calls(model, batch) == expected
    # By family name: the canonical paths, the same counts.
    assert hf.tower_calls(name, batch) == expected
    assert hf.plan_fn(model)(batch) == expected


def test_images_and_videos_are_two_calls_of_the_qwen_tower():
    for name in ("qwen2_vl", "qwen2_5_vl"):
        assert hf.tower_calls(name, L.make_batch(name, "image+video")) == {"model.visual": 2}
        assert hf.tower_calls(name, L.make_batch(name, "text")) == {"model.visual": 0}
    assert hf.tower_calls("llava_onevision", L.make_batch("llava_onevision", "image+video")) == {
        "model.vision_tower": 2, "model.multi_modal_projector": 2}


def test_only_controlled_modules_are_named():
    model = L.freeze_towers(L.FAMILIES["llava"](), projector=False)  # the projector is trained
    batch = L.make_batch("llava", "image")
    assert hf.tower_calls(model, batch) == {"model.vision_tower": 1}
    assert hf.plan_fn(model).modules == ("model.vision_tower",)
    assert hf.tower_calls(L.FAMILIES["llava"](), batch) == {}  # nothing frozen: nothing to plan
    idefics = frozen_model("idefics3")
    assert hf.plan_fn(idefics).modules == (("model.connector",) if CONNECTOR else ()) + ("model.vision_model",)
    assert hf.plan_fn(idefics, extra_projectors=("connector",)).modules == ("model.connector", "model.vision_model")


def test_trainable_towers_opted_in_are_planned_as_the_manifest_controls_them():
    model = L.FAMILIES["llava"]()  # Nothing frozen: the tower and the projector train.
    batch = L.make_batch("llava", "image")
    assert hf.plan_fn(model, trainable=["vision_tower"]).modules == ("model.vision_tower",)
    assert hf.plan_fn(model, trainable=True)(batch) == {"model.vision_tower": 1, "model.multi_modal_projector": 1}
    specs = sct.manifest(model, trainable=True, layer_lists={"model.multi_modal_projector": ""})
    assert sorted((s.name, s.trainable) for s in specs) == [("model.multi_modal_projector", True),
                                                            ("model.vision_tower", True)]
    with pytest.raises(shardcoord.InvalidArgument, match=r"trainable must be True, False or module names"):
        hf.plan_fn(model, trainable=[3])


def test_plan_names_are_the_manifests_modules():
    # A plan naming a module the manifest lacks is rejected by the coordinator ("unknown module").
    for name in L.FAMILIES:
        model = frozen_model(name)
        plan_modules = hf.plan_fn(model).modules
        specs = sct.manifest(model, layer_lists={p: "" for p in plan_modules})
        assert sorted(s.name for s in specs) == sorted(plan_modules), name


def test_paths_of_inner_and_wrapped_models():
    model = frozen_model("qwen2_vl")
    batch = L.make_batch("qwen2_vl", "image+video")
    assert hf.tower_calls(model.model, batch) == {"visual": 2}  # the inner Qwen2VLModel

    class Wrapper(nn.Module):  # as PEFT: base_model.model.<the model>
        def __init__(self, inner):
            super().__init__()
            self.base_model = nn.Module()
            self.base_model.model = inner

    assert hf.tower_calls(Wrapper(model), batch) == {"base_model.model.model.visual": 2}
    nested = L.freeze_towers(L.FAMILIES["llava"](flat_vision=False))  # transformers before the CLIP refactor
    assert "model.vision_tower.vision_model.encoder.layers.0" in dict(nested.named_modules())
    assert hf.tower_calls(nested, L.make_batch("llava", "images")) == {
        "model.vision_tower": 1, "model.multi_modal_projector": 1}


def test_family_from_config_class_name_or_string():
    model = frozen_model("qwen2_5_vl")
    assert hf.family_of(model) == "qwen2_5_vl"
    assert hf.family_of("Qwen2.5-VL") == "qwen2_5_vl"
    assert hf.family_of("llava-onevision") == "llava_onevision"

    class Qwen2_5_VLForConditionalGeneration(nn.Module):  # no config: the class name decides
        pass

    assert hf.family_of(Qwen2_5_VLForConditionalGeneration()) == "qwen2_5_vl"
    assert set(hf.FAMILIES) == set(L.FAMILIES)


def test_unknown_family_names_the_supported_ones():
    with pytest.raises(shardcoord.InvalidArgument) as e:
        hf.tower_calls("pixtral", {})
    assert "qwen2_vl" in str(e.value) and "by hand" in str(e.value)
    with pytest.raises(shardcoord.InvalidArgument, match="gemma3_text"):
        m = nn.Linear(2, 2)
        m.config = type("C", (), {"model_type": "gemma3_text"})()
        hf.plan_fn(m)
    with pytest.raises(ValueError):  # InvalidArgument is a ValueError too
        hf.plan_fn(nn.Linear(2, 2))


def test_a_family_model_without_its_tower_is_refused():
    class Qwen2VLForConditionalGeneration(nn.Module):
        def __init__(self):
            super().__init__()
            self.vision = nn.Linear(2, 2)

    with pytest.raises(shardcoord.InvalidArgument, match="no module 'model.visual'"):
        hf.plan_fn(Qwen2VLForConditionalGeneration())


def test_batches_the_forward_rejects_are_rejected():
    mllama = L.make_batch("mllama", "image")
    with pytest.raises(shardcoord.InvalidArgument, match="cross_attention_states"):
        hf.tower_calls("mllama", {**mllama, "cross_attention_states": torch.zeros(1)})
    with pytest.raises(shardcoord.InvalidArgument, match="aspect_ratio_ids"):
        hf.tower_calls("mllama", {k: v for k, v in mllama.items() if k != "aspect_ratio_ids"})
    with pytest.raises(shardcoord.InvalidArgument, match="image_hidden_states"):
        hf.tower_calls("smolvlm", {**L.make_batch("smolvlm", "image"), "image_hidden_states": torch.zeros(1)})
    audio = L.make_batch("qwen2_audio", "audio")
    with pytest.raises(shardcoord.InvalidArgument, match="feature_attention_mask"):
        hf.tower_calls("qwen2_audio", {k: v for k, v in audio.items() if k != "feature_attention_mask"})
    for name, kind in L.FAILING:
        with pytest.raises(shardcoord.InvalidArgument):
            hf.tower_calls(name, L.make_batch(name, kind))


def test_plan_ahead_reports_the_plans():
    class FakeWorker:  # PlanAhead's side of a Worker: the window, report_plan, get_decision
        group = type("G", (), {"lookahead": 2})()

        def __init__(self):
            self.plans = []

        def report_plan(self, step, mb, calls):
            self.plans.append((step, mb, dict(calls)))

        def get_decision(self, step, mb, timeout):
            return (step, mb)

    model = frozen_model("qwen2_vl")
    batches = [L.make_batch("qwen2_vl", k) for k in ("text", "image", "image+video", "video")]
    worker = FakeWorker()
    plans = sct.PlanAhead(worker, sct.with_keys(batches, 2), hf.plan_fn(model))
    assert [key for *key, _batch, _d in plans] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert worker.plans == [(0, 0, {"model.visual": 0}), (0, 1, {"model.visual": 1}), (1, 0, {"model.visual": 2}),
                            (1, 1, {"model.visual": 1})]


def test_imports_without_torch_and_reads_any_batch():
    code = textwrap.dedent("""
        import sys
        sys.modules['torch'] = None
        sys.modules['transformers'] = None
        import shardcoord.hf as hf
        assert hf.tower_calls('qwen2_vl', {'pixel_values': [[0.5] * 24] * 16, 'pixel_values_videos': None}) \\
            == {'model.visual': 1}
        class Batch:  # attributes instead of keys
            pixel_values = [[0.5]]
        assert hf.tower_calls('gemma3', Batch()) == {'model.vision_tower': 1, 'model.multi_modal_projector': 1}
        assert hf.tower_calls('qwen2_audio', {'input_ids': [[1, 2]], 'input_features': [[[0.0]]],
                                              'feature_attention_mask': [[1]]})['model.audio_tower'] == 1
        print('ok')
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
