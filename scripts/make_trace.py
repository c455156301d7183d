#!/usr/bin/env python3
"""Writes a plan trace for `shardctl replay` (JSON lines): per rank and microbatch, how often it
calls each frozen module.

Without --mix, a synthetic mixed-modality trace (unchanged; it wrote
examples/traces/mixed_8ranks.jsonl). Group layout is contiguous blocks of --group-size ranks. Per
group, a microbatch is "uniform image" (every rank has images), "text only" (nobody does) or
"mixed" (some ranks do); audio appears on whole groups at once or on single ranks.

  python3 scripts/make_trace.py --world-size 8 --group-size 4 --steps 10 \\
      --microbatches 4 --seed 7 > examples/traces/mixed_8ranks.jsonl

With --mix NAME, a trace from a published training mix (docs/MIXES.md; --list-mixes prints
them): every rank draws --microbatches x --samples-per-microbatch samples per step from the mix,
independently; --arrange says how they become microbatches; the calls are those the model makes
on each microbatch (--calls, default the mix's model's). --group-size plays no part: the trace is
per rank, the group size is `shardctl replay`'s.

  --arrange none                draw order, S samples per microbatch
  --arrange spread              shardcoord.sampler.arrange_step per rank and step
  --arrange group_by_modality   one order for the whole job (shardcoord.sampler.group_by_modality,
                                LLaVA's group_by_modality_length) over all ranks' samples, dealt
                                as a distributed loader does: batch b of S samples goes to rank
                                b % W, microbatch (b // W) % A, step b // (W * A). The trace is
                                then one epoch of that sampler, with its mixed leftover steps.

The same --seed draws the same samples for every --arrange: only their placement differs.

With --mix and --tokens, every line also says the decoder tokens of that rank's microbatch
("tokens": N, what `shardctl plan` prices with a cost file's other_seconds_per_token): per sample
--text-tokens, plus --image-tokens per image and per video frame (a video counts --video-frames
frames), plus --audio-tokens per audio clip. The trace cannot know the model's numbers: the
defaults are bench/policy_matrix.py's --size vlm builtin model (2048 text tokens a sample, 1024 an
image, 2 frames a video, audio not counted); give the model's (LLaVA-1.5: 576 an image; Qwen2.5-VL:
its merged patches, e.g. 1024 for a 896 x 896 image).

  python3 scripts/make_trace.py --mix qwen25vl_sft --world-size 32 --steps 20 --microbatches 4 \\
      --samples-per-microbatch 4 --arrange spread > qwen.jsonl
  shardctl replay qwen.jsonl --group-size 8 --policy per_layer
"""
import argparse
import importlib.util
import json
import os
import random
import sys


def load_sampler():
    """shardcoord.sampler from the source tree, without the package's __init__ (which loads the
    compiled binding): this script needs no build."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "python", "shardcoord", "sampler.py")
    spec = importlib.util.spec_from_file_location("shardcoord_sampler", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# The mixes of docs/MIXES.md, as data. A sample is {kind: items}; {} is text only.

VISUAL = "model.visual"
AUDIO = "model.audio_tower"
TOWER_OF = {"image": VISUAL, "video": VISUAL, "audio": AUDIO}


def multi_image_count(rng):
    # ESTIMATED in MIXES.md (not from the sources): 2 images 50%, 3-4 25%, 5-8 20%, 10-12 5%;
    # uniform within a range.
    lo, hi = rng.choices([(2, 2), (3, 4), (5, 8), (10, 12)], weights=[50, 25, 20, 5])[0]
    return rng.randint(lo, hi)


def power_law_exponent(mean, cap):
    """a such that P(k) ~ k^-a on 1..cap has the given mean (bisection; the mean falls as a grows)."""
    lo, hi = 0.0, 10.0
    for _ in range(100):
        a = (lo + hi) / 2
        weights = [k ** -a for k in range(1, cap + 1)]
        m = sum(k * w for k, w in zip(range(1, cap + 1), weights)) / sum(weights)
        lo, hi = (a, hi) if m > mean else (lo, a)
    return (lo + hi) / 2


# MM1 interleaved documents, ESTIMATED in MIXES.md: OBELICS-like, a power law fitted to mean 2.5
# images per document, capped at 16 (median 1: P(1) = 0.57 for the fitted exponent, about 1.78).
_MM1_EXPONENT = power_law_exponent(2.5, 16)
_MM1_WEIGHTS = [k ** -_MM1_EXPONENT for k in range(1, 17)]


def text(rng):
    return {}


def image(rng):
    return {"image": 1}


def two_images(rng):
    return {"image": 2}


def multi_image(rng):
    return {"image": multi_image_count(rng)}


def video(rng):
    return {"video": 1}


def mm1_caption(rng):
    return {"image": 16}  # ESTIMATE: packed caption sequences, 16 images per 4096-token sequence.


def mm1_interleaved(rng):
    return {"image": rng.choices(range(1, 17), weights=_MM1_WEIGHTS)[0]}


class Mix:
    """weights: [(share, sample maker)]; audio: probability that a sample also carries speech,
    independent of the rest; calls: how the mix's model calls its towers (the default --calls)."""

    def __init__(self, weights, calls, audio=0.0):
        self.weights = weights
        self.calls = calls
        self.audio = audio
        self.towers = sorted({VISUAL} | ({AUDIO} if audio else set()))

    def draw(self, rng):
        shares, makers = zip(*self.weights)
        sample = dict(rng.choices(makers, weights=shares)[0](rng))
        if self.audio and rng.random() < self.audio:
            sample["audio"] = 1
        return sample


# How the models call the tower (MIXES.md, last part, and the code named here):
# - LLaVA-1.5 (`llava/model/llava_arch.py`) and LLaVA-NeXT / OneVision (`LLaVA-VL/LLaVA-NeXT`,
#   `prepare_inputs_labels_for_multimodal`: all images and video frames of the batch concatenated
#   into one `encode_images` call): batched. Without padding text-only samples with a zero image
#   (the workaround shardcoord replaces).
# - Qwen2-VL / Qwen2.5-VL: `visual` once for pixel_values, once more for pixel_values_videos: per_kind.
# - VideoLLaMA3: the transformers port (`models/video_llama_3/modeling_video_llama_3.py`,
#   `VideoLlama3Model.forward`) runs `vision_model` once for images and once for videos: per_kind
#   (the original DAMO training code was not checked).
# - Cambrian (several encoders, each once per batch), Idefics2, MM1, VITA-1.5 (vision and audio
#   encoders once per batch each): batched, ASSUMED from their architectures.
MIXES = {
    # LLaVA-1.5 SFT 665K: 40K ShareGPT text-only = 6.0% text, the rest one image. Sure: high.
    "llava15_665k": Mix([(6.0, text), (94.0, image)], "batched"),
    # LLaVA-OneVision single-image stage 3.2M: Language 14.3% (Magpie Pro, text only), the rest one
    # image (AnyRes crops go through one tower call). Sure: high.
    "llava_ov_si": Mix([(14.3, text), (85.7, image)], "batched"),
    # LLaVA-OneVision OneVision stage 1.6M: single-image 31.2% of which ~6.6 points text only
    # (Magpie Pro 90K of the 425.8K listed single-image subsets: derived), multi-image 43.0%
    # (image counts ESTIMATED), video 25.9%. Shares high; text share derived.
    "llava_ov_ov": Mix([(6.6, text), (24.6, image), (43.0, multi_image), (25.9, video)], "batched"),
    # Cambrian-7M: Language 23.8%, the rest one image. Sure: medium (the figure overlays the 10M and
    # 7M rings; 23.8% fits all ~1.7M language samples kept in ~7M).
    "cambrian7m": Mix([(23.8, text), (76.2, image)], "batched"),
    # Idefics2 SFT (The Cauldron + text): per sample ESTIMATED from token shares: ~6.3% text,
    # ~7.4% two images, the rest one image.
    "idefics2_sft": Mix([(6.3, text), (7.4, two_images), (86.3, image)], "batched"),
    # MM1 pre-training: 45% interleaved, 45% image-caption, 10% text (high); images per sequence
    # ESTIMATED (captions packed 16 per sequence; interleaved: the power law above).
    "mm1_pretrain": Mix([(10.0, text), (45.0, mm1_caption), (45.0, mm1_interleaved)], "batched"),
    # Qwen2.5-VL SFT: 50% pure text (high); the multimodal half's split ASSUMED: image 36%,
    # multi-image 4% (counts as above), video 10%.
    "qwen25vl_sft": Mix([(50.0, text), (36.0, image), (4.0, multi_image), (10.0, video)], "per_kind"),
    # VideoLLaMA3 multi-task fine-tuning 19.05M: images 13.51M (scene, document, chart, OCR,
    # grounding) = 70.9%, multi-image 0.41M = 2.2% (counts ESTIMATED), text 2.21M = 11.6%, video
    # 2.92M = 15.3%. Sure: high.
    "videollama3_s3": Mix([(70.9, image), (2.2, multi_image), (11.6, text), (15.3, video)], "per_kind"),
    # VideoLLaMA3 video-centric fine-tuning 5.71M: video 57.3%, image 15.4%, text 27.3%. Sure: high.
    "videollama3_s4": Mix([(57.3, video), (15.4, image), (27.3, text)], "per_kind"),
    # VITA-1.5 stage 2.2: text 8.5%, video 24.3%, image 67.1%; about half of the questions spoken
    # (audio tower), ASSUMED independent of the visual input (so text samples carry speech too).
    # Sure: medium ("approximately half").
    "vita15_audio_sft": Mix([(8.5, text), (24.3, video), (67.1, image)], "batched", audio=0.5),
}


def modality_key(sample, calls):
    """What group_by_modality groups by: the towers a sample needs (batched, per_item: LLaVA's
    multimodal vs text for one tower), or its kinds (per_kind, where images and videos call apart)."""
    if calls == "per_kind":
        parts = sorted(sample)
    else:
        parts = sorted({TOWER_OF[k] for k in sample})
    return "+".join(parts) or "text"


def sample_tokens(sample, a):
    """The decoder tokens one sample ({kind: items}) brings (--tokens; see the top)."""
    return (a.text_tokens + a.image_tokens * (sample.get("image", 0) + a.video_frames * sample.get("video", 0))
            + a.audio_tokens * sample.get("audio", 0))


def mix_trace(a, out):
    sampler = load_sampler()
    mix = MIXES[a.mix]
    calls = a.calls or mix.calls
    W, A, S = a.world_size, a.microbatches, a.samples_per_microbatch
    rng = random.Random(a.seed)
    # draws[step][rank]: that rank's samples of that step, in draw order.
    draws = [[[mix.draw(rng) for _ in range(A * S)] for _ in range(W)] for _ in range(a.steps)]
    identity = lambda s: s  # noqa: E731  (a sample is its media)
    # plan[step][rank] = A lists of samples.
    if a.arrange == "none":
        plan = [[[d[j * S:(j + 1) * S] for j in range(A)] for d in per_rank] for per_rank in draws]
    elif a.arrange == "spread":
        plan = [[sampler.arrange_step(d, A, identity, calls, TOWER_OF) for d in per_rank] for per_rank in draws]
    else:
        dataset = [s for per_rank in draws for d in per_rank for s in d]
        order = sampler.group_by_modality([modality_key(s, calls) for s in dataset], W, A, S, seed=a.seed)
        plan = [[[[] for _ in range(A)] for _ in range(W)] for _ in range(a.steps)]
        for position, index in enumerate(order):
            batch = position // S
            rank, mb, step = batch % W, (batch // W) % A, batch // (W * A)
            plan[step][rank][mb].append(dataset[index])
    for step in range(a.steps):
        for mb in range(A):
            for rank in range(W):
                got = sampler.tower_calls(plan[step][rank][mb], identity, calls, TOWER_OF)
                line = {"rank": rank, "step": step, "microbatch": mb,
                        "calls": {t: got.get(t, 0) for t in mix.towers}}
                if a.tokens:
                    line["tokens"] = sum(sample_tokens(s, a) for s in plan[step][rank][mb])
                out.write(json.dumps(line, separators=(",", ":")) + "\n")


def synthetic_trace(a):
    rng = random.Random(a.seed)
    groups = a.world_size // a.group_size
    for step in range(a.steps):
        for mb in range(a.microbatches):
            for g in range(groups):
                kind = rng.choices(["uniform", "text", "mixed"], weights=[4, 3, 3])[0]
                audio_all = rng.random() < 0.2
                for r in range(g * a.group_size, (g + 1) * a.group_size):
                    if kind == "uniform":
                        images = 1
                    elif kind == "text":
                        images = 0
                    else:
                        images = 1 if rng.random() < a.image_fraction else 0
                    audio = 1 if audio_all or rng.random() < 0.05 else 0
                    calls = {"vision_tower": images, "multi_modal_projector": images,
                             "audio_tower": audio}
                    print(json.dumps({"rank": r, "step": step, "microbatch": mb, "calls": calls},
                                     separators=(",", ":")))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step (gradient accumulation)")
    p.add_argument("--image-fraction", type=float, default=0.5,
                   help="without --mix: probability that a rank's microbatch carries images in a mixed microbatch")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--mix", choices=sorted(MIXES), help="a published training mix (docs/MIXES.md)")
    p.add_argument("--samples-per-microbatch", type=int, default=1, help="with --mix: samples per microbatch")
    p.add_argument("--calls", choices=["batched", "per_kind", "per_item"],
                   help="with --mix: how the model calls its tower: once per microbatch with media, once per "
                        "modality kind, once per media item (default: the mix's model's)")
    p.add_argument("--arrange", choices=["none", "spread", "group_by_modality"], default="none",
                   help="with --mix: how a rank's samples become microbatches (see above)")
    p.add_argument("--tokens", action="store_true",
                   help="with --mix: each line also gives its microbatch's decoder tokens (see above)")
    p.add_argument("--text-tokens", type=int, default=2048, help="with --tokens: text tokens per sample (2048)")
    p.add_argument("--image-tokens", type=int, default=1024,
                   help="with --tokens: tokens per image and per video frame (1024)")
    p.add_argument("--video-frames", type=int, default=2, help="with --tokens: frames a video counts (2)")
    p.add_argument("--audio-tokens", type=int, default=0, help="with --tokens: tokens per audio clip (0)")
    p.add_argument("--list-mixes", action="store_true", help="print the mixes and their default --calls")
    a = p.parse_args()
    token_options = ("text_tokens", "image_tokens", "video_frames", "audio_tokens")
    for name in token_options:
        if getattr(a, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(a, name)}")
    if not a.tokens and any(getattr(a, n) != p.get_default(n) for n in token_options):
        p.error("--text-tokens, --image-tokens, --video-frames and --audio-tokens need --tokens")
    if a.list_mixes:
        for name, mix in sorted(MIXES.items()):
            total = sum(w for w, _ in mix.weights)
            shares = ", ".join(f"{maker.__name__} {w / total:.1%}" for w, maker in mix.weights)
            audio = f"; audio on {mix.audio:.0%} of samples" if mix.audio else ""
            print(f"{name}: {shares}{audio}; calls {mix.calls}")
        return
    if a.mix is None:
        if a.calls or a.arrange != "none" or a.samples_per_microbatch != 1 or a.tokens:
            p.error("--calls, --arrange, --samples-per-microbatch and --tokens need --mix")
        synthetic_trace(a)
        return
    for name in ("world_size", "steps", "microbatches", "samples_per_microbatch"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    mix_trace(a, sys.stdout)


if __name__ == "__main__":
    main()
