#!/usr/bin/env python3
"""policy_matrix: what each placement of a frozen vision tower costs under FSDP2, per data mix,
with the noise measured (issue 28).

A VLM with random bf16 weights (a frozen ViT-like tower, a frozen projector, a trainable decoder;
or, with --model hf-qwen2vl, transformers' Qwen2_5_VLForConditionalGeneration built from a config)
is trained data-parallel with FSDP2 on --gpus GPUs (NCCL; --gpus 1 runs the same code on one GPU,
where a group of one gathers nothing), in shard groups of --group-size (default: all; smaller
groups shard within the group and replicate across groups: HSDP). Each microbatch holds
--samples-per-microbatch samples of --size's text length, packed; a sample with media brings its
images (image tokens each) to the tower. The same processes run every cell (data mix x placement):

  placements  root                 every rank gathers the whole tower before the microbatch and
                                   releases it after its own last call (shardcoord.fsdp2)
              root_hold            the same, holding it through the backward (the former root)
              replicate            a full copy of the tower on every rank (static; skipped where
                                   --memory-budget-bytes says the replica does not fit: regime b)
              per_layer            FSDP per-layer units; only where every rank agrees (uniform mixes)
              per_layer_dummy      per_layer, every rank calls the tower as often as any rank can,
                                   on 1-token dummies where it has no media (the usual workaround)
              per_layer_allreduce  an in-band all-reduce(MAX) of the calls before each microbatch:
                                   per_layer / skip when the ranks agree, root otherwise
              sc_per_layer         shardcoord, policy per_layer, fallback root
              sc_auto              shardcoord, policy auto, memory budget --memory-budget-bytes
              sc_padded            shardcoord, policy per_layer, fallback padded (divergent calls:
                                   per_layer with gather-only passes on the ranks that call less)
              sc_auto_padded       shardcoord, policy auto with fallback padded (cost-aware: padded
                                   where the tower does not fit the budget)
  mixes       all, none, random50 (per rank and microbatch), skewed (even ranks 90 %, odd ranks
              10 %), alternating (every rank has media on even steps); and the published mixes of
              docs/MIXES.md (scripts/make_trace.py --list-mixes; its tables are imported, not
              copied): NAME uses --samples-per-microbatch samples, NAME@S uses S (e.g.
              llava15_665k@1 qwen25vl_sft@4); each sample is drawn per rank and microbatch, its
              tower calls are what the mix's model makes (shardcoord.sampler.tower_calls; Qwen's
              once per media kind for hf-qwen2vl), videos count --video-frames images, at most
              --max-images images per call.

How the numbers are made:

- Interleaved and repeated: a mix's cells run in --repeats rounds; a round visits every cell once
  (rounds come in mirrored pairs, ABCD then DCBA, each pair rotated by one cell: a linear drift
  costs every cell alike, and every cell runs early and late), and a visit runs --visit-warmup
  steps (not measured: the switch, a replica made again)
  then --steps-per-round measured steps; a cell's first visit adds --warmup steps. Every cell
  runs the same data: the microbatch of (rank, step, microbatch) is a function of them alone.
- A step is timed with CUDA events (start of its first microbatch to after optimizer.step), read
  after the visit; its time is the slowest rank's; tokens/s counts every rank's real tokens
  (text + media). Per cell: the median over measured steps, its 95 % confidence interval by a
  bootstrap over rounds (whole rounds resampled with replacement, 2000 times, the median of the
  pooled steps each time: round-to-round drift is in the interval), min and max.
- The A/A check (--aa, on by default): a second copy of the first placement (``root#2``) is a cell
  of its own, interleaved like the rest; ``A/A difference = (median_A2 - median_A1) / median_A1``,
  with a paired bootstrap interval over rounds, is in every table and in the JSON. A difference
  against the first placement ("vs") is paired the same way.
- Peak: torch.cuda.max_memory_allocated, reset at each visit, the highest visit and rank.
  All-gathered: every all_gather_into_tensor output (FSDP2's units, the decoder's too) and the
  gathers that make a replica, per measured step. Stalls (shardcoord cells): decisions not ready
  (a wait over 1 ms) when the trainer asked.
- --cost-out FILE: a cost model measured in the run (format shardcoord.cost/v1, read by
  ``shardctl plan`` and the daemon), by shardcoord.torch.CostMeter in a calibration phase after the
  matrix, every rank the same static decisions: text-only microbatches under skip give
  other_seconds_per_microbatch (microbatch + an optimizer step's share, CUDA events), microbatches
  with media under replicate the tower's forward seconds per call, under root each unit's gather
  seconds (CUDA events around FSDP's unshard; 0 with one GPU, said in measured.notes); the slowest
  rank's numbers; other_seconds_per_token, the decoder's seconds per token, is the line through
  the text-only and the media phase (token_fit). --manifest-out and --trace-dir write the manifest
  and each mix's plans (the calls and decoder tokens of every rank, step and microbatch, warm-up
  steps included, and MIX.measured.jsonl: the measured steps only) for ``shardctl plan``.

Size matters for the noise: with --size small (a 1.14 B decoder, 1024 text tokens) steps are
partly host-bound (FSDP2's per-unit Python work), and an A/A run on one H200 differed by -7.5 %
and +5.9 %; with --size vlm (the default: a 2.05 B decoder, 2048 text and 1024 image tokens per
sample, 4 samples) the steps are GPU-bound and the same A/A differed by +0.13 % on `all` and
`none` (2026-12-02, one H200, torch 2.11; no sync in the hot path: --sync-debug).

Every wait is bounded: the launcher kills the run at --timeout (cells not reached are marked), the
ranks stop starting rounds once a round would pass --timeout (agreed by an all-reduce, so no rank
waits alone), collectives time out after --collective-timeout, decisions after 30 s.

    python bench/policy_matrix.py [--shardcoordd PATH] [--gpus N] [--size quick|small|vlm]
        [--mixes ...] [--placements ...] [--repeats R] [--steps-per-round K] [--cost-out FILE]

    # the A/A on one GPU (about 6 minutes on an H200, under the 9 the GPU machine allows):
    scripts/gpu/run_policy_matrix.sh --gpus 1 --mixes all none \
        --placements root replicate per_layer sc_per_layer --timeout 450

Run by scripts/gpu/run_policy_matrix.sh (which installs the package on the GPU machine).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
SYNTHETIC_MIXES = ["all", "none", "random50", "skewed", "alternating"]
UNIFORM_MIXES = {"all", "none", "alternating"}
PLACEMENTS = ["root", "root_hold", "replicate", "per_layer", "per_layer_dummy", "per_layer_allreduce",
              "sc_per_layer", "sc_auto", "sc_padded", "sc_auto_padded"]
# The shardcoord placements: (policy, fallback) each registers.
SC_PLACEMENTS = {"sc_per_layer": ("per_layer", "root"), "sc_auto": ("auto", "root"),
                 "sc_padded": ("per_layer", "padded"), "sc_auto_padded": ("auto", "padded")}
MODELS = ["builtin", "hf-qwen2vl"]
COST_FORMAT = "shardcoord.cost/v1"
BOOTSTRAP = 2000


@dataclass
class Size:
    vit_layers: int
    vit_hidden: int
    vit_heads: int
    vit_mlp: int
    image_tokens: int  # Tokens one image gives the decoder (and the builtin tower's sequence).
    dec_layers: int
    dec_hidden: int
    dec_heads: int
    dec_mlp: int
    vocab: int
    text_tokens: int  # Per sample.
    patch_dim: int = 588  # 14 x 14 x 3


SIZES = {
    "quick": Size(4, 256, 4, 1024, 64, 2, 256, 4, 1024, 1000, 128),  # Checks the harness.
    # The size of the issue-10 runs: a 0.63 B tower (32 x 1280), a 1.14 B decoder (20 x 2048).
    "small": Size(32, 1280, 16, 5120, 576, 20, 2048, 16, 8192, 32000, 1024),
    # A 0.63 B tower and a ~2.05 B decoder (24 x 2560), 1024 image tokens, 2048 text tokens.
    "vlm": Size(32, 1280, 16, 5120, 1024, 24, 2560, 20, 10240, 32000, 2048),
}


# ---------------------------------------------------------------------------------------------
# Data: what a rank's microbatch holds (pure Python; the launcher uses it too)

def load_make_trace():
    """scripts/make_trace.py as a module: its mixes (docs/MIXES.md) and their tower calls."""
    path = os.path.join(HERE, os.pardir, "scripts", "make_trace.py")
    spec = importlib.util.spec_from_file_location("make_trace", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_sampler():
    try:
        import shardcoord.sampler as sampler
        return sampler
    except ImportError:  # pragma: no cover - the package not installed: the source tree's file
        return load_make_trace().load_sampler()


def parse_mix(name: str, default_samples: int) -> Tuple[str, int]:
    """'llava15_665k@4' -> ('llava15_665k', 4); 'all' -> ('all', default_samples)."""
    base, _, s = name.partition("@")
    return base, int(s) if s else default_samples


def check_mix(name: str, published: Dict[str, Any]) -> str:
    base, _, s = name.partition("@")
    if base not in SYNTHETIC_MIXES and base not in published:
        raise argparse.ArgumentTypeError(f"unknown mix '{base}' (synthetic: {', '.join(SYNTHETIC_MIXES)}; "
                                         f"published: {', '.join(sorted(published))})")
    if s and (not s.isdigit() or int(s) < 1):
        raise argparse.ArgumentTypeError(f"'{name}': samples per microbatch after @ must be >= 1")
    return name


@dataclass
class Micro:
    """One rank's microbatch: its samples' media and the tower calls they make."""

    samples: int
    media: List[Dict[str, int]]  # Per sample, as drawn: kind -> items ({} text only).
    calls: List[Tuple[str, int]]  # Per tower call: (kind, images); kind "image", "video" or "media".

    @property
    def images(self) -> int:
        return sum(n for _, n in self.calls)


def has_images(mix: str, rank: int, step: int, mb: int, seed: int = 7) -> bool:
    if mix in ("all", "none"):
        return mix == "all"
    if mix == "alternating":
        return step % 2 == 0
    h = 1469598103934665603
    for v in (seed, rank, step, mb):
        h = ((h ^ ((v + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    p = 0.5 if mix == "random50" else (0.9 if rank % 2 == 0 else 0.1)
    return (h % 10000) / 10000.0 < p


def media_calls(media: List[Dict[str, int]], mode: str, video_frames: int, cap: int) -> List[Tuple[str, int]]:
    """The tower calls a microbatch makes and the images each one encodes (videos: frames),
    at most ``cap`` per call: batched once for all, per_kind once per kind, per_item once each."""
    images = sum(m.get("image", 0) for m in media)
    videos = sum(m.get("video", 0) for m in media)
    if mode == "batched":
        total = images + videos * video_frames
        return [("media", min(total, cap))] if total else []
    if mode == "per_kind":
        return [(k, min(n, cap)) for k, n in (("image", images), ("video", videos * video_frames)) if n]
    return [("image", 1)] * images + [("video", min(video_frames, cap))] * videos  # per_item


class Data:
    """The microbatches of one mix: a function of (rank, step, microbatch) alone."""

    def __init__(self, mix: str, args: argparse.Namespace, published: Dict[str, Any], mode: Optional[str] = None,
                 seed: int = 7):
        self.name = mix
        self.base, self.samples = parse_mix(mix, args.samples_per_microbatch)
        self.mix = published.get(self.base)
        self.mode = mode or (self.mix.calls if self.mix is not None else "batched")
        self.video_frames, self.max_images, self.seed = args.video_frames, args.max_images, seed
        self.uniform = self.base in UNIFORM_MIXES  # Every rank calls the tower equally often.
        self._cache: Dict[Tuple[int, int, int], Micro] = {}

    def micro(self, rank: int, step: int, mb: int) -> Micro:
        key = (rank, step, mb)
        if key not in self._cache:
            if len(self._cache) > 100_000:
                self._cache.clear()
            self._cache[key] = self._draw(rank, step, mb)
        return self._cache[key]

    def _draw(self, rank: int, step: int, mb: int) -> Micro:
        if self.mix is None:
            images = has_images(self.base, rank, step, mb, self.seed)
            media = [{"image": 1} if images else {} for _ in range(self.samples)]
        else:
            rng = random.Random(f"{self.seed}/{self.base}/{rank}/{step}/{mb}")
            media = [self.mix.draw(rng) for _ in range(self.samples)]
        calls = media_calls(media, self.mode, self.video_frames, self.max_images)
        if self.mix is not None:  # The same count as shardcoord.sampler's (what a trace says).
            counted = load_sampler().tower_calls(media, lambda s: s, self.mode,
                                                 {"image": "t", "video": "t", "audio": "audio"}).get("t", 0)
            assert counted == len(calls), (media, self.mode, counted, calls)
        return Micro(self.samples, media, calls)

    def calls(self, rank: int, step: int, mb: int) -> int:
        return len(self.micro(rank, step, mb).calls)

    def max_calls(self, world: int, steps: int, accum: int) -> int:
        """The most calls any rank makes in any microbatch of the run: what dummy forwards pad to."""
        return max((self.calls(r, s, m) for r in range(world) for s in range(steps) for m in range(accum)),
                   default=0)


def qwen_sample_lengths(size: Size, micro: Micro) -> List[int]:
    """Each sample's tokens in hf-qwen2vl's batch (the layout _qwen_batch builds): its share of the
    microbatch's images and videos (dealt round-robin, each image_tokens framed by vision start and
    end; a video's temporal patch is 2 frames), then its text_tokens."""
    images = sum(n for k, n in micro.calls if k != "video")
    videos = sum(max(1, n // 2) for k, n in micro.calls if k == "video")
    lengths = [size.text_tokens] * micro.samples
    for i in range(images + videos):
        lengths[i % micro.samples] += size.image_tokens + 2
    return lengths


def decoder_tokens(size: Size, model: str, micro: Micro) -> int:
    """The positions the decoder computes on in one microbatch (pure Python: the launcher writes
    them into the traces' "tokens", the calibration fits other_seconds_per_token against them).
    builtin: one packed sequence, every sample's text and every image's tokens (a video counts
    --video-frames images, at most --max-images per call): the real tokens. hf-qwen2vl: a padded
    batch, samples x the longest sample (padding is computed too; tokens/s counts only the real
    ones)."""
    if model == "hf-qwen2vl":
        return micro.samples * max(qwen_sample_lengths(size, micro))
    return micro.samples * size.text_tokens + micro.images * size.image_tokens


# ---------------------------------------------------------------------------------------------
# Statistics (rank 0 and the launcher)

def pooled_median(rounds: List[List[float]]) -> float:
    return statistics.median([x for r in rounds for x in r])


def bootstrap_ci(rounds: List[List[float]], n: int = BOOTSTRAP, seed: int = 0) -> Optional[List[float]]:
    """95 % interval of the pooled median, resampling whole rounds (None with fewer than 2)."""
    rounds = [r for r in rounds if r]
    if len(rounds) < 2:
        return None
    rng, k = random.Random(seed), len(rounds)
    meds = sorted(pooled_median([rounds[rng.randrange(k)] for _ in range(k)]) for _ in range(n))
    return [meds[int(0.025 * n)], meds[int(0.975 * n) - 1]]


def paired_diff(a: List[List[float]], b: List[List[float]], n: int = BOOTSTRAP,
                seed: int = 1) -> Tuple[Optional[float], Optional[List[float]]]:
    """(median_b / median_a - 1, its 95 % interval): the same rounds resampled for both cells
    (both ran in every round, so a slow round slows both)."""
    k = min(len(a), len(b))
    pairs = [(x, y) for x, y in zip(a[:k], b[:k]) if x and y]
    if not pairs:
        return None, None
    point = pooled_median([y for _, y in pairs]) / pooled_median([x for x, _ in pairs]) - 1
    if len(pairs) < 2:
        return point, None
    rng, k = random.Random(seed), len(pairs)
    diffs = []
    for _ in range(n):
        pick = [pairs[rng.randrange(k)] for _ in range(k)]
        diffs.append(pooled_median([y for _, y in pick]) / pooled_median([x for x, _ in pick]) - 1)
    diffs.sort()
    return point, [diffs[int(0.025 * n)], diffs[int(0.975 * n) - 1]]


def round_order(cells: List[Any], r: int) -> List[Any]:
    """Round r's order: rounds come in mirrored pairs (ABCD DCBA: a linear drift hits every cell
    alike), each pair rotated by one cell from the last (BCDA ADCB, ...)."""
    k = (r // 2) % len(cells)
    order = cells[k:] + cells[:k]
    return order[::-1] if r % 2 else order


# ---------------------------------------------------------------------------------------------
# The models (built in rank processes only: torch is imported there). Each comes as an "api":
# model, tower (its path), decoder_layers (FSDP units of their own), batch(micro, seed): the
# microbatch's tensors, a function of the seed; loss(batch, dummy_calls), tokens(micro, batch).

def build_builtin(size: Size, device) -> types.SimpleNamespace:
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        def __init__(self, dim, heads, causal):
            super().__init__()
            self.qkv = nn.Linear(dim, 3 * dim, bias=False)
            self.out = nn.Linear(dim, dim, bias=False)
            self.heads, self.causal = heads, causal

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
            return self.out(y.transpose(1, 2).reshape(b, t, d))

    class Block(nn.Module):
        def __init__(self, dim, heads, mlp, causal):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.attn = Attention(dim, heads, causal)
            self.fc1, self.fc2 = nn.Linear(dim, mlp), nn.Linear(mlp, dim)

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))

    class VisionTower(nn.Module):  # Qwen-VL style names: visual.patch_embed (the rest unit), visual.blocks
        def __init__(self):
            super().__init__()
            self.patch_embed = nn.Linear(size.patch_dim, size.vit_hidden)
            self.blocks = nn.ModuleList([Block(size.vit_hidden, size.vit_heads, size.vit_mlp, False)
                                         for _ in range(size.vit_layers)])

        def forward(self, pixels):
            x = self.patch_embed(pixels)
            for blk in self.blocks:
                x = blk(x)
            return x

    model = _builtin_vlm(size, device, VisionTower, Block)
    return types.SimpleNamespace(model=model, tower="visual", decoder_layers=list(model.layers),
                                 batch=lambda micro, seed: _builtin_batch(size, device, micro, seed),
                                 loss=lambda batch, dummies: model(**batch, dummies=dummies),
                                 tokens=lambda micro, batch: decoder_tokens(size, "builtin", micro))


def _builtin_vlm(size: Size, device, VisionTower, Block):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Vlm(nn.Module):
        def __init__(self):
            super().__init__()
            self.visual = VisionTower()
            self.multi_modal_projector = nn.Sequential(nn.Linear(size.vit_hidden, size.dec_hidden), nn.GELU(),
                                                       nn.Linear(size.dec_hidden, size.dec_hidden))
            self.embed_tokens = nn.Embedding(size.vocab, size.dec_hidden)
            self.layers = nn.ModuleList([Block(size.dec_hidden, size.dec_heads, size.dec_mlp, True)
                                         for _ in range(size.dec_layers)])
            self.norm = nn.LayerNorm(size.dec_hidden)
            self.lm_head = nn.Linear(size.dec_hidden, size.vocab, bias=False)

        def forward(self, tokens, labels, pixels, dummies=0):
            x = self.embed_tokens(tokens)
            media = []
            with torch.no_grad():  # Frozen tower and projector: no graph, no backward collectives.
                for p in pixels:  # One tower call each.
                    media.append(self.multi_modal_projector(self.visual(p)).reshape(1, -1, x.shape[-1]))
                for _ in range(dummies):  # The workaround: calls on a 1-token dummy, output unused.
                    self.visual(torch.zeros(1, 1, size.patch_dim, dtype=x.dtype, device=x.device))
            if media:
                x = torch.cat(media + [x], dim=1)
            for layer in self.layers:
                x = layer(x)
            logits = self.lm_head(self.norm(x[:, -tokens.shape[1]:]))
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))

    torch.manual_seed(0)
    with torch.device(device):
        model = Vlm()
    model.to(torch.bfloat16)
    model.visual.requires_grad_(False)
    model.multi_modal_projector.requires_grad_(False)
    return model


def _builtin_batch(size: Size, device, micro: Micro, seed: int) -> Dict[str, Any]:
    """One packed sequence: every call's image tokens, then every sample's text."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    n = micro.samples * size.text_tokens
    tokens = torch.randint(size.vocab, (1, n), device=device, generator=g)
    labels = torch.randint(size.vocab, (1, n), device=device, generator=g)
    pixels = [torch.randn(k, size.image_tokens, size.patch_dim, device=device, generator=g, dtype=torch.bfloat16)
              for _, k in micro.calls]
    return {"tokens": tokens, "labels": labels, "pixels": pixels}


def _round_to(x: float, k: int) -> int:
    return max(k, int(round(x / k)) * k)


def build_hf_qwen(size: Size, device) -> types.SimpleNamespace:
    """transformers' Qwen2_5_VLForConditionalGeneration from a config of --size (random weights,
    nothing downloaded): a tower of vit_layers blocks (gated MLP of 2/3 the width: the same
    parameters), a decoder with GQA. image_tokens is the merged tokens per image (a square grid of
    14-pixel patches, merged 2 x 2); the tower runs on 4x as many patches."""
    import torch
    import transformers as tf

    grid = 2 * math.isqrt(size.image_tokens)
    if (grid // 2) ** 2 != size.image_tokens or grid % 8:
        raise SystemExit(f"--model hf-qwen2vl needs image_tokens a square of a multiple of 4, got {size.image_tokens}")
    head_dim, v = size.dec_hidden // size.dec_heads, size.vocab
    text = dict(vocab_size=v, hidden_size=size.dec_hidden, intermediate_size=_round_to(size.dec_mlp * 2 / 3, 64),
                num_hidden_layers=size.dec_layers, num_attention_heads=size.dec_heads,
                num_key_value_heads=max(1, size.dec_heads // 8), max_position_embeddings=32768,
                rope_parameters={"rope_type": "default",
                                 "mrope_section": [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]})
    vision = dict(depth=size.vit_layers, hidden_size=size.vit_hidden, num_heads=size.vit_heads,
                  intermediate_size=_round_to(size.vit_mlp * 2 / 3, 4), out_hidden_size=size.dec_hidden,
                  patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=112,
                  fullatt_block_indexes=[i for i in range(size.vit_layers) if i % 8 == 7] or [size.vit_layers - 1])
    config = tf.Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=v - 4, video_token_id=v - 3,
                                 vision_start_token_id=v - 2, vision_end_token_id=v - 1)
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.Qwen2_5_VLForConditionalGeneration(config)
    model.to(torch.bfloat16)
    tower = next(p for p in ("model.visual", "visual") if _has(model, p))
    visual = model.get_submodule(tower)
    visual.requires_grad_(False)
    layers = next(m for p, m in model.named_modules() if p.endswith("layers") and not p.startswith(tower)
                  and isinstance(m, torch.nn.ModuleList))
    dummy = (torch.zeros(4, 3 * 2 * 14 * 14, dtype=torch.bfloat16, device=device),
             torch.tensor([[1, 2, 2]], device=device))
    pending = [0]

    def run_dummies(_module, _args):  # Inside the model's forward: FSDP's root unit (the rest unit) is gathered.
        with torch.no_grad():
            for _ in range(pending[0]):  # The workaround: the smallest image (one merged token), output unused.
                visual(dummy[0], grid_thw=dummy[1])
        pending[0] = 0

    model.get_submodule(tower.rpartition(".")[0]).register_forward_pre_hook(run_dummies)

    def loss(batch, dummies):
        pending[0] = dummies
        return model(**batch).loss

    return types.SimpleNamespace(model=model, tower=tower, decoder_layers=list(layers), loss=loss,
                                 batch=lambda micro, seed: _qwen_batch(size, device, micro, seed, grid),
                                 tokens=lambda micro, batch: batch.tokens)


def _has(model, path: str) -> bool:
    try:
        model.get_submodule(path)
        return True
    except AttributeError:
        return False


class _Batch(dict):
    """The model's keyword arguments, and the real tokens they hold."""

    tokens = 0


def _qwen_batch(size: Size, device, micro: Micro, seed: int, grid: int) -> Dict[str, Any]:
    """The processor's keys and shapes (scripts/gpu/hf_calls_check.py's qwen_batch, at size):
    per sample its images and videos as placeholder runs framed by vision start / end, then text;
    right-padded; labels only on text; mm_token_type_ids 1 on image and 2 on video placeholders."""
    import torch

    v, m, patch = size.vocab, size.image_tokens, 3 * 2 * 14 * 14
    g, rng = torch.Generator(device=device).manual_seed(seed), random.Random(seed)
    images = sum(n for k, n in micro.calls if k != "video")
    videos = sum(max(1, n // 2) for k, n in micro.calls if k == "video")  # 2 frames per temporal patch.
    seqs: List[List[Tuple[int, int, int]]] = [[] for _ in range(micro.samples)]  # (token, label, type)
    for i in range(images + videos):
        kind, token = (1, v - 4) if i < images else (2, v - 3)
        seqs[i % micro.samples] += [(v - 2, -100, 0)] + [(token, -100, kind)] * m + [(v - 1, -100, 0)]
    for seq in seqs:  # Text ids drawn on the host: no device sync for the batch.
        seq += [(x, x, 0) for x in (rng.randrange(v - 8) for _ in range(size.text_tokens))]
    width = max(len(s) for s in seqs)
    rows = [s + [(0, -100, 0)] * (width - len(s)) for s in seqs]
    col = lambda j: torch.tensor([[x[j] for x in r] for r in rows], device=device)  # noqa: E731
    batch = _Batch(input_ids=col(0), labels=col(1), mm_token_type_ids=col(2).int(),
                   attention_mask=torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device))
    batch.tokens = sum(len(s) for s in seqs)  # Real tokens, counted on the host.
    if images:
        batch["pixel_values"] = torch.randn(images * grid * grid, patch, generator=g, device=device,
                                            dtype=torch.bfloat16)
        batch["image_grid_thw"] = torch.tensor([[1, grid, grid]] * images, device=device)
    if videos:
        batch["pixel_values_videos"] = torch.randn(videos * grid * grid, patch, generator=g, device=device,
                                                   dtype=torch.bfloat16)
        batch["video_grid_thw"] = torch.tensor([[1, grid, grid]] * videos, device=device)
    return batch


def build_model(args: argparse.Namespace, device) -> types.SimpleNamespace:
    size = SIZES[args.size]
    return build_hf_qwen(size, device) if args.model == "hf-qwen2vl" else build_builtin(size, device)


# ---------------------------------------------------------------------------------------------
# One rank

def make_specs(model, tower: str) -> List[Any]:
    """The tower's manifest entry (rest unit "" first, then its layers): shardcoord's bound types
    when the binding loads (a shardcoord cell needs them), else stand-ins with the same fields."""
    from shardcoord.torch._manifest import _find_layer_lists, _param_bytes, _units

    module = model.get_submodule(tower)
    units = [(u.name, _param_bytes(p for _, p in u.params)) for u in _units(tower, module, _find_layer_lists(module))]
    total = _param_bytes(module.parameters())
    try:
        import shardcoord
        return [shardcoord.ModuleSpec(tower, total, tuple(shardcoord.LayerUnit(n, b) for n, b in units))]
    except ImportError:
        ns = types.SimpleNamespace
        return [ns(name=tower, param_bytes=total, units=tuple(ns(name=n, param_bytes=b) for n, b in units))]


def count_all_gathers(counters: types.SimpleNamespace, group_size: int) -> None:
    """Counts the bytes of every all_gather_into_tensor output (FSDP2's unit gathers) and, in a
    group of more than one, of the gathers that make a replica."""
    import torch.distributed as dist
    from shardcoord import fsdp2

    original = dist.all_gather_into_tensor

    def counted(output_tensor, input_tensor, *a, **k):
        counters.gathered += output_tensor.numel() * output_tensor.element_size()
        return original(output_tensor, input_tensor, *a, **k)

    dist.all_gather_into_tensor = counted
    materialize = fsdp2._materialize

    def counted_materialize(c, root):
        replica = materialize(c, root)
        if group_size > 1:
            counters.gathered += sum(p.numel() * p.element_size() for p in replica.parameters())
        return replica

    fsdp2._materialize = counted_materialize


def static(tower: str, kind: str) -> types.SimpleNamespace:
    """A decision made without the coordinator (the same on every rank), as fsdp2 reads one."""
    return types.SimpleNamespace(modules={tower: types.SimpleNamespace(decision=kind, reason="static")})


@dataclass
class Cell:
    name: str  # "root", or "root#2" for the A/A copy
    placement: str
    data: Data
    skipped: str = ""
    dummies: int = 0  # per_layer_dummy: the calls every rank makes per microbatch.
    worker: Any = None
    plans: Any = None
    step: int = 0
    visits: int = 0
    # Rank 0, over the measured steps: tokens/s per step, one list per round; the rest per step.
    rounds: List[List[float]] = field(default_factory=list)
    step_ms: List[float] = field(default_factory=list)
    gathered: List[int] = field(default_factory=list)
    peak: float = 0.0
    stalls: int = 0
    wait_max: float = 0.0
    decisions: Dict[str, int] = field(default_factory=dict)


def setup(args: argparse.Namespace) -> types.SimpleNamespace:
    """torch.distributed, the model sharded by FSDP2 and shardcoord.fsdp2, the optimizer."""
    import torch
    import torch.distributed as dist
    from shardcoord import fsdp2

    rank, world = int(os.environ["RANK"]), args.gpus
    group_size = args.group_size or world
    cuda = torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        if args.sync_debug:
            torch.cuda.set_sync_debug_mode("warn")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=args.init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.collective_timeout))
    mesh = shard_pg = None
    if group_size < world:  # HSDP: shard within a group of group_size, replicate across groups.
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (world // group_size, group_size), mesh_dim_names=("replicate", "shard"))
        shard_pg = mesh.get_group("shard")
    counters = types.SimpleNamespace(gathered=0)
    count_all_gathers(counters, group_size)
    api = build_model(args, device)
    specs = make_specs(api.model, api.tower)
    for layer in api.decoder_layers:
        fsdp2.fully_shard(layer, mesh=mesh)
    ctl = fsdp2.shard(api.model, specs, mesh=mesh)
    optimizer = torch.optim.AdamW([p for p in api.model.parameters() if p.requires_grad], lr=1e-5)
    return types.SimpleNamespace(args=args, torch=torch, dist=dist, rank=rank, world=world, group_size=group_size,
                                 cuda=cuda, device=device, shard_pg=shard_pg, counters=counters, api=api, specs=specs,
                                 ctl=ctl, optimizer=optimizer, meter=None, stopped=False, published=None,
                                 step_seconds=0.0, round_seconds=0.0)


def stamp(ctx) -> Any:
    if not ctx.cuda:
        return time.perf_counter()
    event = ctx.torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def seconds(a: Any, b: Any) -> float:
    return a.elapsed_time(b) / 1000.0 if hasattr(a, "elapsed_time") else b - a


def in_band(ctx, tower: str, calls: int) -> types.SimpleNamespace:
    """per_layer_allreduce: one all-reduce(MAX) of (calls, -calls) over the shard group per microbatch."""
    flags = ctx.torch.tensor([calls, -calls], dtype=ctx.torch.int32, device=ctx.device)
    ctx.dist.all_reduce(flags, op=ctx.dist.ReduceOp.MAX, group=ctx.shard_pg)
    most, minus_fewest = flags.tolist()
    fewest = -minus_fewest
    return static(tower, "skip" if most == 0 else ("per_layer" if most == fewest else "root"))


def decide(ctx, cell: Cell, step: int, mb: int, calls: int) -> Tuple[Any, int, float]:
    """(the group's decision, dummy calls to add, seconds waited for the decision)."""
    tower, p = ctx.api.tower, cell.placement
    if cell.plans is not None:
        w0 = time.perf_counter()
        s, m, _, decision = next(cell.plans)
        assert (s, m) == (step, mb), f"{cell.name}: decision for {(s, m)}, expected {(step, mb)}"
        return decision, 0, time.perf_counter() - w0
    if p == "per_layer_allreduce":
        return in_band(ctx, tower, calls), 0, 0.0
    if p == "per_layer":
        return static(tower, "per_layer" if calls else "skip"), 0, 0.0
    if p == "per_layer_dummy":
        return static(tower, "per_layer" if cell.dummies else "skip"), cell.dummies - calls, 0.0
    return static(tower, "root" if p in ("root", "root_hold") else p), 0, 0.0


def run_microbatch(ctx, cell: Cell, step: int, mb: int, measured: bool) -> int:
    """One microbatch under the cell's placement; returns its real tokens."""
    micro = cell.data.micro(ctx.rank, step, mb)
    calls = len(micro.calls)
    decision, dummies, waited = decide(ctx, cell, step, mb, calls)
    kind = decision.modules[ctx.api.tower].decision
    if measured:
        cell.decisions[kind] = cell.decisions.get(kind, 0) + 1
        cell.stalls += waited > 1e-3
        cell.wait_max = max(cell.wait_max, waited)
    if ctx.meter is not None:
        ctx.meter.next_microbatch()
    ctx.ctl.begin_microbatch(decision, calls={ctx.api.tower: calls + dummies})
    ctx.api.model.set_requires_gradient_sync(mb == ctx.args.accum - 1)
    batch = ctx.api.batch(micro, ctx.rank * 1_000_003 + step * 101 + mb)
    loss = ctx.api.loss(batch, dummies)
    loss.backward()
    ctx.ctl.end_microbatch()
    return ctx.api.tokens(micro, batch)


def run_step(ctx, cell: Cell, measured: bool) -> Tuple[Any, Any, int, int]:
    """(start stamp, end stamp, tokens, bytes all-gathered) of the cell's next step."""
    t0, g0, tokens = stamp(ctx), ctx.counters.gathered, 0
    for mb in range(ctx.args.accum):
        tokens += run_microbatch(ctx, cell, cell.step, mb, measured)
    ctx.optimizer.step()
    ctx.optimizer.zero_grad(set_to_none=True)
    t1 = stamp(ctx)
    if ctx.meter is not None and cell.worker is not None:
        ctx.meter.end_step()
        try:  # What cost-aware `auto` decides by: Worker.report_costs (rate-limited by the worker).
            ctx.meter.report(cell.worker)
        except AttributeError:  # A Python package newer than its binding: no report_costs there.
            ctx.meter = None
    cell.step += 1
    return t0, t1, tokens, ctx.counters.gathered - g0


def run_visit(ctx, cell: Cell, warm: int, measured: int) -> None:
    """``warm`` steps, then ``measured`` steps whose numbers go into the cell (rank 0 keeps them)."""
    torch = ctx.torch
    ctx.ctl.release()  # The previous cell's replica: freed (local).
    ctx.ctl.root_release = "end_of_microbatch" if cell.placement == "root_hold" else "after_forward"
    stalls0 = cell.stalls
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    records = [run_step(ctx, cell, i >= warm) for i in range(warm + measured)][warm:]
    if ctx.cuda:
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() if ctx.cuda else 0
    times = torch.tensor([seconds(a, b) for a, b, _, _ in records], dtype=torch.float64, device=ctx.device)
    tokens = torch.tensor([t for _, _, t, _ in records], dtype=torch.float64, device=ctx.device)
    extra = torch.tensor([peak, cell.stalls - stalls0, cell.wait_max], dtype=torch.float64, device=ctx.device)
    ctx.dist.all_reduce(times, op=ctx.dist.ReduceOp.MAX)  # A step takes the slowest rank's time,
    ctx.dist.all_reduce(tokens)                           # and every rank's tokens.
    ctx.dist.all_reduce(extra, op=ctx.dist.ReduceOp.MAX)
    cell.visits += 1
    ctx.step_seconds = max([ctx.step_seconds] + times.tolist())  # For the deadline's estimates.
    if ctx.rank == 0:
        cell.rounds.append([n / t for n, t in zip(tokens.tolist(), times.tolist())])
        cell.step_ms += [1000 * t for t in times.tolist()]
        cell.gathered += [g for _, _, _, g in records]
        cell.peak = max(cell.peak, extra[0].item())
        cell.stalls = stalls0 + int(extra[1].item())
        cell.wait_max = extra[2].item()


def tower_bytes(ctx) -> int:
    return ctx.specs[0].param_bytes


def regime(args: argparse.Namespace, tower: int) -> str:
    if args.memory_budget_bytes >= tower > 0:
        return "a: the replica fits"
    return "b: the replica does not fit"


def measured_steps(args: argparse.Namespace) -> List[int]:
    """The steps every cell measures (each cell walks the same steps from 0, run_rounds' schedule):
    per round, after --visit-warmup steps (and --warmup more at the first visit), --steps-per-round.
    Fewer when the deadline cut the rounds short."""
    out, step = [], 0
    for r in range(args.repeats):
        step += args.visit_warmup + (args.warmup if r == 0 else 0)
        out += range(step, step + args.steps_per_round)
        step += args.steps_per_round
    return out


def make_cells(ctx, data: Data) -> List[Cell]:
    """The mix's cells in --placements order, the unsafe or unfitting ones marked skipped, and the
    A/A copy of the first one that runs (named NAME#2) last."""
    args = ctx.args
    fits = regime(args, tower_bytes(ctx)).startswith("a")
    cells = []
    for p in args.placements:
        skipped = ""
        if p == "per_layer" and not data.uniform:
            skipped = "unsafe: ranks disagree, static per_layer would hang"
        elif p == "replicate" and not fits:
            skipped = "regime b: the replica does not fit --memory-budget-bytes"
        cells.append(Cell(p, p, data, skipped=skipped))
    runnable = [c for c in cells if not c.skipped]
    if args.aa and runnable:
        cells.append(Cell(runnable[0].name + "#2", runnable[0].placement, data))
    return cells


def open_worker(ctx, cell: Cell, total_steps: int, run_id: str) -> None:
    """A shardcoord job for the cell (its own; every rank), plans kept 4 microbatches ahead."""
    import shardcoord
    import shardcoord.torch as sct

    args, data, tower = ctx.args, cell.data, ctx.api.tower
    policy, fallback = SC_PLACEMENTS[cell.placement]
    job = f"matrix-{run_id}-{data.name}-{cell.name}".replace("#", "-").replace("@", "-")
    cell.worker = shardcoord.Worker(job, ctx.specs, ctx.group_size, rank=ctx.rank, world_size=ctx.world,
                                    address=args.coordinator, policy=policy, fallback=fallback, lookahead=4,
                                    memory_budget_bytes=args.memory_budget_bytes if policy == "auto" else 0)
    accum = args.accum
    keys = ((i // accum, i % accum, data.calls(ctx.rank, i // accum, i % accum)) for i in range(total_steps * accum))
    cell.plans = iter(sct.PlanAhead(cell.worker, keys, lambda calls: {tower: calls}, timeout=30))


def out_of_time(ctx, estimate: float) -> bool:
    """Whether a round of ``estimate`` seconds would pass the deadline, agreed by every rank."""
    late = time.time() + estimate > ctx.args.deadline
    flag = ctx.torch.tensor([int(late)], dtype=ctx.torch.int32, device=ctx.device)
    ctx.dist.all_reduce(flag, op=ctx.dist.ReduceOp.MAX)
    return bool(flag.item())


def run_rounds(ctx, cells: List[Cell]) -> int:
    """The interleaved rounds; returns how many ran (fewer when the deadline came first)."""
    args = ctx.args
    for r in range(args.repeats):
        if out_of_time(ctx, 1.2 * ctx.round_seconds):  # The longest round so far, any mix.
            ctx.stopped = True
            return r
        t0 = time.time()
        for cell in round_order(cells, r):
            run_visit(ctx, cell, args.visit_warmup + (args.warmup if cell.visits == 0 else 0), args.steps_per_round)
        ctx.round_seconds = max(ctx.round_seconds, time.time() - t0)
    return args.repeats


def run_mix(ctx, mix: str, run_id: str) -> None:
    args = ctx.args
    data = Data(mix, args, ctx.published, mode="per_kind" if args.model == "hf-qwen2vl" else None)
    cells = make_cells(ctx, data)
    active = [c for c in cells if not c.skipped]
    total_steps = args.warmup + args.repeats * (args.visit_warmup + args.steps_per_round)
    dummies = data.max_calls(ctx.world, total_steps, args.accum)
    for c in active:
        c.dummies = dummies
    try:
        for c in active:
            if c.placement.startswith("sc_"):
                open_worker(ctx, c, total_steps, run_id)
        rounds = run_rounds(ctx, active)
    finally:
        for c in active:
            if c.worker is not None:
                c.worker.close()
    if ctx.rank == 0:
        report_mix(ctx, data, cells, rounds)


CI_METHOD = ("bootstrap over rounds: whole rounds resampled with replacement 2000 times, the median of "
             "the pooled steps each time; 2.5th-97.5th percentile")


def pct(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(100 * x, 2)


def cell_record(ctx, data: Data, cell: Cell, ref: Optional[Cell]) -> Dict[str, Any]:
    args = ctx.args
    rec: Dict[str, Any] = {"mix": data.name, "placement": cell.name, "base_placement": cell.placement,
                           "regime": regime(args, tower_bytes(ctx)), "samples_per_microbatch": data.samples}
    if cell.skipped:
        return dict(rec, skipped=cell.skipped)
    if not cell.rounds:
        return dict(rec, not_reached="the deadline came first", hung=False)
    steps = [x for r in cell.rounds for x in r]
    ci = bootstrap_ci(cell.rounds)
    rec.update(rounds=len(cell.rounds), steps=len(steps), tok_s_median=round(pooled_median(cell.rounds)),
               tok_s_ci95=[round(x) for x in ci] if ci else None, ci_method=CI_METHOD, tok_s_min=round(min(steps)),
               tok_s_max=round(max(steps)), step_ms_median=round(statistics.median(cell.step_ms), 1),
               step_ms_mean=round(statistics.mean(cell.step_ms), 1),
               per_round_median=[round(statistics.median(r)) for r in cell.rounds],
               peak_gib=round(cell.peak / 2**30, 3),
               gathered_gib_per_step=round(statistics.mean(cell.gathered) / 2**30, 3),
               decisions=dict(sorted(cell.decisions.items())),
               stalls=cell.stalls if cell.placement.startswith("sc_") else None,
               decision_wait_ms_max=round(1000 * cell.wait_max, 2) if cell.placement.startswith("sc_") else None,
               root_release="end_of_microbatch" if cell.placement == "root_hold" else "after_forward", hung=False)
    if ref is not None and ref is not cell and ref.rounds:
        diff, dci = paired_diff(ref.rounds, cell.rounds)
        rec.update(vs=ref.name, vs_pct=pct(diff), vs_ci95_pct=[pct(x) for x in dci] if dci else None,
                   peak_vs_gib=round((cell.peak - ref.peak) / 2**30, 3))
    return rec


def report_mix(ctx, data: Data, cells: List[Cell], rounds: int) -> None:
    """Rank 0: a CELL line per cell and a MIX line (the A/A difference) for the launcher."""
    runnable = [c for c in cells if not c.skipped]
    ref = runnable[0] if runnable else None
    for cell in cells:
        print("CELL " + json.dumps(cell_record(ctx, data, cell, ref)), flush=True)
    aa = None
    copy = next((c for c in cells if c.name.endswith("#2")), None)
    if copy is not None and ref is not None and ref.rounds and copy.rounds:
        diff, ci = paired_diff(ref.rounds, copy.rounds)
        aa = {"a1": ref.name, "a2": copy.name, "diff_pct": pct(diff), "ci95_pct": [pct(x) for x in ci] if ci else None,
              "formula": "(median_A2 - median_A1) / median_A1"}
    print("MIX " + json.dumps({
        "mix": data.name, "regime": regime(ctx.args, tower_bytes(ctx)), "samples_per_microbatch": data.samples,
        "calls": data.mode, "rounds": rounds, "cut_short": rounds < ctx.args.repeats,
        "reference": ref.name if ref else None, "aa": aa, "ci_method": CI_METHOD}), flush=True)


# ---------------------------------------------------------------------------------------------
# Calibration: the cost model of this run (--cost-out)

def calib_phase(ctx, data: Data, kind: str, first_step: int, meter) -> Tuple[List[float], List[float]]:
    """--calibration-steps steps, every rank under the static ``kind``: (seconds per microbatch,
    seconds per optimizer step), from CUDA events read at the end."""
    tower, accum, model = ctx.api.tower, ctx.args.accum, ctx.api.model
    mbs, opts = [], []
    for step in range(first_step, first_step + ctx.args.calibration_steps):
        for mb in range(accum):
            micro = data.micro(ctx.rank, step, mb)
            meter.next_microbatch()
            a = stamp(ctx)
            ctx.ctl.begin_microbatch(static(tower, kind), calls={tower: len(micro.calls)})
            model.set_requires_gradient_sync(mb == accum - 1)
            batch = ctx.api.batch(micro, ctx.rank * 1_000_003 + step * 101 + mb)
            ctx.api.loss(batch, 0).backward()
            ctx.ctl.end_microbatch()
            mbs.append((a, stamp(ctx)))
        o = stamp(ctx)
        ctx.optimizer.step()
        ctx.optimizer.zero_grad(set_to_none=True)
        opts.append((o, stamp(ctx)))
    if ctx.cuda:
        ctx.torch.cuda.synchronize()
    return [seconds(a, b) for a, b in mbs], [seconds(a, b) for a, b in opts]


def calibrate(ctx) -> None:
    """Text-only microbatches under skip (other_seconds_per_microbatch), microbatches with media
    under replicate (the tower's forward per call) and under root (each unit's gather), measured by
    shardcoord.torch.CostMeter; the slowest rank's numbers. Rank 0 prints a COST line."""
    from shardcoord.torch._costs import CostMeter

    args, torch = ctx.args, ctx.torch
    if ctx.meter is not None:
        ctx.meter.detach()
        ctx.meter = None
    ctx.ctl.release()
    ctx.ctl.root_release = "after_forward"
    meter = CostMeter.attach(ctx.api.model, ctx.specs, window=1024)
    text, media = Data("none", args, {}), Data("all", args, {})
    mb_s, opt_s = calib_phase(ctx, text, "skip", 1_000_000, meter)
    media_s, _ = calib_phase(ctx, media, "replicate", 2_000_000, meter)
    ctx.ctl.release()
    calib_phase(ctx, media, "root", 3_000_000, meter)
    meter.next_microbatch()
    [(name, forward, measured)] = meter.costs()
    meter.detach()
    units = [u for u in ctx.specs[0].units if u.name]  # The rest unit "" is in FSDP's root unit.
    gathers = {u: s for u, _, s in measured}
    # What one call adds to the rest of the model (the decoder on its image tokens): a media
    # microbatch (one batched call) under replicate, less a text-only one and the tower's forward.
    per_call = max(0.0, statistics.median(media_s) - statistics.median(mb_s) - forward)
    per_token, text_tokens = token_fit(ctx, text, media, mb_s, media_s, forward)
    vec = torch.tensor([statistics.median(mb_s) + statistics.median(opt_s) / args.accum, forward, per_call,
                        per_token, text_tokens] + [gathers.get(u.name, 0.0) for u in units],
                       dtype=torch.float64, device=ctx.device)
    ctx.dist.all_reduce(vec, op=ctx.dist.ReduceOp.MAX)
    if ctx.rank == 0:
        print("COST " + json.dumps(cost_record(ctx, name, units, vec.tolist())), flush=True)


def token_fit(ctx, text: Data, media: Data, text_s: List[float], media_s: List[float],
              forward: float) -> Tuple[float, int]:
    """(other_seconds_per_token, other_tokens_per_microbatch): the decoder's seconds per token
    (forward and backward, the optimizer's share excluded), and the tokens of the text-only
    microbatch that other_seconds_per_microbatch was measured on, which the line passes through.

    Each calibration microbatch is a point (its decoder tokens, its seconds less the tower's
    forward per call it made); the two phases have two token counts (text only; every sample with
    an image), and the least-squares line through points at two x values passes through the two
    groups' means. Medians stand in for the means (one slow microbatch, an allocator pause, must
    not tilt the line). Its slope is per token; its intercept can be negative (attention grows
    faster than linearly with the tokens), so the cost file keeps the text-only point instead:
    the planner prices a microbatch of N tokens at other_seconds_per_microbatch +
    other_seconds_per_token x (N - other_tokens_per_microbatch). Between the two token counts it
    interpolates; above the media phase's count it extrapolates a line under a slightly convex
    curve (the error is measured in docs/GPU.md)."""
    size, model, step = SIZES[ctx.args.size], ctx.args.model, 1_000_000
    text_tokens = decoder_tokens(size, model, text.micro(ctx.rank, step, 0))
    media_tokens = decoder_tokens(size, model, media.micro(ctx.rank, step, 0))
    if media_tokens <= text_tokens:
        return 0.0, text_tokens
    # The media phase makes one batched call per microbatch (Data("all")): one forward to take away.
    rise = statistics.median(media_s) - forward - statistics.median(text_s)
    return max(0.0, rise / (media_tokens - text_tokens)), text_tokens


def cost_record(ctx, name: str, units: List[Any], vec: List[float]) -> Dict[str, Any]:
    one = ctx.group_size == 1
    notes = [f"{ctx.args.samples_per_microbatch} samples per microbatch ({SIZES[ctx.args.size].text_tokens} text "
             f"tokens each, images of {SIZES[ctx.args.size].image_tokens} tokens), {ctx.args.accum} microbatches per "
             f"step, model {ctx.args.model} size {ctx.args.size}; {ctx.args.calibration_steps} steps per phase",
             "the tower's rest unit (outside its layer list) is in FSDP's root unit, gathered in every forward under "
             "every decision: its cost is in other_seconds_per_microbatch"]
    if one:
        notes.append("one rank per shard group: nothing is all-gathered (FSDP2 copies the shard), so gather_seconds "
                     "are 0; measure on 2 or more GPUs for the gathers")
    notes.append(f"other_seconds_per_token: the decoder's seconds per token (forward and backward), the line "
                 f"through the text-only phase ({int(vec[4])} tokens a microbatch) and the media phase, less the "
                 f"tower's forward; used by `shardctl plan` on traces with tokens (bench/policy_matrix.py token_fit)")
    gathers = [0.0 if one else round(s, 7) for s in vec[5:]]
    return {
        "format": COST_FORMAT, "group_size": ctx.group_size, "other_seconds_per_microbatch": round(vec[0], 7),
        "other_seconds_per_token": round(vec[3], 10), "other_tokens_per_microbatch": int(vec[4]),
        "modules": [{"name": name, "param_bytes": tower_bytes(ctx), "forward_seconds_per_call": round(vec[1], 7),
                     "other_seconds_per_call": round(vec[2], 7),
                     "units": [{"name": u.name, "param_bytes": u.param_bytes, "gather_bytes": u.param_bytes,
                                "gather_seconds": s} for u, s in zip(units, gathers)]}],
        "notes": notes}


def rank_main(args: argparse.Namespace) -> int:
    ctx = setup(args)
    ctx.published = load_make_trace().MIXES
    if args.report_costs and any(p.startswith("sc_") for p in args.placements):
        from shardcoord.torch._costs import CostMeter
        # Every cell runs with its hooks (fair); the replicas fsdp2 holds count as held memory.
        ctx.meter = CostMeter.attach(ctx.api.model, ctx.specs, held_outside=ctx.ctl.held_outside_bytes)
    if ctx.rank == 0:
        print("INFO " + json.dumps(info_record(ctx)), flush=True)
    for mix in args.mixes:
        if ctx.stopped:
            break
        run_mix(ctx, mix, args.run_id)
    if args.calibrate and not ctx.stopped:
        if out_of_time(ctx, 3 * args.calibration_steps * max(ctx.step_seconds, 1.0) + 10):
            if ctx.rank == 0:
                print("[rank 0] calibration skipped: the deadline would pass", flush=True)
        else:
            calibrate(ctx)
    ctx.dist.destroy_process_group()
    return 0


def info_record(ctx) -> Dict[str, Any]:
    torch, args, model = ctx.torch, ctx.args, ctx.api.model
    spec = ctx.specs[0]
    return {
        "torch": torch.__version__, "device": torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu",
        "gpus": ctx.world, "group_size": ctx.group_size, "model": args.model, "size": args.size,
        "config": asdict(SIZES[args.size]), "tower": ctx.api.tower,
        "tower_params": sum(p.numel() for p in model.get_submodule(ctx.api.tower).parameters()),
        "total_params": sum(p.numel() for p in model.parameters()),  # DTensor.numel() is the global count
        "samples_per_microbatch": args.samples_per_microbatch, "accum": args.accum,
        "schedule": {"repeats": args.repeats, "steps_per_round": args.steps_per_round,
                     "visit_warmup": args.visit_warmup, "warmup": args.warmup},
        "memory_budget_bytes": args.memory_budget_bytes, "regime": regime(args, spec.param_bytes),
        "manifest": [{"name": spec.name, "param_bytes": spec.param_bytes, "outside_inner_root": False,
                      "units": [{"name": u.name, "param_bytes": u.param_bytes} for u in spec.units]}]}


# ---------------------------------------------------------------------------------------------
# The launcher

def fmt_pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:+.1f} %"


def fmt_ci(ci: Optional[List[float]]) -> str:
    """A tokens/s interval: ' [lo-hi]'."""
    return f" [{ci[0]}-{ci[1]}]" if ci else ""


def fmt_pct_ci(ci: Optional[List[float]]) -> str:
    """A percent interval: ' [+lo, +hi] %'."""
    return f" [{ci[0]:+.1f}, {ci[1]:+.1f}] %" if ci else ""


def cell_row(c: Dict[str, Any]) -> str:
    if "tok_s_median" not in c:
        why = c.get("skipped") or c.get("not_reached") or ("HUNG" if c.get("hung") else "not run")
        return f"| {c['placement']} | {why} | | | | | | | |"
    kinds = " ".join(f"{k}={v}" for k, v in c["decisions"].items())
    vs = "-" if "vs" not in c else fmt_pct(c["vs_pct"]) + fmt_pct_ci(c.get("vs_ci95_pct"))
    dm = "-" if "vs" not in c else f"{c['peak_vs_gib']:+.2f}"
    stalls = "-" if c["stalls"] is None else c["stalls"]
    return (f"| {c['placement']} | {c['tok_s_median']}{fmt_ci(c['tok_s_ci95'])} | {c['tok_s_min']}-{c['tok_s_max']} | "
            f"{vs} | {c['peak_gib']:.2f} | {dm} | {c['gathered_gib_per_step']} | {kinds} | {stalls} |")


def aa_line(m: Dict[str, Any]) -> str:
    aa = m.get("aa")
    if not aa:
        return "A/A difference: not measured (--no-aa, or a cell not reached)"
    verdict = "under 3 %" if abs(aa["diff_pct"]) < 3 else "NOT under 3 %"
    return (f"A/A difference ({aa['a2']} vs {aa['a1']}) = {aa['diff_pct']:+.2f} %"
            f"{fmt_pct_ci(aa['ci95_pct'])} (95 % CI): {verdict}")


def table(cells: List[Dict[str, Any]], mixes: List[Dict[str, Any]], order: List[str]) -> str:
    out = []
    for m in mixes:
        rows = [c for c in cells if c["mix"] == m["mix"]]
        rows.sort(key=lambda c: (order.index(c["placement"].split("#")[0]) if c["placement"].split("#")[0] in order
                                 else len(order), c["placement"]))
        ref = m.get("reference") or "-"
        cut = ", cut short by the deadline" if m["cut_short"] else ""
        out.append(f"\nmix `{m['mix']}` (regime {m['regime']}; {m['samples_per_microbatch']} samples per microbatch, "
                   f"calls {m['calls']}; {m['rounds']} rounds{cut})")
        out.append(aa_line(m) + "\n")
        out.append(f"| placement | tokens/s median [95 % CI] | min-max | vs {ref} [95 % CI] | peak GiB | vs {ref} | "
                   f"all-gathered GiB/step | decisions (measured steps) | stalls |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        out += [cell_row(c) for c in rows]
    return "\n".join(out)


def write_traces(args: argparse.Namespace, info: Dict[str, Any], published: Dict[str, Any]) -> None:
    """Per mix, the calls and decoder tokens of every rank, step and microbatch the run planned
    (shardctl plan / replay): MIX.jsonl every step, warm-up steps included; MIX.measured.jsonl only the
    steps whose times the cells' medians and means are of (measured_steps), to plan against them."""
    os.makedirs(args.trace_dir, exist_ok=True)
    total_steps = args.warmup + args.repeats * (args.visit_warmup + args.steps_per_round)
    measured = set(measured_steps(args))
    tower, size = info.get("tower", "visual"), SIZES[args.size]
    for mix in args.mixes:
        data = Data(mix, args, published, mode="per_kind" if args.model == "hf-qwen2vl" else None)
        base = os.path.join(args.trace_dir, mix.replace("@", "_at_"))
        with open(base + ".jsonl", "w") as every, open(base + ".measured.jsonl", "w") as timed:
            for step in range(total_steps):
                for mb in range(args.accum):
                    for rank in range(args.gpus):
                        micro = data.micro(rank, step, mb)
                        line = {"rank": rank, "step": step, "microbatch": mb, "calls": {tower: len(micro.calls)},
                                "tokens": decoder_tokens(size, args.model, micro)}
                        text = json.dumps(line, separators=(",", ":")) + "\n"
                        every.write(text)
                        if step in measured:
                            timed.write(text)


def write_cost(args: argparse.Namespace, cost: Dict[str, Any], info: Dict[str, Any]) -> None:
    notes = cost.pop("notes", [])
    machine = f"{socket.gethostname()}: {args.gpus} x {info.get('device', '?')}"
    measured = {"command": shlex.join([sys.executable, os.path.abspath(__file__)] + sys.argv[1:]),
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "machine": machine, "torch": info.get("torch", "?"), "gpus": args.gpus, "notes": notes}
    doc = {"format": cost["format"], "measured": measured}
    doc.update((k, v) for k, v in cost.items() if k != "format")
    with open(args.cost_out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"cost model: {args.cost_out}")


def parse_args(published: Dict[str, Any]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shardcoordd", help="the daemon binary (started by the launcher; needed for sc_* placements)")
    ap.add_argument("--gpus", type=int, default=2, help="ranks, one GPU each (default 2; 1 works)")
    ap.add_argument("--group-size", type=int, default=0, help="shard group size (default: --gpus)")
    ap.add_argument("--model", choices=MODELS, default="builtin",
                    help="builtin (default) or hf-qwen2vl (transformers' Qwen2.5-VL class, random weights)")
    ap.add_argument("--size", choices=sorted(SIZES), default="vlm",
                    help="model size preset (default vlm: GPU-bound steps; small's are partly host-bound, noisier)")
    ap.add_argument("--quick", action="store_true",
                    help="--size quick, 2 rounds of 1 step, 1 warm-up step: checks the harness")
    ap.add_argument("--mixes", nargs="+", default=SYNTHETIC_MIXES, type=lambda m: check_mix(m, published),
                    metavar="MIX", help=f"synthetic {SYNTHETIC_MIXES}, or published NAME[@S] (--list-mixes)")
    ap.add_argument("--list-mixes", action="store_true", help="print the published mixes and exit")
    ap.add_argument("--placements", nargs="+", default=PLACEMENTS, choices=PLACEMENTS)
    ap.add_argument("--aa", action=argparse.BooleanOptionalAction, default=True,
                    help="run a second copy of the first placement (NAME#2) for the A/A check (default on)")
    ap.add_argument("--samples-per-microbatch", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4, help="microbatches per step (default 4)")
    ap.add_argument("--video-frames", type=int, default=2, help="images a video counts for (default 2)")
    ap.add_argument("--max-images", type=int, default=8, help="images per tower call at most (default 8)")
    ap.add_argument("--repeats", type=int, default=6, help="rounds (default 6)")
    ap.add_argument("--steps-per-round", type=int, default=2, help="measured steps per cell and round (default 2)")
    ap.add_argument("--visit-warmup", type=int, default=1, help="unmeasured steps at each visit (default 1)")
    ap.add_argument("--warmup", type=int, default=2, help="extra unmeasured steps at a cell's first visit (default 2)")
    ap.add_argument("--memory-budget-bytes", type=int, default=8 << 30,
                    help="sc_auto's budget (default 8 GiB: the replica fits, regime a); below the tower's bytes "
                         "auto cannot replicate and static replicate is skipped (regime b)")
    ap.add_argument("--report-costs", action=argparse.BooleanOptionalAction, default=True,
                    help="shardcoord cells report CostMeter's measures to the coordinator (default on)")
    ap.add_argument("--cost-out", help="write the cost model measured in this run here (shardcoord.cost/v1)")
    ap.add_argument("--calibration-steps", type=int, default=3, help="steps per calibration phase (default 3)")
    ap.add_argument("--manifest-out", help="write the tower's manifest here (shardctl plan --manifest)")
    ap.add_argument("--trace-dir", help="write each mix's plans here as MIX.jsonl (shardctl plan / replay)")
    ap.add_argument("--timeout", type=float, default=540, help="seconds for the whole run (default 540)")
    ap.add_argument("--collective-timeout", type=float, default=120)
    ap.add_argument("--json", help="write the run here (JSON lines: info, then cells and mixes)")
    ap.add_argument("--sync-debug", action="store_true",
                    help="diagnostics: torch warns at every call that synchronizes with the GPU")
    for hidden in ("--init-method", "--coordinator", "--run-id"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--calibrate", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.size, args.repeats, args.steps_per_round, args.warmup = "quick", 2, 1, 1
    numbers = ("gpus", "samples_per_microbatch", "accum", "video_frames", "max_images", "repeats", "steps_per_round",
               "calibration_steps")
    bad = [n for n in numbers if getattr(args, n) < 1] + [n for n in ("visit_warmup", "warmup", "group_size")
                                                           if getattr(args, n) < 0]
    if bad:
        ap.error("must be >= 1 (>= 0 for --visit-warmup, --warmup, --group-size): "
                 + ", ".join(f"--{n.replace('_', '-')} {getattr(args, n)}" for n in bad))
    if args.timeout <= 0:
        ap.error(f"--timeout {args.timeout} must be > 0 seconds")
    if args.gpus % (args.group_size or args.gpus):
        ap.error(f"--gpus {args.gpus} must be >= 1 and a multiple of --group-size {args.group_size}")
    needs_daemon = any(p.startswith("sc_") for p in args.placements) and not (args.rank_main or args.list_mixes)
    if needs_daemon and not args.shardcoordd:
        ap.error("--shardcoordd is required for the sc_* placements")
    return args


def start_daemon(args: argparse.Namespace, tmp: str) -> Tuple[Optional[subprocess.Popen], str]:
    """shardcoordd on a free loopback port, when a shardcoord cell needs one: (process, address)."""
    if not any(p.startswith("sc_") for p in args.placements):
        return None, ""
    addr_file = os.path.join(tmp, "addr")
    daemon = subprocess.Popen([args.shardcoordd, "--listen", "127.0.0.1:0", "--address-file", addr_file,
                               "--log-level", "warn"])
    deadline = time.monotonic() + 20
    while not (os.path.exists(addr_file) and open(addr_file).read().strip()):
        if daemon.poll() is not None or time.monotonic() > deadline:
            daemon.kill()
            daemon.wait()
            raise SystemExit(f"shardcoordd did not start within 20 s (exit status {daemon.returncode})")
        time.sleep(0.05)
    return daemon, open(addr_file).read().strip()


def run_ranks(args: argparse.Namespace, tmp: str, address: str, got: Dict[str, Any]) -> None:
    """The rank processes (rank 0's stdout read here), until rank 0 ends or --timeout; then every
    one is killed if still running."""
    start = time.monotonic()
    child = [sys.executable, os.path.abspath(__file__)] + sys.argv[1:] + [
        "--rank-main", "--init-method", f"file://{tmp}/store", "--coordinator", address,
        "--run-id", f"{os.getpid()}-{int(time.time())}", "--deadline", str(time.time() + args.timeout - 15)]
    child += ["--calibrate"] if args.cost_out else []
    procs = []
    try:
        for r in range(args.gpus):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.gpus))
            procs.append(subprocess.Popen(child, env=env, text=True,
                                          stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL))
        reader = threading.Thread(target=read_rank0, args=(procs[0], got), daemon=True)
        reader.start()
        while time.monotonic() - start < args.timeout and procs[0].poll() is None:
            time.sleep(0.2)
        reader.join(5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def read_rank0(proc: subprocess.Popen, got: Dict[str, Any]) -> None:
    for line in proc.stdout:
        kind, _, rest = line.partition(" ")
        if kind in ("INFO", "CELL", "MIX", "COST"):
            print(line, end="", flush=True)
            record = json.loads(rest)
            if kind == "INFO":
                got["info"] = record
            elif kind == "COST":
                got["cost"] = record
            else:
                got["cells" if kind == "CELL" else "mixes"].append(record)
        else:
            print(f"[rank 0] {line}", end="", flush=True)


def main() -> int:
    published = load_make_trace().MIXES
    args = parse_args(published)
    if args.rank_main:
        return rank_main(args)
    if args.list_mixes:
        for name, mix in sorted(published.items()):
            total = sum(w for w, _ in mix.weights)
            print(f"{name}: " + ", ".join(f"{m.__name__} {w / total:.1%}" for w, m in mix.weights)
                  + f"; calls {mix.calls}")
        return 0
    if args.model == "hf-qwen2vl" and importlib.util.find_spec("transformers") is None:
        print("SKIP: --model hf-qwen2vl needs the transformers package (the GPU machine's torch venv has 5.x); "
              "the builtin model runs without it")
        return 0
    got: Dict[str, Any] = {"info": {}, "cells": [], "mixes": [], "cost": None}
    with tempfile.TemporaryDirectory(prefix="policy_matrix-") as tmp:
        daemon, address = start_daemon(args, tmp)
        try:
            run_ranks(args, tmp, address, got)
        finally:
            if daemon is not None:
                daemon.terminate()
                try:
                    daemon.wait(10)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
    return finish(args, got, published)


def finish(args: argparse.Namespace, got: Dict[str, Any], published: Dict[str, Any]) -> int:
    """Marks what never reported, writes the files asked for, prints the tables."""
    cells, mixes, info = got["cells"], got["mixes"], got["info"]
    reported = {m["mix"] for m in mixes}
    for mix in args.mixes:
        if mix not in reported:  # Killed at --timeout, or a rank failed: nothing of this mix came back.
            cells += [{"mix": mix, "placement": p, "hung": True} for p in args.placements]
            mixes.append({"mix": mix, "regime": info.get("regime", "?"), "samples_per_microbatch": "?", "calls": "?",
                          "rounds": 0, "cut_short": True, "reference": None, "aa": None})
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps({"info": info}) + "\n")
            for record in cells:
                f.write(json.dumps(dict(record, kind="cell")) + "\n")
            for record in mixes:
                f.write(json.dumps(dict(record, kind="mix")) + "\n")
    if args.manifest_out and info.get("manifest"):
        with open(args.manifest_out, "w") as f:
            json.dump({"modules": info["manifest"]}, f, indent=1)
    if args.trace_dir:
        write_traces(args, info, published)
    if args.cost_out:
        if got["cost"] is not None:
            write_cost(args, got["cost"], info)
        else:
            print(f"no cost model: the calibration did not run (deadline or failure); {args.cost_out} not written")
    print(table(cells, mixes, PLACEMENTS))
    hung = [f"{c['mix']}/{c['placement']}" for c in cells if c.get("hung")]
    print(f"\n{len(cells) - len(hung)} cells measured or skipped, {len(hung)} hung or not run {hung}")
    return 0 if not hung and (got["cost"] is not None or not args.cost_out) else 1


if __name__ == "__main__":
    sys.exit(main())
