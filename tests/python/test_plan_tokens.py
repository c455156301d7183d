"""Decoder tokens in plan traces (pure Python, no torch, no daemon): scripts/make_trace.py --tokens,
bench/policy_matrix.py's decoder_tokens, measured_steps and token_fit (the calibration's per-token
line), and, where ctest gives SHARDCTL, `shardctl plan` pricing a make_trace trace per token."""

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import types

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir)
MAKE_TRACE = os.path.join(ROOT, "scripts", "make_trace.py")


def load_matrix():
    spec = importlib.util.spec_from_file_location("policy_matrix", os.path.join(ROOT, "bench", "policy_matrix.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Its dataclasses look their module up there.
    spec.loader.exec_module(module)
    return module


def make_trace(*args):
    r = subprocess.run([sys.executable, MAKE_TRACE, *args], capture_output=True, text=True, timeout=120)
    return r, [json.loads(line) for line in r.stdout.splitlines()] if r.returncode == 0 else []


# LLaVA-1.5's mix: a sample is text only or one image; per_item calls count the images.
LLAVA = ["--mix", "llava15_665k", "--world-size", "4", "--steps", "3", "--microbatches", "2",
         "--samples-per-microbatch", "5", "--calls", "per_item", "--seed", "3"]


def test_make_trace_tokens_are_samples_times_text_plus_images_times_image_tokens():
    r, lines = make_trace(*LLAVA, "--tokens", "--text-tokens", "100", "--image-tokens", "7")
    assert r.returncode == 0, r.stderr
    assert len(lines) == 4 * 3 * 2
    for line in lines:
        assert line["tokens"] == 5 * 100 + 7 * line["calls"]["model.visual"], line
    assert {line["calls"]["model.visual"] for line in lines} != {5}  # Some text-only samples were drawn.


def test_make_trace_without_tokens_writes_the_same_lines_as_before():
    _, plain = make_trace(*LLAVA)
    _, with_tokens = make_trace(*LLAVA, "--tokens")
    assert all("tokens" not in line for line in plain)
    assert [{k: v for k, v in line.items() if k != "tokens"} for line in with_tokens] == plain
    # The defaults: policy_matrix's --size vlm (2048 text tokens a sample, 1024 an image).
    assert all(line["tokens"] == 5 * 2048 + 1024 * line["calls"]["model.visual"] for line in with_tokens)


def test_make_trace_counts_video_frames_and_audio_clips():
    # VITA-1.5: one image or one video per multimodal sample; audio on about half; batched calls.
    r, lines = make_trace("--mix", "vita15_audio_sft", "--world-size", "2", "--steps", "4", "--microbatches", "2",
                          "--samples-per-microbatch", "1", "--calls", "per_item", "--tokens", "--text-tokens", "0",
                          "--image-tokens", "10", "--video-frames", "3", "--audio-tokens", "1000")
    assert r.returncode == 0, r.stderr
    seen = {line["tokens"] for line in lines}
    # One sample a microbatch: 0 (text), 10 (an image) or 30 (a video's 3 frames), + 1000 with speech.
    assert seen <= {0, 10, 30, 1000, 1010, 1030} and len(seen) >= 3, seen
    for line in lines:
        assert (line["tokens"] >= 1000) == (line["calls"]["model.audio_tower"] == 1), line


@pytest.mark.parametrize("args, error", [
    (["--tokens"], "--tokens need --mix"),
    (["--mix", "llava15_665k", "--image-tokens", "5"], "need --tokens"),
    (["--mix", "llava15_665k", "--tokens", "--text-tokens", "-1"], "--text-tokens must be >= 0, got -1"),
])
def test_make_trace_refuses_token_options_it_cannot_use(args, error):
    r, _ = make_trace(*args)
    assert r.returncode == 2 and error in r.stderr, r.stderr


def test_decoder_tokens_of_the_builtin_and_the_qwen_model():
    pm = load_matrix()
    size = pm.SIZES["vlm"]
    micro = pm.Micro(4, [], [("image", 3), ("video", 4)])  # 3 images; a video of 4 frames (2 temporal patches).
    assert pm.decoder_tokens(size, "builtin", micro) == 4 * 2048 + 7 * 1024  # Packed: frames count as images.
    # Qwen: 3 images + 2 video patches dealt round-robin over 4 samples, each 1024 + 2 framing tokens;
    # padded to the longest sample (2 media): 4 x (2048 + 2 x 1026).
    assert pm.qwen_sample_lengths(size, micro) == [2048 + 2 * 1026] + [2048 + 1026] * 3
    assert pm.decoder_tokens(size, "hf-qwen2vl", micro) == 4 * (2048 + 2 * 1026)
    assert pm.decoder_tokens(size, "builtin", pm.Micro(4, [], [])) == 4 * 2048


def test_measured_steps_follow_the_rounds_schedule():
    pm = load_matrix()
    args = types.SimpleNamespace(repeats=3, warmup=2, visit_warmup=1, steps_per_round=2)
    # Round 0: steps 0-2 warm, 3-4 measured; round 1: 5 warm, 6-7; round 2: 8 warm, 9-10.
    assert pm.measured_steps(args) == [3, 4, 6, 7, 9, 10]
    args = types.SimpleNamespace(repeats=2, warmup=0, visit_warmup=0, steps_per_round=1)
    assert pm.measured_steps(args) == [0, 1]


def test_token_fit_is_the_line_through_the_two_phases_medians():
    pm = load_matrix()
    args = types.SimpleNamespace(samples_per_microbatch=4, video_frames=2, max_images=8, size="vlm",
                                 model="builtin")
    ctx = types.SimpleNamespace(args=args, rank=0)
    text, media = pm.Data("none", args, {}), pm.Data("all", args, {})
    # Text-only microbatches (8192 tokens) take 0.30 s; media ones (12288 tokens, one call) 0.52 s,
    # of which the tower's forward is 0.02 s: 0.20 s more for 4096 tokens. One outlier each side
    # must not move it (medians).
    per_token, reference = pm.token_fit(ctx, text, media, [0.30, 0.30, 9.0, 0.30], [0.52, 0.01, 0.52, 0.52], 0.02)
    assert reference == 8192
    assert per_token == pytest.approx(0.20 / 4096, rel=1e-12)
    # Media not slower than text (less the forward): no negative cost per token.
    assert pm.token_fit(ctx, text, media, [0.30], [0.25], 0.02) == (0.0, 8192)


@pytest.mark.skipif(not os.environ.get("SHARDCTL"), reason="needs SHARDCTL (run through ctest)")
def test_shardctl_plans_a_make_trace_trace_per_token(tmp_path):
    # One rank; 0.1 s a microbatch at 40 tokens, 0.001 s per token more; the tower costs nothing.
    _, lines = make_trace("--mix", "llava15_665k", "--world-size", "1", "--steps", "4", "--microbatches", "2",
                          "--samples-per-microbatch", "2", "--calls", "per_item", "--seed", "5", "--tokens",
                          "--text-tokens", "20", "--image-tokens", "30")
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "m.json").write_text(json.dumps({"modules": [{"name": "model.visual", "param_bytes": 100}]}))
    (tmp_path / "c.json").write_text(json.dumps({
        "format": "shardcoord.cost/v1", "other_seconds_per_microbatch": 0.1, "other_seconds_per_token": 0.001,
        "other_tokens_per_microbatch": 40,
        "modules": [{"name": "model.visual", "forward_seconds_per_call": 0, "units": []}]}))
    r = subprocess.run([os.environ["SHARDCTL"], "plan", str(tmp_path / "t.jsonl"), "--manifest",
                        str(tmp_path / "m.json"), "--cost", str(tmp_path / "c.json"), "--json", "--policies", "root"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    per_step = {}
    for line in lines:  # 2 x 20 text tokens + 30 per image: 0.1 + 0.001 x (tokens - 40) a microbatch.
        per_step[line["step"]] = per_step.get(line["step"], 0) + 0.1 + 0.001 * (line["tokens"] - 40)
    assert plan["seconds_per_step"] == pytest.approx(statistics.mean(per_step.values()), abs=1e-9)
    assert plan["other_priced_by"] == "tokens"
