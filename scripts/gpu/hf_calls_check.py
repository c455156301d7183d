#!/usr/bin/env python3
"""shardcoord.hf against the real Hugging Face classes: for each family, the real
``<X>ForConditionalGeneration`` of the installed ``transformers`` (5.x) built from a tiny config
(random weights, nothing downloaded), its tower(s) and projector frozen as a fine-tune does, is run
on batches made by hand with the keys and shapes its processor makes (text only, one image, several
images, video, images and videos, audio, ... with as many placeholder tokens as the model's features);
forward pre-hooks count the calls of the tower, the projector and the connector, and the counts must
equal ``shardcoord.hf.tower_calls(model, batch)``. It also compares the real model's parameter names
with the look-alike's of ``tests/python/hf_lookalikes.py`` (same paths, layer lists, parameters outside
them).

One line per family and batch (``ok`` / ``MISMATCH`` / ``skip``), then a summary; exits 1 on any
mismatch, 0 otherwise. A family whose classes the installed transformers lacks is skipped with a
message. ``shardcoord`` is imported as installed (scripts/gpu/python_env.sh pip-installs it); otherwise
``python/shardcoord/hf.py`` is loaded alone, with the contract's names read from
``contract/src/classify.cc``.

    python3 scripts/gpu/hf_calls_check.py [--family qwen2_vl ...] [--device cpu|cuda]
"""

import argparse
import re
import sys
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

V = 128  # vocabulary
IMG, VID, AUD = 100, 101, 102  # image / video / audio placeholder token ids
TXT = 7  # a text token


def load_hf():
    try:
        import shardcoord.hf as hf
        return hf, "shardcoord (binding)"
    except ImportError:
        pass
    src = (ROOT / "contract/src/classify.cc").read_text()
    towers = re.search(r"BuiltinTowerNames\(\)(.*?)return", src, re.S).group(1)
    projectors = re.search(r"BuiltinProjectorNames\(\)(.*?)return", src, re.S).group(1)
    for name in [n for n in sys.modules if n == "shardcoord" or n.startswith("shardcoord.")]:
        del sys.modules[name]
    pkg = types.ModuleType("shardcoord")
    pkg.__path__ = [str(ROOT / "python/shardcoord")]
    pkg.BUILTIN_TOWER_NAMES = tuple(re.findall(r'"([A-Za-z0-9_]+)"', towers))
    pkg.BUILTIN_PROJECTOR_NAMES = tuple(re.findall(r'"([A-Za-z0-9_]+)"', projectors))
    sys.modules["shardcoord"] = pkg
    import shardcoord.hf as hf
    return hf, "python/shardcoord/hf.py with the names of contract/src/classify.cc (binding not built)"


def ids(samples):
    """(batch, seq) input_ids from per-sample token lists, right-padded with text tokens."""
    import torch
    n = max(len(s) for s in samples)
    return torch.tensor([s + [TXT] * (n - len(s)) for s in samples])


def text(n=6):
    return [TXT + (i % 5) for i in range(n)]


def rows(features):
    """Placeholder tokens the features fill (a list of per-image tensors, or one tensor)."""
    if isinstance(features, (list, tuple)):
        return sum(int(f.shape[0]) for f in features)
    return int(features.shape[0] * features.shape[1]) if features.dim() == 3 else int(features.shape[0])


def pooled(out):
    """get_image_features' features: ``pooler_output`` of its output (5.x), or the output itself."""
    return getattr(out, "pooler_output", out)


def llama(model_type="llama"):
    return dict(model_type=model_type, vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512)


def clip():
    return dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, image_size=16, patch_size=4)


def siglip(**kw):
    return dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, image_size=16, patch_size=4, **kw)


def with_text(samples, extra=None):
    import torch
    input_ids = ids(samples)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids.clone()}
    batch.update(extra or {})
    return batch


def rand(*shape):
    import torch
    return torch.rand(*shape)


# ---------------------------------------------------------------------------------------------
# Families: the config, and the batch of each kind (the processor's keys and shapes)


def llava_config(tf):
    return tf.LlavaConfig(vision_config=clip(), text_config=llama(), image_token_index=IMG)


def llava_batch(kind, model):
    n = {"text": 0, "image": 1, "images": 3}[kind]
    if kind == "text":
        return with_text([text(), text()])
    pv = rand(n, 3, 16, 16)
    per_image = (16 // 4) ** 2  # patches; the CLS token is dropped ("default")
    return with_text([text(3) + [IMG] * (per_image * n) + text(3), text()], {"pixel_values": pv})


PINPOINTS = [[16, 16], [16, 32], [32, 16], [32, 32]]


def llava_next_config(tf):
    return tf.LlavaNextConfig(vision_config=clip(), text_config=llama(), image_token_index=IMG,
                              image_grid_pinpoints=PINPOINTS)


def llava_next_batch(kind, model):
    import torch
    n = {"text": 0, "image": 1, "images": 3}[kind]
    if kind == "text":
        return with_text([text(), text()])
    sizes = torch.tensor([[16, 32]] * n, dtype=torch.long)  # 1 x 2 tiles + the base image: 3 patches
    pv = rand(n, 3, 3, 16, 16)
    tokens = 0
    if n:
        with torch.no_grad():
            tokens = rows(pooled(model.model.get_image_features(pv.to(model.device), sizes.to(model.device))))
    return with_text([text(3) + [IMG] * tokens + text(3), text()], {"pixel_values": pv, "image_sizes": sizes})


def llava_onevision_config(tf):
    return tf.LlavaOnevisionConfig(vision_config=siglip(vision_use_head=False), text_config=llama("qwen2"),
                                   image_token_index=IMG, video_token_index=VID, image_grid_pinpoints=PINPOINTS)


def llava_onevision_batch(kind, model):
    import torch
    n = {"text": 0, "image": 1, "images": 3, "video": 0, "image+video": 1}[kind]
    extra, image_tokens, video_tokens = {}, 0, 0
    if n:
        sizes = torch.tensor([[16, 16]] * n, dtype=torch.long)  # the base image and one tile: 2 patches
        extra.update(pixel_values=rand(n, 2, 3, 16, 16), image_sizes=sizes)
        with torch.no_grad():
            image_tokens = rows(pooled(model.model.get_image_features(extra["pixel_values"].to(model.device),
                                                                      sizes.to(model.device))))
    if "video" in kind:
        extra["pixel_values_videos"] = rand(1, 4, 3, 16, 16)  # (videos, frames, C, H, W)
        with torch.no_grad():
            video = pooled(model.model.get_video_features(extra["pixel_values_videos"].to(model.device)))
        video_tokens = rows(video) + video.shape[0]  # + one image_newline per video
    return with_text([text(3) + [IMG] * image_tokens + text(2) + [VID] * video_tokens + text(3), text()], extra)


def qwen_vision(v25):
    if v25:
        return dict(depth=2, hidden_size=16, intermediate_size=32, out_hidden_size=32, num_heads=2, patch_size=2,
                    temporal_patch_size=2, spatial_merge_size=2, window_size=8, fullatt_block_indexes=[1])
    return dict(depth=2, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=2, temporal_patch_size=2,
                spatial_merge_size=2)


def qwen_config(tf, v25):
    text_config = dict(llama(), rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]})
    del text_config["model_type"]
    cls = tf.Qwen2_5_VLConfig if v25 else tf.Qwen2VLConfig
    return cls(vision_config=qwen_vision(v25), text_config=text_config, image_token_id=IMG, video_token_id=VID,
               vision_start_token_id=103, vision_end_token_id=104)


def qwen_batch(kind, model):
    """pixel_values: (sum of t*h*w, 3*2*2*2); one placeholder per 2x2 merged patch; mm_token_type_ids
    1 on image and 2 on video placeholders (each block framed by text, as the processor's
    vision_start / vision_end tokens)."""
    import torch
    n = {"text": 0, "image": 1, "images": 3, "video": 0, "image+video": 1}[kind]
    extra, s0, t0, s1, t1 = {}, text(2), [0, 0], text(2), [0, 0]
    if n:
        grid = torch.tensor([[1, 4, 4]] * n)
        extra.update(pixel_values=rand(int(grid.prod(-1).sum()), 24), image_grid_thw=grid)
        for _ in range(n):
            s0 += [IMG] * 4 + [104, 103]
            t0 += [1] * 4 + [0, 0]
    if "video" in kind:
        grid = torch.tensor([[2, 4, 4]])
        extra.update(pixel_values_videos=rand(int(grid.prod(-1).sum()), 24), video_grid_thw=grid)
        s1 += [VID] * 8 + [104]
        t1 += [2] * 8 + [0]
    batch = with_text([s0, s1], extra)
    width = batch["input_ids"].shape[1]
    batch["mm_token_type_ids"] = torch.tensor([t + [0] * (width - len(t)) for t in (t0, t1)], dtype=torch.int)
    return batch


def gemma3_config(tf, head=False):
    text_config = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, max_position_embeddings=512)
    vision = siglip(vision_use_head=False) if not head else siglip()
    vision.pop("model_type")
    return tf.Gemma3Config(vision_config=vision, text_config=text_config, mm_tokens_per_image=4,
                           image_token_index=IMG, boi_token_index=103, eoi_token_index=104)


def gemma3_batch(kind, model):
    n = {"text": 0, "image": 1, "images": 3}[kind]
    extra = {"pixel_values": rand(n, 3, 16, 16)} if n else {}
    batch = with_text([text(3) + ([103] + [IMG] * 4 + [104]) * n + text(3), text()], extra)
    batch["token_type_ids"] = (batch["input_ids"] == IMG).long()
    return batch


def idefics3_config(tf, cls="Idefics3Config"):
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=16,
                  patch_size=4)
    return getattr(tf, cls)(vision_config=vision, text_config=llama(), image_token_id=IMG, scale_factor=2,
                            pad_token_id=0)


def idefics3_batch(kind, model):
    """pixel_values (batch, max images, 3, H, W), all-zero slots being padding; pixel_attention_mask
    (batch, max images, H, W); image_seq_len placeholders per real image."""
    import torch
    if kind == "text":
        return with_text([text(), text()])
    per = {"image": 1, "images": 2, "padding_only": 1}[kind]
    pv = rand(2, per, 3, 16, 16)
    real = [per, per]
    if kind == "images":
        pv[1, 1:] = 0.0
        real = [2, 1]
    if kind == "padding_only":
        pv.zero_()
        real = [0, 0]
    seq = model.model.image_seq_len
    samples = [text(2) + [IMG] * (seq * r) + text(2) for r in real]
    return with_text(samples, {"pixel_values": pv,
                               "pixel_attention_mask": torch.ones(2, per, 16, 16, dtype=torch.bool)})


def internvl_config(tf):
    vision = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                  image_size=[16, 16], patch_size=[4, 4])
    return tf.InternVLConfig(vision_config=vision, text_config=llama("qwen2"), image_token_id=IMG)


def internvl_batch(kind, model):
    n = {"text": 0, "image": 1, "images": 3}[kind]
    extra = {"pixel_values": rand(n, 3, 16, 16)} if n else {}  # (tiles of all images, 3, H, W)
    return with_text([text(3) + [IMG] * (4 * n) + text(3), text()], extra)  # 16 patches -> 4 tokens


def mllama_config(tf):
    vision = dict(hidden_size=16, num_hidden_layers=2, num_global_layers=2, attention_heads=2, intermediate_size=32,
                  vision_output_dim=32, image_size=16, patch_size=4, max_num_tiles=2, intermediate_layers_indices=[0],
                  supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]])
    text_config = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2, cross_attention_layers=[1], max_position_embeddings=512, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2)
    return tf.MllamaConfig(vision_config=vision, text_config=text_config, image_token_index=V)


def mllama_batch(kind, model):
    """pixel_values (batch, images, tiles, 3, H, W), aspect_ratio_ids (batch, images), aspect_ratio_mask
    (batch, images, tiles), cross_attention_mask (batch, seq, images, tiles)."""
    import torch
    n = {"text": 0, "image": 1, "images": 2, "cross_attention_states": 0}[kind]
    batch = with_text([[V] * max(n, 0) + text(6), [V] * max(n, 0) + text(6)])
    seq = batch["input_ids"].shape[1]
    if n:
        batch.update(pixel_values=rand(2, n, 2, 3, 16, 16),
                     aspect_ratio_ids=torch.full((2, n), 2, dtype=torch.long),
                     aspect_ratio_mask=torch.ones(2, n, 2, dtype=torch.long),
                     cross_attention_mask=torch.ones(2, seq, n, 2, dtype=torch.long))
        batch["labels"][:, :n] = -100
    if kind == "cross_attention_states":  # precomputed vision states (vision_model + projector outputs)
        batch.update(cross_attention_states=rand(2 * 1 * 2, 4 * 4 + 1, 32),
                     cross_attention_mask=torch.ones(2, seq, 1, 2, dtype=torch.long))
    return batch


def qwen2_audio_config(tf):
    audio = dict(model_type="qwen2_audio_encoder", num_mel_bins=8, encoder_layers=2, encoder_attention_heads=2,
                 encoder_ffn_dim=32, d_model=16, max_source_positions=8)
    return tf.Qwen2AudioConfig(audio_config=audio, text_config=llama("qwen2"), audio_token_index=AUD)


def qwen2_audio_batch(kind, model):
    """input_features (audios, mel bins, 2 * max_source_positions), feature_attention_mask (audios, frames);
    16 frames -> 4 placeholders per audio."""
    import torch
    n = {"text": 0, "audio": 1, "audios": 3, "decode_step": 1, "inputs_embeds": 1}[kind]
    extra = {}
    if n:
        extra = {"input_features": rand(n, 8, 16), "feature_attention_mask": torch.ones(n, 16, dtype=torch.long)}
    batch = with_text([text(3) + [AUD] * (4 * n) + text(3), text(3) + text(3) + [TXT] * (4 * n)], extra)
    if kind == "decode_step":  # one new token during generation: the audio is not merged again
        batch.update(input_ids=batch["input_ids"][:, :1], attention_mask=batch["attention_mask"][:, :1])
        del batch["labels"]
    if kind == "inputs_embeds":  # embeddings instead of input_ids: the forward merges no audio
        ids_ = batch.pop("input_ids")
        with torch.no_grad():
            batch["inputs_embeds"] = model.get_input_embeddings()(ids_.to(model.device)).cpu()
    return batch


def empty_rows(name, kind, batch):
    """The "empty_*" kinds: the media key present with zero rows (a collator that concatenated nothing)."""
    import torch
    if name in ("llava", "gemma3", "internvl"):
        batch["pixel_values"] = torch.zeros(0, 3, 16, 16)
    elif name == "llava_next":
        batch.update(pixel_values=torch.zeros(0, 3, 3, 16, 16), image_sizes=torch.zeros(0, 2, dtype=torch.long))
    elif name == "llava_onevision":
        if kind == "empty_images":
            batch.update(pixel_values=torch.zeros(0, 2, 3, 16, 16), image_sizes=torch.zeros(0, 2, dtype=torch.long))
        else:
            batch["pixel_values_videos"] = torch.zeros(0, 4, 3, 16, 16)
    elif name in ("qwen2_vl", "qwen2_5_vl"):
        key, grid = ("pixel_values", "image_grid_thw") if kind == "empty_images" else ("pixel_values_videos",
                                                                                       "video_grid_thw")
        batch.update({key: torch.zeros(0, 24), grid: torch.zeros(0, 3, dtype=torch.long)})
    elif name in ("idefics3", "smolvlm"):
        batch.update(pixel_values=torch.zeros(2, 0, 3, 16, 16),
                     pixel_attention_mask=torch.ones(2, 0, 16, 16, dtype=torch.bool))
    elif name == "mllama":
        batch.update(pixel_values=torch.zeros(2, 0, 2, 3, 16, 16), aspect_ratio_ids=torch.zeros(2, 0, dtype=torch.long),
                     aspect_ratio_mask=torch.zeros(2, 0, 2, dtype=torch.long))
    elif name == "qwen2_audio":
        batch.update(input_features=torch.zeros(0, 8, 16), feature_attention_mask=torch.zeros(0, 16, dtype=torch.long))
    return batch


FAMILIES = {
    "llava": ("LlavaForConditionalGeneration", llava_config, llava_batch,
              ("text", "image", "images", "empty_images")),
    "llava_next": ("LlavaNextForConditionalGeneration", llava_next_config, llava_next_batch,
                   ("text", "image", "images", "empty_images")),
    "llava_onevision": ("LlavaOnevisionForConditionalGeneration", llava_onevision_config, llava_onevision_batch,
                        ("text", "image", "images", "video", "image+video", "empty_images", "empty_videos")),
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", lambda tf: qwen_config(tf, False), qwen_batch,
                 ("text", "image", "images", "video", "image+video", "empty_images", "empty_videos")),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", lambda tf: qwen_config(tf, True), qwen_batch,
                   ("text", "image", "images", "video", "image+video", "empty_images", "empty_videos")),
    "gemma3": ("Gemma3ForConditionalGeneration", gemma3_config, gemma3_batch,
               ("text", "image", "images", "empty_images")),
    "idefics3": ("Idefics3ForConditionalGeneration", idefics3_config, idefics3_batch,
                 ("text", "image", "images", "padding_only", "empty_images")),
    "smolvlm": ("SmolVLMForConditionalGeneration", lambda tf: idefics3_config(tf, "SmolVLMConfig"), idefics3_batch,
                ("text", "image", "images", "padding_only", "empty_images")),
    "internvl": ("InternVLForConditionalGeneration", internvl_config, internvl_batch,
                 ("text", "image", "images", "empty_images")),
    "mllama": ("MllamaForConditionalGeneration", mllama_config, mllama_batch,
               ("text", "image", "images", "cross_attention_states", "empty_images")),
    "qwen2_audio": ("Qwen2AudioForConditionalGeneration", qwen2_audio_config, qwen2_audio_batch,
                    ("text", "audio", "audios", "decode_step", "inputs_embeds", "empty_audios")),
}

# The modules the fine-tune freezes and the hooks count (tower first); "connector" is counted as a
# projector here (extra_projectors), since the contract's names do not include it.
FROZEN = {
    "qwen2_vl": ("model.visual",), "qwen2_5_vl": ("model.visual",),
    "idefics3": ("model.vision_model", "model.connector"), "smolvlm": ("model.vision_model", "model.connector"),
    "mllama": ("model.vision_model", "model.multi_modal_projector"),
    "qwen2_audio": ("model.audio_tower", "model.multi_modal_projector"),
}


def frozen(name):
    return FROZEN.get(name, ("model.vision_tower", "model.multi_modal_projector"))


# ---------------------------------------------------------------------------------------------


def to_device(batch, device):
    return {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}


def count_calls(model, paths, batch):
    """Runs the forward; returns ({path: calls}, the exception the forward raised or None)."""
    import torch
    counts = {p: 0 for p in paths}
    hooks = [model.get_submodule(p).register_forward_pre_hook(
        lambda mod, args, p=p: counts.__setitem__(p, counts[p] + 1)) for p in paths]
    raised = None
    try:
        with torch.no_grad():
            model(**batch)
    except Exception as e:  # noqa: BLE001 -- reported; the counts up to the failure still compare
        raised = e
    finally:
        for h in hooks:
            h.remove()
    return counts, raised


def tree_diff(name, model, lookalikes):
    """Parameter names of the real model vs the look-alike (tied ones included)."""
    if lookalikes is None:
        return None
    fake = lookalikes.FAMILIES[name]()
    real = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    mine = {n for n, _ in fake.named_parameters(remove_duplicate=False)}
    return sorted(real - mine), sorted(mine - real), len(real)


def layer_lists(model, path):
    import torch
    tower = model.get_submodule(path)
    return [n for n, m in tower.named_modules() if isinstance(m, torch.nn.ModuleList)]


def outside(model, path, lists):
    """Parameter names of the module at ``path`` that are in none of its layer lists."""
    names = [n for n, _ in model.get_submodule(path).named_parameters()]
    return [n for n in names if not any(n.startswith(l + ".") for l in lists)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES), help="only these (repeatable)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--no-tree", action="store_true", help="skip the comparison with the look-alikes")
    args = parser.parse_args()

    import torch
    try:
        import transformers as tf
    except ImportError:
        print("skip: transformers is not installed")
        return 0
    hf, how = load_hf()
    lookalikes = None
    if not args.no_tree:
        sys.path.insert(0, str(ROOT / "tests/python"))
        import hf_lookalikes as lookalikes
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"transformers {tf.__version__}, torch {torch.__version__}, device {device}; {how}")

    failures, checked, skipped = [], 0, 0
    for name in args.family or sorted(FAMILIES):
        cls_name, make_config, make_batch, kinds = FAMILIES[name]
        cls = getattr(tf, cls_name, None)
        if cls is None:
            print(f"{name:16s} skip: this transformers has no {cls_name}")
            skipped += 1
            continue
        try:
            torch.manual_seed(0)
            model = cls(make_config(tf)).to(device).eval()
        except Exception as e:  # noqa: BLE001
            print(f"{name:16s} FAIL: could not build {cls_name} from a tiny config: {type(e).__name__}: {e}")
            failures.append((name, "build"))
            continue
        paths = frozen(name)
        for p in paths:
            model.get_submodule(p).requires_grad_(False)
        lists = {p: layer_lists(model, p) for p in paths}
        print(f"{name:16s} {cls_name}: layer lists "
              + "; ".join(f"{p}: {', '.join(v) or '-'}" for p, v in lists.items()))
        for p, v in lists.items():
            rest = outside(model, p, v)
            print(f"{name:16s} {p}: {len(rest)} parameters outside its layer lists: {', '.join(rest) or '-'}")
        lookalike = None
        if lookalikes is not None:
            lookalike = lookalikes.freeze_towers(lookalikes.FAMILIES[name]()).eval()
        diff = tree_diff(name, model, lookalikes)
        if diff is not None:
            missing, extra, total = diff
            if missing or extra:
                failures.append((name, "tree"))
                print(f"{name:16s} tree MISMATCH with tests/python/hf_lookalikes.py ({total} real parameters): "
                      f"missing in the look-alike {missing[:12]}{' ...' if len(missing) > 12 else ''}; "
                      f"extra {extra[:12]}{' ...' if len(extra) > 12 else ''}")
            else:
                print(f"{name:16s} tree ok: the look-alike has the same {total} parameter names")
        for kind in kinds:
            checked += 1
            try:
                torch.manual_seed(1)
                batch = make_batch("text" if kind.startswith("empty_") else kind, model)
                if kind.startswith("empty_"):
                    batch = empty_rows(name, kind, batch)
                batch = to_device(batch, device)
            except Exception as e:  # noqa: BLE001
                print(f"{name:16s} {kind:22s} FAIL: could not make the batch: {type(e).__name__}: {e}")
                traceback.print_exc()
                failures.append((name, kind))
                continue
            keys = ", ".join(f"{k}{tuple(v.shape) if hasattr(v, 'shape') else ''}" for k, v in batch.items())
            try:
                plan = hf.tower_calls(model, batch, extra_projectors=("connector",))
                rejected = None
            except hf.InvalidArgument as e:
                plan, rejected = None, e
            counts, raised = count_calls(model, paths, batch)
            note = f" (the forward raised {type(raised).__name__}: {str(raised)[:160]})" if raised else ""
            if lookalike is not None and kind in lookalikes.KINDS[name]:
                # The look-alike enters the same modules as often on its own batch of this kind, and
                # fails where the real forward fails.
                mine, mine_raised = count_calls(lookalike, paths, lookalikes.make_batch(name, kind))
                if mine != counts or (mine_raised is None) != (raised is None):
                    print(f"{name:16s} {kind:22s} LOOK-ALIKE MISMATCH: the real forward entered {counts}"
                          f"{' and failed' if raised else ''}, the look-alike {mine}"
                          f"{' and failed' if mine_raised else ''}")
                    failures.append((name, kind + " (look-alike)"))
            if rejected is not None:
                # A batch tower_calls rejects must be one the forward cannot run either.
                if raised is not None:
                    print(f"{name:16s} {kind:22s} ok: rejected ({str(rejected)[:100]}...), and the forward fails too "
                          f"after calling {counts}{note}  [{keys}]")
                else:
                    print(f"{name:16s} {kind:22s} MISMATCH: tower_calls rejects the batch ({rejected}) but the forward "
                          f"ran, calling {counts}  [{keys}]")
                    failures.append((name, kind))
            elif counts == plan:
                print(f"{name:16s} {kind:22s} ok {counts}{note}  [{keys}]")
            else:
                print(f"{name:16s} {kind:22s} MISMATCH: the forward called {counts}, tower_calls says {plan}{note}  "
                      f"[{keys}]")
                failures.append((name, kind))

    if "gemma3" in (args.family or FAMILIES) and hasattr(tf, "Gemma3ForConditionalGeneration"):
        # The SigLIP attention-pooling head: built unless the vision config says vision_use_head=False.
        torch.manual_seed(0)
        model = tf.Gemma3ForConditionalGeneration(gemma3_config(tf, head=True)).to(device).eval()
        has = hasattr(model.model.vision_tower, "head")
        calls = 0
        if has:
            counts, raised = count_calls(model, ["model.vision_tower.head"], to_device(gemma3_batch("image", model),
                                                                                       device))
            calls = counts["model.vision_tower.head"]
        print(f"gemma3           info: with a default SiglipVisionConfig (no vision_use_head) the tower "
              f"{'has' if has else 'has no'} vision_tower.head" + (f", called {calls} time(s) per image batch" if has
                                                                   else ""))

    print(f"{checked} batches checked, {len(failures)} failed, {skipped} families skipped"
          + (f": {failures}" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
