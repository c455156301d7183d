"""Tiny torch look-alikes of Hugging Face ``transformers`` 5.x vision/audio-language models.

Each builder returns a small ``torch.nn.Module`` (hidden 16 for towers, 32 for text, 2 layers per
layer list) whose module tree has the attribute paths, the layer-list locations and the placement of
parameters outside the layer lists of the real ``<X>ForConditionalGeneration`` class, and whose
forward takes the batch keys the HF processor makes and calls the tower(s) and projector exactly as
often as the real forward does (the same tests on the same keys). The math inside is simplified
(single-head attention, features merged by a mean), which no count depends on. No ``transformers``
import; runs on torch 1.13 (CPU) and 2.x. ``scripts/gpu/hf_calls_check.py`` compares these trees and
call counts with the real classes: on transformers 5.17.0 / torch 2.11 every family's parameter names
(tied ones included) were identical to the real tiny model's, and the modules each batch kind enters
were the same, also where the forward fails.

Batches the real forward cannot run fail here too, at the same place (after or before entering the
tower, as there): a media key holding no elements (``empty_*`` kinds; every family fails, most after
entering the tower) and Idefics3 pixel_values that are all padding (the tower runs on zero images and
fails; SmolVLM keeps one empty image and runs). :data:`FAILING` lists them.

Read from ``transformers`` 5.17.0 as installed (``src/transformers/models/<family>/modeling_<family>.py``
and the towers' own files); "outside" lists the parameters of a controlled module that are in none
of its layer-list entries (what a per-layer sharding must still place somewhere):

LLaVA -- ``LlavaForConditionalGeneration`` (llava/modeling_llava.py, clip/modeling_clip.py)
    model (LlavaModel): vision_tower (CLIPVisionModel, via AutoModel), multi_modal_projector
    (LlavaMultiModalProjector: linear_1, act, linear_2), language_model (LlamaModel: embed_tokens,
    layers.N, norm, rotary_emb); lm_head.
    Tower layout in 5.17 (flat, since transformers PR #44431 "Refactor CLIP-like models", merged
    2026-03): vision_tower.embeddings.{class_embedding, patch_embedding, position_embedding},
    vision_tower.pre_layrnorm, vision_tower.encoder.layers.N, vision_tower.post_layernorm. The 5.x
    releases before that PR (which release first ships it is not pinned down here) and 4.x nest all
    of it under vision_tower.vision_model (CLIPVisionTransformer):
    layer list vision_tower.vision_model.encoder.layers (``flat_vision=False`` builds that layout).
    Outside the layer list: embeddings.class_embedding, embeddings.patch_embedding.weight,
    embeddings.position_embedding.weight, pre_layrnorm.*, post_layernorm.* (post_layernorm runs on the
    CLS token; LLaVA reads hidden_states[-2] but the tower's forward computes it all the same).
    Projector: no layer list. Call rule (LlavaModel.forward): ``if pixel_values is not None``:
    get_image_features -> vision_tower once (every image of the microbatch stacked in one call) and
    multi_modal_projector once. A zero-row pixel_values enters the tower (the test is only None) and
    fails inside it.

LLaVA-NeXT -- ``LlavaNextForConditionalGeneration`` (llava_next/modeling_llava_next.py)
    As LLaVA (CLIP tower, Llama text), plus ``model.image_newline`` (an nn.Parameter directly on the
    LlavaNextModel, outside every tower/projector). pixel_values (num_images, num_patches, 3, H, W)
    with image_sizes; the patches of all images go through the tower in one call. Call rule:
    ``if pixel_values is not None and pixel_values.size(0) > 0``: vision_tower 1, projector 1 (with
    size(0) == 0 no call, but the forward then fails at its end on an unset image_features).

LLaVA-OneVision -- ``LlavaOnevisionForConditionalGeneration`` (llava_onevision/modeling_llava_onevision.py,
    siglip/modeling_siglip.py)
    model.vision_tower is SiglipVisionModel (5.17 flat: embeddings.{patch_embedding,
    position_embedding}, encoder.layers.N, post_layernorm, and ``head`` (attention pooling: probe,
    attention, layernorm, mlp) only when the config lacks vision_use_head=False; LlavaOnevisionConfig
    passes vision_use_head=False by default, so no head), multi_modal_projector (linear_1, act,
    linear_2), image_newline (Parameter on the model), language_model (Qwen2Model). Outside the layer
    list: embeddings.patch_embedding.*, embeddings.position_embedding.weight, post_layernorm.*.
    Call rule: ``if pixel_values is not None`` -> get_image_features: tower 1, projector 1; ``if
    pixel_values_videos is not None`` -> get_video_features: tower 1, projector 1 (images and videos
    of one microbatch: 2 calls each).

Qwen2-VL -- ``Qwen2VLForConditionalGeneration`` (qwen2_vl/modeling_qwen2_vl.py)
    model (Qwen2VLModel): visual (Qwen2VisionTransformerPretrainedModel: patch_embed.proj (Conv3d, no
    bias), rotary_pos_emb (buffers only), blocks.N (norm1, norm2 LayerNorm, attn.qkv, attn.proj,
    mlp.fc1, mlp.fc2), merger (PatchMerger: ln_q LayerNorm, mlp.0, mlp.2)), language_model
    (Qwen2VLTextModel: embed_tokens, layers.N, norm, rotary_emb); lm_head. No separate projector:
    the merger is inside ``visual``. Outside the layer list ``blocks``: patch_embed.proj.weight,
    merger.ln_q.*, merger.mlp.0.*, merger.mlp.2.*. Call rule: ``if pixel_values is not None``:
    visual(pixel_values, grid_thw=image_grid_thw) once; ``if pixel_values_videos is not None``:
    visual(pixel_values_videos, grid_thw=video_grid_thw) once more -- two calls of ``visual`` in a
    microbatch with images and videos. pixel_values is (sum of t*h*w over images,
    3 * temporal_patch_size * patch_size**2).

Qwen2.5-VL -- ``Qwen2_5_VLForConditionalGeneration`` (qwen2_5_vl/modeling_qwen2_5_vl.py)
    As Qwen2-VL with Qwen2_5_VisionTransformerPretrainedModel: blocks.N have RMSNorm norm1/norm2
    (weight only) and a gated mlp (gate_proj, up_proj, down_proj, with bias); merger.ln_q is an
    RMSNorm. Same outside-the-list parameters and the same call rule (images, videos: one call each).

Gemma 3 -- ``Gemma3ForConditionalGeneration`` (gemma3/modeling_gemma3.py)
    model (Gemma3Model): vision_tower (SiglipVisionModel, flat as above), multi_modal_projector
    (Gemma3MultiModalProjector: mm_input_projection_weight -- an nn.Parameter directly on the
    projector --, mm_soft_emb_norm (Gemma3RMSNorm), avg_pool), language_model (Gemma3TextModel:
    embed_tokens, layers.N with q_norm/k_norm and four norms, norm, rotary_emb); lm_head, tied to
    embed_tokens (tie_word_embeddings defaults True). The attention pooling head
    (vision_tower.head.probe / head.attention / ...) is built by SiglipVisionModel unless the vision
    config says vision_use_head=False; Google's Gemma 3 configs do say so, so a real checkpoint has no
    head (the look-alike has none). A Gemma3Config() with a default SiglipVisionConfig() does build
    the head, and SiglipVisionModel.forward then runs it on every call although Gemma3 reads only
    last_hidden_state. Outside the layer list: embeddings.patch_embedding.*,
    embeddings.position_embedding.weight, post_layernorm.* (and head.* when present). Call rule:
    ``if pixel_values is not None``: vision_tower 1, multi_modal_projector 1.

Idefics3 / SmolVLM -- ``Idefics3ForConditionalGeneration``, ``SmolVLMForConditionalGeneration``
    (idefics3/modeling_idefics3.py, smolvlm/modeling_smolvlm.py)
    model: vision_model (Idefics3VisionTransformer / SmolVLMVisionTransformer: embeddings.{patch_embedding,
    position_embedding}, encoder.layers.N, post_layernorm), connector (pixel shuffle +
    modality_projection.proj), text_model (LlamaModel); lm_head. ``connector`` was not one of the
    contract's projector names (contract/src/classify.cc) when this was written, so a frozen connector
    was a controlled module only with extra_projectors=("connector",); the contract is adding it. Outside the layer list:
    embeddings.patch_embedding.*, embeddings.position_embedding.weight, post_layernorm.*. pixel_values
    is (batch, max_images, 3, H, W), all-zero images being padding, with pixel_attention_mask
    (batch, max_images, H, W). Call rule: ``if pixel_values is not None`` (with image_hidden_states
    also given: ValueError): get_image_features -> vision_model 1, connector 1, after dropping the
    padding images -- also when all are padding: Idefics3 then calls the tower on zero images,
    SmolVLM keeps one empty image ("If no images, leave one empty image").

InternVL -- ``InternVLForConditionalGeneration`` (internvl/modeling_internvl.py)
    model (InternVLModel): vision_tower (InternVLVisionModel: embeddings.{cls_token,
    position_embeddings (a Parameter), patch_embeddings.projection}, encoder.layer.N (attention.{q_proj,
    k_proj, v_proj, projection_layer}, mlp.{fc1, fc2}, layernorm_before, layernorm_after, lambda_1,
    lambda_2), layernorm: nn.Identity with use_mean_pooling=True (the default), a LayerNorm
    otherwise), multi_modal_projector (layer_norm, linear_1, act, linear_2), language_model
    (Qwen2Model); lm_head, tied by default. Outside the layer list: embeddings.cls_token,
    embeddings.position_embeddings, embeddings.patch_embeddings.projection.* (and layernorm.* when
    use_mean_pooling=False; embeddings.mask_token when use_mask_token). Call rule: ``if pixel_values
    is not None``: vision_tower 1 (all tiles of all images in one call), multi_modal_projector 1.

Mllama -- ``MllamaForConditionalGeneration`` (mllama/modeling_mllama.py)
    model (MllamaModel): vision_model (MllamaVisionModel: patch_embedding, class_embedding,
    gated_positional_embedding.{gate, embedding, tile_embedding}, pre_tile_positional_embedding.{embedding,
    gate}, post_tile_positional_embedding.{embedding, gate}, layernorm_pre, layernorm_post,
    transformer.layers.N, global_transformer.layers.N (gated: gate_attn, gate_ffn)), language_model
    (MllamaTextModel: embed_tokens, layers.N -- MllamaSelfAttentionDecoderLayer, or
    MllamaCrossAttentionDecoderLayer (cross_attn.*, cross_attn_attn_gate, cross_attn_mlp_gate) at the
    indexes of cross_attention_layers --, norm, rotary_emb), multi_modal_projector (an nn.Linear);
    lm_head. Two layer lists in one tower (transformer.layers, global_transformer.layers); outside
    both: patch_embedding.weight, class_embedding, the three positional embeddings, layernorm_pre.*,
    layernorm_post.*. Call rule: ``if pixel_values is not None`` (needs aspect_ratio_ids; with
    cross_attention_states also given: ValueError): vision_model 1, multi_modal_projector 1 (one call
    for all images and tiles). The text model skips every cross-attention layer when
    cross_attention_states is None and no cross-attention cache is filled: a text-only microbatch
    does not run those layers at all (see the report for what that means for FSDP on them).
    Typical fine-tune: vision_model frozen; multi_modal_projector and the cross-attention layers are
    often trained with the language model (or LoRA on the language model), so the projector is a
    controlled module only when frozen too.

Qwen2-Audio -- ``Qwen2AudioForConditionalGeneration`` (qwen2_audio/modeling_qwen2_audio.py)
    model (Qwen2AudioModel): audio_tower (Qwen2AudioEncoder, Whisper-style: conv1, conv2,
    embed_positions (nn.Embedding, requires_grad False always), layers.N (self_attn.{k_proj (no bias),
    v_proj, q_proj, out_proj}, self_attn_layer_norm, fc1, fc2, final_layer_norm), layer_norm,
    avg_pooler (AvgPool1d, no parameters)), multi_modal_projector (linear), language_model
    (Qwen2Model); lm_head. Outside the layer list: conv1.*, conv2.*, embed_positions.weight,
    layer_norm.*. input_features (num_audios, num_mel_bins, 2 * max_source_positions) and
    feature_attention_mask (num_audios, 2 * max_source_positions). Call rule: ``if input_features is
    not None and input_ids.shape[1] != 1`` inside ``if inputs_embeds is None``: audio_tower 1,
    multi_modal_projector 1 (all audios of the microbatch in one call). The encoder's layerdrop
    (encoder_layerdrop, default 0.0) skips layers at random in training mode.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 64
TEXT = 32  # Text hidden size.
VISION = 16  # Tower hidden size.
LAYERS = 2
IMAGE = 16  # Image side (pixels).
PATCH = 4  # Patch side: (IMAGE / PATCH)**2 = 16 patches.
IMAGE_TOKEN = VOCAB - 1


class Output(SimpleNamespace):
    """What the forward returns: ``loss`` (with labels) and ``logits``."""


# ---------------------------------------------------------------------------------------------
# Building blocks, named as in transformers


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = scores.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _no_elements(x: torch.Tensor, where: str) -> None:
    """transformers 5.17 fails on media tensors with no elements (a reshape of an empty tensor in the tower,
    a torch.cat of no features); the look-alikes fail at the same place."""
    if x.numel() == 0:
        raise RuntimeError(f"{where}: no elements to run on (transformers fails here too)")


def _merge(embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """Adds the features' mean to every position (the real models scatter them onto placeholder tokens)."""
    flat = features.reshape(-1, features.shape[-1])
    if flat.shape[0] == 0:
        return embeds
    return embeds + flat.mean(0).to(embeds.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Rotary(nn.Module):
    """Rotary embedding holder: non-persistent buffers only (no parameters), as in transformers."""

    def __init__(self, dim: int):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)


class Attention(nn.Module):
    """Separate q/k/v/out projections under the given attribute names (in registration order)."""

    def __init__(self, dim: int, names: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
                 bias: Sequence[bool] = (True, True, True, True), qk_norm: Optional[Callable[[], nn.Module]] = None,
                 kv_dim: Optional[int] = None, causal: bool = False):
        super().__init__()
        self._names = dict(zip(("q", "k", "v", "o"), names))
        kv_dim = kv_dim or dim
        for (role, name), b in zip(self._names.items(), bias):
            setattr(self, name, nn.Linear(kv_dim if role in "kv" else dim, dim, bias=b))
        self.causal = causal
        if qk_norm is not None:
            self.q_norm, self.k_norm = qk_norm(), qk_norm()

    def forward(self, x, context=None):
        context = x if context is None else context
        q = getattr(self, self._names["q"])(x)
        k = getattr(self, self._names["k"])(context)
        v = getattr(self, self._names["v"])(context)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return getattr(self, self._names["o"])(_attend(q, k, v, causal=self.causal))


class FusedAttention(nn.Module):
    """Qwen-VL vision attention: one ``qkv`` projection and ``proj``."""

    def __init__(self, dim: int):
        super().__init__()
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(_attend(q, k, v))


class MLP(nn.Module):
    """fc1 -> activation -> fc2; the activation module under ``act_name`` (``activation_fn``, ``act``)."""

    def __init__(self, dim: int, hidden: int, act_name: str = "activation_fn", bias: bool = True):
        super().__init__()
        if act_name == "activation_fn":
            self.activation_fn = nn.GELU()
            self.fc1 = nn.Linear(dim, hidden, bias=bias)
            self.fc2 = nn.Linear(hidden, dim, bias=bias)
        else:  # Qwen2-VL's VisionMlp registers fc1, act, fc2.
            self.fc1 = nn.Linear(dim, hidden, bias=bias)
            setattr(self, act_name, nn.GELU())
            self.fc2 = nn.Linear(hidden, dim, bias=bias)
        self._act = act_name

    def forward(self, x):
        return self.fc2(getattr(self, self._act)(self.fc1(x)))


class GatedMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ViTLayer(nn.Module):
    """CLIP / SigLIP / Idefics3 encoder layer: self_attn (k, v, q, out_proj), layer_norm1, mlp, layer_norm2."""

    def __init__(self, dim: int):
        super().__init__()
        self.self_attn = Attention(dim, names=("q_proj", "k_proj", "v_proj", "out_proj"))
        self.layer_norm1 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, 2 * dim)
        self.layer_norm2 = nn.LayerNorm(dim)

    def forward(self, x):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class ViTEncoder(nn.Module):
    def __init__(self, dim: int, layers: int = LAYERS, layer=ViTLayer):
        super().__init__()
        self.layers = nn.ModuleList([layer(dim) for _ in range(layers)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class DecoderLayer(nn.Module):
    """Llama / Qwen2 / Gemma3 decoder layer."""

    def __init__(self, dim: int, qkv_bias: bool = False, gemma: bool = False):
        super().__init__()
        self.self_attn = Attention(dim, bias=(qkv_bias, qkv_bias, qkv_bias, False), causal=True,
                                   qk_norm=(lambda: RMSNorm(dim)) if gemma else None)
        self.mlp = GatedMLP(dim, 2 * dim)
        self.input_layernorm = RMSNorm(dim)
        self.post_attention_layernorm = RMSNorm(dim)
        self.gemma = gemma
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(dim)
            self.post_feedforward_layernorm = RMSNorm(dim)

    def forward(self, x, **_):
        if self.gemma:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x)))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    """LlamaModel / Qwen2Model / Qwen2VLTextModel / Gemma3TextModel: embed_tokens, layers, norm, rotary_emb."""

    def __init__(self, dim: int = TEXT, vocab: int = VOCAB, layers: int = LAYERS, qkv_bias: bool = False,
                 gemma: bool = False, layer_factory: Optional[Callable[[int], nn.Module]] = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        make = layer_factory or (lambda i: DecoderLayer(dim, qkv_bias=qkv_bias, gemma=gemma))
        self.layers = nn.ModuleList([make(i) for i in range(layers)])
        self.norm = RMSNorm(dim)
        self.rotary_emb = Rotary(dim)

    def forward(self, inputs_embeds, **kwargs):
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, **kwargs)
        return self.norm(x)


class ForConditionalGeneration(nn.Module):
    """``model`` + ``lm_head``; the forward takes the processor's batch keys (and ``labels``)."""

    def __init__(self, model: nn.Module, model_type: str, text: str = "language_model", tie: bool = False):
        super().__init__()
        self.config = SimpleNamespace(model_type=model_type)
        self.model = model
        self.lm_head = nn.Linear(TEXT, VOCAB, bias=False)
        if tie:
            self.lm_head.weight = getattr(model, text).embed_tokens.weight

    def forward(self, labels=None, **batch):
        hidden = self.model(**batch)
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return Output(loss=loss, logits=logits)


def _embed(model: nn.Module, text: nn.Module, input_ids, inputs_embeds):
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    return text.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds


# ---------------------------------------------------------------------------------------------
# CLIP and SigLIP vision towers


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, dim: int = VISION):
        super().__init__()
        self.class_embedding = nn.Parameter(torch.randn(dim))
        self.patch_embedding = nn.Conv2d(3, dim, kernel_size=PATCH, stride=PATCH, bias=False)
        num_positions = (IMAGE // PATCH) ** 2 + 1
        self.position_embedding = nn.Embedding(num_positions, dim)
        self.register_buffer("position_ids", torch.arange(num_positions).expand((1, -1)), persistent=False)

    def forward(self, pixel_values):
        x = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(x.shape[0], 1, -1)
        return torch.cat([cls, x], dim=1) + self.position_embedding(self.position_ids)


class CLIPVisionTransformer(nn.Module):
    def __init__(self, dim: int = VISION):
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(dim)
        self.pre_layrnorm = nn.LayerNorm(dim)
        self.encoder = ViTEncoder(dim)
        self.post_layernorm = nn.LayerNorm(dim)

    def forward(self, pixel_values):
        _no_elements(pixel_values, "CLIP vision tower")
        hidden = self.encoder(self.pre_layrnorm(self.embeddings(pixel_values)))
        self.post_layernorm(hidden[:, 0, :])  # The pooled output, computed and not used by LLaVA.
        return hidden


class CLIPVisionModel(nn.Module):
    """5.17: the CLIPVisionTransformer's modules directly on the model; ``flat=False``: under
    ``vision_model`` (transformers before PR #44431)."""

    def __init__(self, dim: int = VISION, flat: bool = True):
        super().__init__()
        if flat:
            self.embeddings = CLIPVisionEmbeddings(dim)
            self.pre_layrnorm = nn.LayerNorm(dim)
            self.encoder = ViTEncoder(dim)
            self.post_layernorm = nn.LayerNorm(dim)
        else:
            self.vision_model = CLIPVisionTransformer(dim)

    def forward(self, pixel_values):
        if hasattr(self, "vision_model"):
            return self.vision_model(pixel_values)
        return CLIPVisionTransformer.forward(self, pixel_values)


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, dim: int = VISION):
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, dim, kernel_size=PATCH, stride=PATCH)
        num_positions = (IMAGE // PATCH) ** 2
        self.position_embedding = nn.Embedding(num_positions, dim)
        self.register_buffer("position_ids", torch.arange(num_positions).expand((1, -1)), persistent=False)

    def forward(self, pixel_values, patch_attention_mask=None):
        x = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        return x + self.position_embedding(self.position_ids)


class SiglipMultiheadAttentionPoolingHead(nn.Module):
    def __init__(self, dim: int = VISION):
        super().__init__()
        self.probe = nn.Parameter(torch.randn(1, 1, dim))
        self.attention = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.layernorm = nn.LayerNorm(dim)
        self.mlp = MLP(dim, 2 * dim)

    def forward(self, x):
        h = self.attention(self.probe.repeat(x.shape[0], 1, 1), x, x)[0]
        return (h + self.mlp(self.layernorm(h)))[:, 0]


class SiglipVisionTransformer(nn.Module):
    def __init__(self, dim: int = VISION, use_head: bool = False):
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(dim)
        self.encoder = ViTEncoder(dim)
        self.post_layernorm = nn.LayerNorm(dim)
        self.use_head = use_head
        if use_head:
            self.head = SiglipMultiheadAttentionPoolingHead(dim)

    def forward(self, pixel_values):
        _no_elements(pixel_values, "SigLIP vision tower")
        hidden = self.post_layernorm(self.encoder(self.embeddings(pixel_values)))
        if self.use_head:
            self.head(hidden)  # Runs whenever present, whether or not the caller reads pooler_output.
        return hidden


class SiglipVisionModel(nn.Module):
    """5.17 flat layout; ``flat=False``: under ``vision_model`` (before PR #44431)."""

    def __init__(self, dim: int = VISION, use_head: bool = False, flat: bool = True):
        super().__init__()
        if flat:
            self.embeddings = SiglipVisionEmbeddings(dim)
            self.encoder = ViTEncoder(dim)
            self.post_layernorm = nn.LayerNorm(dim)
            self.use_head = use_head
            if use_head:
                self.head = SiglipMultiheadAttentionPoolingHead(dim)
        else:
            self.vision_model = SiglipVisionTransformer(dim, use_head)

    def forward(self, pixel_values):
        if hasattr(self, "vision_model"):
            return self.vision_model(pixel_values)
        return SiglipVisionTransformer.forward(self, pixel_values)


class LinearProjector(nn.Module):
    """Llava / LlavaNext / LlavaOnevision multi_modal_projector: linear_1, act, linear_2."""

    def __init__(self, in_dim: int = VISION, out_dim: int = TEXT, layer_norm: bool = False):
        super().__init__()
        if layer_norm:  # InternVL's: layer_norm first.
            self.layer_norm = nn.LayerNorm(in_dim)
        self.linear_1 = nn.Linear(in_dim, out_dim)
        self.act = nn.GELU()
        self.linear_2 = nn.Linear(out_dim, out_dim)

    def forward(self, x):
        if hasattr(self, "layer_norm"):
            x = self.layer_norm(x)
        return self.linear_2(self.act(self.linear_1(x)))


# ---------------------------------------------------------------------------------------------
# LLaVA, LLaVA-NeXT, LLaVA-OneVision


class LlavaModel(nn.Module):
    def __init__(self, flat_vision: bool = True):
        super().__init__()
        self.vision_tower = CLIPVisionModel(flat=flat_vision)
        self.multi_modal_projector = LinearProjector()
        self.language_model = TextModel()

    def get_image_features(self, pixel_values):
        hidden = self.vision_tower(pixel_values)[:, 1:]  # vision_feature_select_strategy "default": no CLS
        return self.multi_modal_projector(hidden)

    def forward(self, input_ids=None, pixel_values=None, attention_mask=None, inputs_embeds=None, image_sizes=None,
                **kwargs):
        inputs_embeds = _embed(self, self.language_model, input_ids, inputs_embeds)
        if pixel_values is not None:
            inputs_embeds = _merge(inputs_embeds, self.get_image_features(pixel_values))
        return self.language_model(inputs_embeds)


class LlavaForConditionalGeneration(ForConditionalGeneration):
    def __init__(self, flat_vision: bool = True):
        super().__init__(LlavaModel(flat_vision), "llava")


class LlavaNextModel(LlavaModel):
    def __init__(self, flat_vision: bool = True):
        super().__init__(flat_vision)
        self.image_newline = nn.Parameter(torch.randn(TEXT))

    def forward(self, input_ids=None, pixel_values=None, image_sizes=None, attention_mask=None, inputs_embeds=None,
                **kwargs):
        inputs_embeds = _embed(self, self.language_model, input_ids, inputs_embeds)
        if pixel_values is not None and pixel_values.size(0) > 0:
            if pixel_values.dim() == 5:  # (images, patches, C, H, W): every patch of every image, one call
                pixel_values = pixel_values.flatten(0, 1)
            features = self.get_image_features(pixel_values)
            inputs_embeds = _merge(inputs_embeds, features) + self.image_newline
        hidden = self.language_model(inputs_embeds)
        if pixel_values is not None and pixel_values.size(0) == 0:
            # transformers 5.17 skips the tower, then fails on its unset image_features at the end.
            raise RuntimeError("LLaVA-NeXT: pixel_values with no rows (transformers fails here too)")
        return hidden


class LlavaNextForConditionalGeneration(ForConditionalGeneration):
    def __init__(self, flat_vision: bool = True):
        super().__init__(LlavaNextModel(flat_vision), "llava_next")


class LlavaOnevisionModel(nn.Module):
    def __init__(self, flat_vision: bool = True, use_head: bool = False):
        super().__init__()
        self.vision_tower = SiglipVisionModel(use_head=use_head, flat=flat_vision)
        self.multi_modal_projector = LinearProjector()
        self.image_newline = nn.Parameter(torch.randn(TEXT))
        self.language_model = TextModel(qkv_bias=True)

    def forward(self, input_ids=None, pixel_values=None, image_sizes=None, pixel_values_videos=None,
                image_sizes_videos=None, attention_mask=None, inputs_embeds=None, batch_num_images=None, **kwargs):
        inputs_embeds = _embed(self, self.language_model, input_ids, inputs_embeds)
        if pixel_values is not None:
            if pixel_values.shape[0] == 0:  # transformers: torch.cat of no patches, before the tower
                raise RuntimeError("LLaVA-OneVision: pixel_values with no rows (transformers fails here too)")
            if pixel_values.dim() == 5:
                pixel_values = pixel_values.flatten(0, 1)
            features = self.multi_modal_projector(self.vision_tower(pixel_values))
            inputs_embeds = _merge(inputs_embeds, features) + self.image_newline
        if pixel_values_videos is not None:
            b, f, c, h, w = pixel_values_videos.shape
            features = self.multi_modal_projector(self.vision_tower(pixel_values_videos.view(b * f, c, h, w)))
            inputs_embeds = _merge(inputs_embeds, features) + self.image_newline
        return self.language_model(inputs_embeds)


class LlavaOnevisionForConditionalGeneration(ForConditionalGeneration):
    def __init__(self, flat_vision: bool = True, use_head: bool = False):
        super().__init__(LlavaOnevisionModel(flat_vision, use_head), "llava_onevision")


# ---------------------------------------------------------------------------------------------
# Qwen2-VL, Qwen2.5-VL

QWEN_PATCH = 2  # patch_size
QWEN_TEMPORAL = 2  # temporal_patch_size
QWEN_MERGE = 2  # spatial_merge_size
QWEN_PATCH_DIM = 3 * QWEN_TEMPORAL * QWEN_PATCH * QWEN_PATCH


class PatchEmbed(nn.Module):
    def __init__(self, dim: int = VISION):
        super().__init__()
        k = (QWEN_TEMPORAL, QWEN_PATCH, QWEN_PATCH)
        self.proj = nn.Conv3d(3, dim, kernel_size=k, stride=k, bias=False)
        self.dim = dim

    def forward(self, x):
        return self.proj(x.view(-1, 3, QWEN_TEMPORAL, QWEN_PATCH, QWEN_PATCH)).view(-1, self.dim)


class PatchMerger(nn.Module):
    def __init__(self, dim: int = TEXT, context_dim: int = VISION, rms: bool = False):
        super().__init__()
        self.hidden_size = context_dim * QWEN_MERGE ** 2
        self.ln_q = RMSNorm(context_dim) if rms else nn.LayerNorm(context_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden_size, self.hidden_size), nn.GELU(),
                                 nn.Linear(self.hidden_size, dim))

    def forward(self, x):
        return self.mlp(self.ln_q(x).view(-1, self.hidden_size))


class Qwen2VLVisionBlock(nn.Module):
    def __init__(self, dim: int = VISION):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = FusedAttention(dim)
        self.mlp = MLP(dim, 2 * dim, act_name="act")

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Qwen2_5_VLVisionBlock(nn.Module):
    def __init__(self, dim: int = VISION):
        super().__init__()
        self.norm1 = RMSNorm(dim)
        self.norm2 = RMSNorm(dim)
        self.attn = FusedAttention(dim)
        self.mlp = GatedMLP(dim, 2 * dim, bias=True)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Qwen2VisionTransformerPretrainedModel(nn.Module):
    block = Qwen2VLVisionBlock
    rms_merger = False

    def __init__(self, dim: int = VISION):
        super().__init__()
        self.patch_embed = PatchEmbed(dim)
        self.rotary_pos_emb = Rotary(dim // 2)
        self.blocks = nn.ModuleList([self.block(dim) for _ in range(LAYERS)])
        self.merger = PatchMerger(TEXT, dim, rms=self.rms_merger)

    def forward(self, hidden_states, grid_thw=None):
        _no_elements(hidden_states, "Qwen-VL visual")  # transformers: runs, then torch.cat of no features fails
        x = self.patch_embed(hidden_states)
        for blk in self.blocks:
            x = blk(x)
        return self.merger(x)


class Qwen2_5_VisionTransformerPretrainedModel(Qwen2VisionTransformerPretrainedModel):
    block = Qwen2_5_VLVisionBlock
    rms_merger = True


class Qwen2VLModel(nn.Module):
    vision = Qwen2VisionTransformerPretrainedModel

    def __init__(self):
        super().__init__()
        self.visual = self.vision()
        self.language_model = TextModel(qkv_bias=True)

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, pixel_values=None,
                pixel_values_videos=None, image_grid_thw=None, video_grid_thw=None, **kwargs):
        inputs_embeds = _embed(self, self.language_model, input_ids, inputs_embeds)
        if pixel_values is not None:
            inputs_embeds = _merge(inputs_embeds, self.visual(pixel_values, grid_thw=image_grid_thw))
        if pixel_values_videos is not None:
            inputs_embeds = _merge(inputs_embeds, self.visual(pixel_values_videos, grid_thw=video_grid_thw))
        return self.language_model(inputs_embeds)


class Qwen2_5_VLModel(Qwen2VLModel):
    vision = Qwen2_5_VisionTransformerPretrainedModel


class Qwen2VLForConditionalGeneration(ForConditionalGeneration):
    def __init__(self):
        super().__init__(Qwen2VLModel(), "qwen2_vl")


class Qwen2_5_VLForConditionalGeneration(ForConditionalGeneration):
    def __init__(self):
        super().__init__(Qwen2_5_VLModel(), "qwen2_5_vl")


# ---------------------------------------------------------------------------------------------
# Gemma 3

GEMMA_TOKENS = 4  # mm_tokens_per_image: 16 patches pooled 2x2


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self):
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.randn(VISION, TEXT) * 0.1)
        self.mm_soft_emb_norm = RMSNorm(VISION)
        self.patches_per_image = IMAGE // PATCH
        kernel = self.patches_per_image // int(GEMMA_TOKENS ** 0.5)
        self.avg_pool = nn.AvgPool2d(kernel_size=kernel, stride=kernel)

    def forward(self, vision_outputs):
        b, _, d = vision_outputs.shape
        x = vision_outputs.transpose(1, 2).reshape(b, d, self.patches_per_image, self.patches_per_image)
        x = self.avg_pool(x).flatten(2).transpose(1, 2)
        return self.mm_soft_emb_norm(x) @ self.mm_input_projection_weight


class Gemma3Model(nn.Module):
    def __init__(self, flat_vision: bool = True, use_head: bool = False):
        super().__init__()
        self.vision_tower = SiglipVisionModel(use_head=use_head, flat=flat_vision)
        self.multi_modal_projector = Gemma3MultiModalProjector()
        self.language_model = TextModel(gemma=True)

    def forward(self, input_ids=None, pixel_values=None, attention_mask=None, inputs_embeds=None,
                token_type_ids=None, **kwargs):
        inputs_embeds = _embed(self, self.language_model, input_ids, inputs_embeds)
        if pixel_values is not None:
            features = self.multi_modal_projector(self.vision_tower(pixel_values))
            inputs_embeds = _merge(inputs_embeds, features)
        return self.language_model(inputs_embeds)


class Gemma3ForConditionalGeneration(ForConditionalGeneration):
    def __init__(self, flat_vision: bool = True, use_head: bool = False):
        super().__init__(Gemma3Model(flat_vision, use_head), "gemma3", tie=True)


# ---------------------------------------------------------------------------------------------
# Idefics3, SmolVLM

SCALE_FACTOR = 2  # connector pixel shuffle


class Idefics3VisionTransformer(nn.Module):
    def __init__(self, dim: int = VISION):
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(dim)
        self.encoder = ViTEncoder(dim)
        self.post_layernorm = nn.LayerNorm(dim)

    def forward(self, pixel_values, patch_attention_mask=None):
        _no_elements(pixel_values, "Idefics3 vision model")
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values)))


class Idefics3SimpleMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(VISION * SCALE_FACTOR ** 2, TEXT, bias=False)

    def forward(self, x):
        return self.proj(x)


class Idefics3Connector(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale_factor = SCALE_FACTOR
        self.modality_projection = Idefics3SimpleMLP()

    def forward(self, x):
        b, seq, d = x.shape
        return self.modality_projection(x.reshape(b, seq // self.scale_factor ** 2, d * self.scale_factor ** 2))


class Idefics3Model(nn.Module):
    keep_one_image = False  # SmolVLM: "If no images, leave one empty image."

    def __init__(self):
        super().__init__()
        self.vision_model = Idefics3VisionTransformer()
        self.connector = Idefics3Connector()
        self.text_model = TextModel()

    def get_image_features(self, pixel_values, pixel_attention_mask=None):
        b, n = pixel_values.shape[:2]
        pixel_values = pixel_values.view(b * n, *pixel_values.shape[2:])
        per_image = pixel_values.shape[1:].numel()
        real = (pixel_values == 0.0).sum(dim=(-1, -2, -3)) != per_image  # all-zero images are padding
        if self.keep_one_image:
            real[0] |= ~torch.any(real)
        pixel_values = pixel_values[real].contiguous()
        return self.connector(self.vision_model(pixel_values))

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, pixel_values=None,
                pixel_attention_mask=None, image_hidden_states=None, **kwargs):
        inputs_embeds = _embed(self, self.text_model, input_ids, inputs_embeds)
        if pixel_values is not None and image_hidden_states is not None:
            raise ValueError("You cannot specify both pixel_values and image_hidden_states at the same time")
        if pixel_values is not None:
            image_hidden_states = self.get_image_features(pixel_values, pixel_attention_mask)
        if image_hidden_states is not None:
            inputs_embeds = _merge(inputs_embeds, image_hidden_states)
        return self.text_model(inputs_embeds)


class SmolVLMModel(Idefics3Model):
    keep_one_image = True


class Idefics3ForConditionalGeneration(ForConditionalGeneration):
    def __init__(self):
        super().__init__(Idefics3Model(), "idefics3", text="text_model")


class SmolVLMForConditionalGeneration(ForConditionalGeneration):
    def __init__(self):
        super().__init__(SmolVLMModel(), "smolvlm", text="text_model")


# ---------------------------------------------------------------------------------------------
# InternVL


class InternVLVisionPatchEmbeddings(nn.Module):
    def __init__(self, dim: int = VISION):
        super().__init__()
        self.projection = nn.Conv2d(3, dim, kernel_size=PATCH, stride=PATCH)

    def forward(self, pixel_values):
        return self.projection(pixel_values).flatten(2).transpose(1, 2)


class InternVLVisionEmbeddings(nn.Module):
    def __init__(self, dim: int = VISION):
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.mask_token = None  # use_mask_token=False (the default)
        self.patch_embeddings = InternVLVisionPatchEmbeddings(dim)
        self.position_embeddings = nn.Parameter(torch.randn(1, (IMAGE // PATCH) ** 2 + 1, dim) * 0.02)
        self.dropout = nn.Dropout(0.0)

    def forward(self, pixel_values):
        x = self.patch_embeddings(pixel_values)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.dropout(x + self.position_embeddings)


class InternVLVisionAttention(nn.Module):
    def __init__(self, dim: int = VISION):
        super().__init__()
        self.q_proj = nn.Linear(dim, dim, bias=False)  # attention_bias=False (the default)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.projection_layer = nn.Linear(dim, dim)
        self.projection_dropout = nn.Identity()
        self.q_norm = nn.Identity()  # use_qk_norm=False
        self.k_norm = nn.Identity()

    def forward(self, x):
        out = _attend(self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x)), self.v_proj(x))
        return self.projection_dropout(self.projection_layer(out))


class InternVLVisionLayer(nn.Module):
    def __init__(self, dim: int = VISION):
        super().__init__()
        self.attention = InternVLVisionAttention(dim)
        self.mlp = MLP(dim, 2 * dim)
        self.layernorm_before = nn.LayerNorm(dim)
        self.layernorm_after = nn.LayerNorm(dim)
        self.lambda_1 = nn.Parameter(0.1 * torch.ones(dim))
        self.lambda_2 = nn.Parameter(0.1 * torch.ones(dim))
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x))
        return x + self.lambda_2 * self.dropout(self.mlp(self.layernorm_after(x)))


class InternVLVisionEncoder(nn.Module):
    def __init__(self, dim: int = VISION):
        super().__init__()
        self.layer = nn.ModuleList([InternVLVisionLayer(dim) for _ in range(LAYERS)])

    def forward(self, x):
        for layer in self.layer:
            x = layer(x)
        return x


class InternVLVisionModel(nn.Module):
    def __init__(self, dim: int = VISION, use_mean_pooling: bool = True):
        super().__init__()
        self.embeddings = InternVLVisionEmbeddings(dim)
        self.encoder = InternVLVisionEncoder(dim)
        self.layernorm = nn.Identity() if use_mean_pooling else nn.LayerNorm(dim)

    def forward(self, pixel_values):
        _no_elements(pixel_values, "InternVL vision tower")
        return self.layernorm(self.encoder(self.embeddings(pixel_values)))


class InternVLModel(nn.Module):
    def __init__(self, use_mean_pooling: bool = True):
        super().__init__()
        self.vision_tower = InternVLVisionModel(use_mean_pooling=use_mean_pooling)
        self.multi_modal_projector = LinearProjector(VISION * 4, TEXT, layer_norm=True)  # downsample_ratio 0.5
        self.language_model = TextModel(qkv_bias=True)

    def forward(self, input_ids=None, pixel_values=None, attention_mask=None, inputs_embeds=None, **kwargs):
        inputs_embeds = _embed(self, self.language_model, input_ids, inputs_embeds)
        if pixel_values is not None:
            features = self.vision_tower(pixel_values)[:, 1:, :]  # select strategy "default": no CLS
            b, n, d = features.shape
            features = features.reshape(b, n // 4, d * 4)  # pixel shuffle, downsample_ratio 0.5
            inputs_embeds = _merge(inputs_embeds, self.multi_modal_projector(features))
        return self.language_model(inputs_embeds)


class InternVLForConditionalGeneration(ForConditionalGeneration):
    def __init__(self, use_mean_pooling: bool = True):
        super().__init__(InternVLModel(use_mean_pooling), "internvl", tie=True)


# ---------------------------------------------------------------------------------------------
# Mllama

MLLAMA_TILES = 2  # max_num_tiles
MLLAMA_ASPECT_RATIOS = 3  # max_aspect_ratio_id: supported_aspect_ratios [[1, 1], [1, 2], [2, 1]]
MLLAMA_INTERMEDIATE = (0,)  # intermediate_layers_indices
MLLAMA_CROSS_LAYERS = (1,)  # cross_attention_layers


class MllamaPrecomputedAspectRatioEmbedding(nn.Module):
    def __init__(self, dim: int = VISION):
        super().__init__()
        self.embedding = nn.Embedding(MLLAMA_ASPECT_RATIOS + 1, MLLAMA_TILES * dim)
        self.gate = nn.Parameter(torch.zeros(1))
        self.dim = dim

    def forward(self, hidden, aspect_ratio_ids):
        emb = self.embedding(aspect_ratio_ids).reshape(-1, MLLAMA_TILES, 1, self.dim)
        return hidden + emb * self.gate.tanh()


class MllamaPrecomputedPositionEmbedding(nn.Module):
    def __init__(self, dim: int = VISION):
        super().__init__()
        self.num_patches = (IMAGE // PATCH) ** 2 + 1
        self.gate = nn.Parameter(torch.zeros(1))
        self.embedding = nn.Parameter(torch.randn(self.num_patches, dim) * dim ** -0.5)
        self.tile_embedding = nn.Embedding(MLLAMA_ASPECT_RATIOS + 1, MLLAMA_TILES * self.num_patches * dim)
        self.dim = dim

    def forward(self, hidden, aspect_ratio_ids):
        hidden = hidden + (1 - self.gate.tanh()) * self.embedding.view(1, 1, self.num_patches, self.dim)
        tile = self.tile_embedding(aspect_ratio_ids).reshape(hidden.shape[0], MLLAMA_TILES, self.num_patches, self.dim)
        return hidden + self.gate.tanh() * tile


class MllamaVisionEncoderLayer(nn.Module):
    def __init__(self, dim: int = VISION, is_gated: bool = False):
        super().__init__()
        self.self_attn = Attention(dim, bias=(False, False, False, False))
        self.mlp = MLP(dim, 2 * dim)
        self.input_layernorm = nn.LayerNorm(dim)
        self.post_attention_layernorm = nn.LayerNorm(dim)
        self.is_gated = is_gated
        if is_gated:
            self.gate_attn = nn.Parameter(torch.ones(1) * math.pi / 4)
            self.gate_ffn = nn.Parameter(torch.ones(1) * math.pi / 4)

    def forward(self, x):
        h = self.self_attn(self.input_layernorm(x))
        x = x + (self.gate_attn.tanh() * h if self.is_gated else h)
        h = self.mlp(self.post_attention_layernorm(x))
        return x + (self.gate_ffn.tanh() * h if self.is_gated else h)


class MllamaVisionEncoder(nn.Module):
    def __init__(self, dim: int = VISION, num_layers: int = LAYERS, is_gated: bool = False):
        super().__init__()
        self.layers = nn.ModuleList([MllamaVisionEncoderLayer(dim, is_gated) for _ in range(num_layers)])

    def forward(self, x):
        states = []
        for layer in self.layers:
            x = layer(x)
            states.append(x)
        return x, states


class MllamaVisionModel(nn.Module):
    def __init__(self, dim: int = VISION):
        super().__init__()
        self.num_patches = (IMAGE // PATCH) ** 2 + 1
        self.patch_embedding = nn.Conv2d(3, dim, kernel_size=PATCH, stride=PATCH, bias=False)
        self.class_embedding = nn.Parameter(torch.randn(dim) * dim ** -0.5)
        self.gated_positional_embedding = MllamaPrecomputedPositionEmbedding(dim)
        self.pre_tile_positional_embedding = MllamaPrecomputedAspectRatioEmbedding(dim)
        self.post_tile_positional_embedding = MllamaPrecomputedAspectRatioEmbedding(dim)
        self.layernorm_pre = nn.LayerNorm(dim)
        self.layernorm_post = nn.LayerNorm(dim)
        self.transformer = MllamaVisionEncoder(dim, LAYERS, is_gated=False)
        self.global_transformer = MllamaVisionEncoder(dim, LAYERS, is_gated=True)

    def forward(self, pixel_values, aspect_ratio_ids, aspect_ratio_mask=None):
        _no_elements(pixel_values, "Mllama vision model")
        b, n, t, c, h, w = pixel_values.shape
        x = self.patch_embedding(pixel_values.reshape(b * n * t, c, h, w)).flatten(2).transpose(1, 2)
        d = x.shape[-1]
        ids = aspect_ratio_ids.reshape(b * n, -1)
        x = self.pre_tile_positional_embedding(x.reshape(b * n, t, -1, d), ids).reshape(b * n * t, -1, d)
        x = torch.cat([self.class_embedding.expand(b * n * t, 1, d), x], dim=1)
        x = self.gated_positional_embedding(x.reshape(b * n, t, self.num_patches, d), ids)
        x = self.layernorm_pre(x).reshape(b * n, t * self.num_patches, d)
        x, states = self.transformer(x)
        x = self.layernorm_post(x).reshape(b * n, t, self.num_patches, d)
        x = self.post_tile_positional_embedding(x, ids).reshape(b * n, t * self.num_patches, d)
        x, _ = self.global_transformer(x)
        hidden = torch.cat([x] + [states[i] for i in MLLAMA_INTERMEDIATE], dim=-1)
        return hidden.reshape(b, n, t, self.num_patches, -1)


class MllamaCrossAttentionDecoderLayer(nn.Module):
    def __init__(self, dim: int = TEXT):
        super().__init__()
        self.cross_attn = Attention(dim, bias=(False, False, False, False), qk_norm=lambda: RMSNorm(dim))
        self.input_layernorm = RMSNorm(dim)
        self.cross_attn_attn_gate = nn.Parameter(torch.zeros(1))
        self.mlp = GatedMLP(dim, 2 * dim)
        self.post_attention_layernorm = RMSNorm(dim)
        self.cross_attn_mlp_gate = nn.Parameter(torch.zeros(1))

    def forward(self, x, cross_attention_states=None, **_):
        context = cross_attention_states.reshape(1, -1, x.shape[-1]).expand(x.shape[0], -1, -1)
        x = x + self.cross_attn_attn_gate.tanh() * self.cross_attn(self.input_layernorm(x), context)
        return x + self.cross_attn_mlp_gate.tanh() * self.mlp(self.post_attention_layernorm(x))


class MllamaTextModel(TextModel):
    def __init__(self):
        super().__init__(vocab=VOCAB + 8, layer_factory=lambda i: MllamaCrossAttentionDecoderLayer()
                         if i in MLLAMA_CROSS_LAYERS else DecoderLayer(TEXT))
        self.cross_attention_layers = list(MLLAMA_CROSS_LAYERS)

    def forward(self, inputs_embeds, cross_attention_states=None, **kwargs):
        x = inputs_embeds
        for idx, layer in enumerate(self.layers):
            if idx in self.cross_attention_layers and cross_attention_states is None:
                continue  # "For text-only path we should skip cross attention layers."
            x = layer(x, cross_attention_states=cross_attention_states)
        return self.norm(x)


class MllamaModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.vision_model = MllamaVisionModel()
        self.language_model = MllamaTextModel()
        self.multi_modal_projector = nn.Linear(VISION * (1 + len(MLLAMA_INTERMEDIATE)), TEXT, bias=True)

    def forward(self, input_ids=None, pixel_values=None, aspect_ratio_mask=None, aspect_ratio_ids=None,
                attention_mask=None, cross_attention_mask=None, cross_attention_states=None, inputs_embeds=None,
                **kwargs):
        if pixel_values is not None and cross_attention_states is not None:
            raise ValueError("`pixel_values` and `cross_attention_states` cannot be provided simultaneously")
        if pixel_values is not None:
            if aspect_ratio_ids is None:
                raise ValueError("`aspect_ratio_ids` must be provided if `pixel_values` is provided")
            states = self.vision_model(pixel_values, aspect_ratio_ids, aspect_ratio_mask)
            cross_attention_states = self.multi_modal_projector(states).reshape(-1, states.shape[-2], TEXT)
        inputs_embeds = _embed(self, self.language_model, input_ids, inputs_embeds)
        return self.language_model(inputs_embeds, cross_attention_states=cross_attention_states)


class MllamaForConditionalGeneration(ForConditionalGeneration):
    def __init__(self):
        super().__init__(MllamaModel(), "mllama")


# ---------------------------------------------------------------------------------------------
# Qwen2-Audio

MEL_BINS = 8  # num_mel_bins
AUDIO_POSITIONS = 8  # max_source_positions: input_features are 2 * 8 = 16 frames long


class Qwen2AudioEncoderLayer(nn.Module):
    def __init__(self, dim: int = VISION):
        super().__init__()
        self.self_attn = Attention(dim, names=("q_proj", "k_proj", "v_proj", "out_proj"),
                                   bias=(True, False, True, True))
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.activation_fn = nn.GELU()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.final_layer_norm = nn.LayerNorm(dim)

    def forward(self, x, attention_mask=None):
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(self.activation_fn(self.fc1(self.final_layer_norm(x))))


class Qwen2AudioEncoder(nn.Module):
    def __init__(self, dim: int = VISION, layerdrop: float = 0.0):
        super().__init__()
        self.layerdrop = layerdrop
        self.conv1 = nn.Conv1d(MEL_BINS, dim, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(dim, dim, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(AUDIO_POSITIONS, dim)
        self.embed_positions.requires_grad_(False)
        self.layers = nn.ModuleList([Qwen2AudioEncoderLayer(dim) for _ in range(LAYERS)])
        self.layer_norm = nn.LayerNorm(dim)
        self.avg_pooler = nn.AvgPool1d(2, stride=2)

    def forward(self, input_features, attention_mask=None):
        _no_elements(input_features, "Qwen2-Audio encoder")
        expected = AUDIO_POSITIONS * self.conv1.stride[0] * self.conv2.stride[0]
        if input_features.shape[-1] != expected:
            raise ValueError(f"Qwen2Audio expects the mel input features to be of length {expected}, but found "
                             f"{input_features.shape[-1]}")
        x = F.gelu(self.conv2(F.gelu(self.conv1(input_features)))).permute(0, 2, 1)
        x = x + self.embed_positions.weight
        for layer in self.layers:
            if self.training and self.layerdrop > 0 and float(torch.rand([])) < self.layerdrop:
                continue  # LayerDrop, as the real encoder in training mode
            x = layer(x, attention_mask)
        x = self.avg_pooler(x.permute(0, 2, 1)).permute(0, 2, 1)
        return self.layer_norm(x)


class Qwen2AudioMultiModalProjector(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(VISION, TEXT, bias=True)

    def forward(self, x):
        return self.linear(x)


class Qwen2AudioModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.audio_tower = Qwen2AudioEncoder()
        self.multi_modal_projector = Qwen2AudioMultiModalProjector()
        self.language_model = TextModel(qkv_bias=True)

    def forward(self, input_ids=None, input_features=None, attention_mask=None, feature_attention_mask=None,
                inputs_embeds=None, **kwargs):
        if input_features is not None:
            feature_attention_mask = feature_attention_mask.to(input_features.device)
        if inputs_embeds is None:
            inputs_embeds = self.language_model.embed_tokens(input_ids)
            if input_features is not None and input_ids.shape[1] != 1:
                features = self.multi_modal_projector(self.audio_tower(input_features))
                inputs_embeds = _merge(inputs_embeds, features)
        return self.language_model(inputs_embeds)


class Qwen2AudioForConditionalGeneration(ForConditionalGeneration):
    def __init__(self):
        super().__init__(Qwen2AudioModel(), "qwen2_audio")


# ---------------------------------------------------------------------------------------------
# Registry, freezing, batches

_CLASSES = {
    "llava": LlavaForConditionalGeneration,
    "llava_next": LlavaNextForConditionalGeneration,
    "llava_onevision": LlavaOnevisionForConditionalGeneration,
    "qwen2_vl": Qwen2VLForConditionalGeneration,
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
    "gemma3": Gemma3ForConditionalGeneration,
    "idefics3": Idefics3ForConditionalGeneration,
    "smolvlm": SmolVLMForConditionalGeneration,
    "internvl": InternVLForConditionalGeneration,
    "mllama": MllamaForConditionalGeneration,
    "qwen2_audio": Qwen2AudioForConditionalGeneration,
}

# The frozen modules of the usual fine-tune (tower, then projector), as paths of the model.
FROZEN = {
    "llava": ("model.vision_tower", "model.multi_modal_projector"),
    "llava_next": ("model.vision_tower", "model.multi_modal_projector"),
    "llava_onevision": ("model.vision_tower", "model.multi_modal_projector"),
    "qwen2_vl": ("model.visual",),
    "qwen2_5_vl": ("model.visual",),
    "gemma3": ("model.vision_tower", "model.multi_modal_projector"),
    "idefics3": ("model.vision_model", "model.connector"),
    "smolvlm": ("model.vision_model", "model.connector"),
    "internvl": ("model.vision_tower", "model.multi_modal_projector"),
    "mllama": ("model.vision_model", "model.multi_modal_projector"),
    "qwen2_audio": ("model.audio_tower", "model.multi_modal_projector"),
}


def _builder(cls):
    def build(seed: int = 0, **options) -> nn.Module:
        torch.manual_seed(seed)
        return cls(**options)

    build.__name__ = f"build_{cls.__name__}"
    code = cls.__init__.__code__
    build.__doc__ = f"A tiny {cls.__name__} (options: {code.co_varnames[1:code.co_argcount]})."
    return build


FAMILIES: Dict[str, Callable[..., nn.Module]] = {name: _builder(cls) for name, cls in _CLASSES.items()}
"""family name (as ``config.model_type``) -> builder(seed=0, **options) returning the untrained model."""


def family(model: nn.Module) -> str:
    return model.config.model_type


def freeze_towers(model: nn.Module, projector: bool = True) -> nn.Module:
    """requires_grad False on the tower(s) and (``projector``) the projector, as a user fine-tuning the
    language model does; returns the model."""
    paths = FROZEN[family(model)]
    for path in paths[:1] + (paths[1:] if projector else ()):
        model.get_submodule(path).requires_grad_(False)
    return model


# Batches with the keys and shapes the HF processors make (tiny sizes).

KINDS = {
    "llava": ("text", "image", "images", "empty_images"),
    "llava_next": ("text", "image", "images", "empty_images"),
    "llava_onevision": ("text", "image", "images", "video", "image+video", "empty_images", "empty_videos"),
    "qwen2_vl": ("text", "image", "images", "video", "image+video", "empty_images", "empty_videos"),
    "qwen2_5_vl": ("text", "image", "images", "video", "image+video", "empty_images", "empty_videos"),
    "gemma3": ("text", "image", "images", "empty_images"),
    "idefics3": ("text", "image", "images", "padding_only", "empty_images"),
    "smolvlm": ("text", "image", "images", "padding_only", "empty_images"),
    "internvl": ("text", "image", "images", "empty_images"),
    "mllama": ("text", "image", "images", "cross_attention_states", "empty_images"),
    "qwen2_audio": ("text", "audio", "audios", "decode_step", "inputs_embeds", "empty_audios"),
}
"""The batch kinds :func:`make_batch` makes for each family. The ``empty_*`` kinds hold the media key
with no elements, and Idefics3's ``padding_only`` only all-zero (padding) images: transformers' forward
fails on those (the look-alikes too), and shardcoord.hf rejects them (see :data:`FAILING`)."""

FAILING = {(name, kind) for name, kinds in KINDS.items() for kind in kinds if kind.startswith("empty_")} | {
    ("idefics3", "padding_only")}
"""(family, kind) pairs whose forward fails (in transformers 5.17 as in the look-alike)."""


def _text(batch_size: int, length: int, g: torch.Generator) -> Dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB - 2, (batch_size, length), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def make_batch(name: str, kind: str, batch_size: int = 2, seed: int = 0) -> Dict[str, torch.Tensor]:
    """A microbatch of ``kind`` (see :data:`KINDS`) for family ``name``: text-only, one image, several
    images, video only, images and videos, ... with the processor's keys."""
    if kind not in KINDS[name]:
        raise ValueError(f"family {name} has no batch kind {kind!r} (it has {KINDS[name]})")
    g = torch.Generator().manual_seed(seed)
    batch = _text(batch_size, 8, g)
    if kind.startswith("empty_"):
        return _empty_media(name, kind, batch)
    images = {"image": 1, "images": 3}.get(kind, 0)
    if kind == "image+video":
        images = 1

    def pixels(*shape):
        return torch.rand(*shape, generator=g)

    if name in ("llava", "gemma3", "internvl"):
        if images:
            batch["pixel_values"] = pixels(images, 3, IMAGE, IMAGE)
        if name == "gemma3":
            batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
    elif name == "llava_next":
        if images:
            batch["pixel_values"] = pixels(images, 3, 3, IMAGE, IMAGE)  # (images, anyres patches, C, H, W)
            batch["image_sizes"] = torch.tensor([[IMAGE, 2 * IMAGE]] * images)
    elif name == "llava_onevision":
        if images:
            batch["pixel_values"] = pixels(images, 2, 3, IMAGE, IMAGE)
            batch["image_sizes"] = torch.tensor([[IMAGE, IMAGE]] * images)
        if "video" in kind:
            batch["pixel_values_videos"] = pixels(1, 4, 3, IMAGE, IMAGE)  # (videos, frames, C, H, W)
    elif name in ("qwen2_vl", "qwen2_5_vl"):
        if images:
            grid = torch.tensor([[1, 4, 4]] * images)  # (t, h, w) in patches per image
            batch["pixel_values"] = pixels(int(grid.prod(-1).sum()), QWEN_PATCH_DIM)
            batch["image_grid_thw"] = grid
        if "video" in kind:
            grid = torch.tensor([[2, 4, 4]])
            batch["pixel_values_videos"] = pixels(int(grid.prod(-1).sum()), QWEN_PATCH_DIM)
            batch["video_grid_thw"] = grid
    elif name in ("idefics3", "smolvlm"):
        if images or kind == "padding_only":
            per_sample = max(images, 1)
            pv = pixels(batch_size, per_sample, 3, IMAGE, IMAGE)
            if kind == "padding_only":
                pv.zero_()  # every image is padding
            elif kind == "images":
                pv[1, 1:] = 0.0  # the second sample has one image: its other slots are padding
            batch["pixel_values"] = pv
            batch["pixel_attention_mask"] = torch.ones(batch_size, per_sample, IMAGE, IMAGE, dtype=torch.bool)
    elif name == "mllama":
        if images:
            batch["pixel_values"] = pixels(batch_size, images, MLLAMA_TILES, 3, IMAGE, IMAGE)
            batch["aspect_ratio_ids"] = torch.ones(batch_size, images, dtype=torch.long)
            batch["aspect_ratio_mask"] = torch.ones(batch_size, images, MLLAMA_TILES, dtype=torch.long)
            batch["cross_attention_mask"] = torch.ones(batch_size, 8, images, MLLAMA_TILES, dtype=torch.long)
        if kind == "cross_attention_states":  # precomputed vision states: the tower does not run
            batch["cross_attention_states"] = torch.rand(batch_size, MLLAMA_TILES * 17, TEXT, generator=g)
    elif name == "qwen2_audio":
        audios = {"audio": 1, "audios": 3, "decode_step": 1, "inputs_embeds": 1}.get(kind, 0)
        if audios:
            batch["input_features"] = torch.rand(audios, MEL_BINS, 2 * AUDIO_POSITIONS, generator=g)
            batch["feature_attention_mask"] = torch.ones(audios, 2 * AUDIO_POSITIONS, dtype=torch.long)
        if kind == "decode_step":  # one token: a generation step, the audio is not merged again
            batch = {**batch, "input_ids": batch["input_ids"][:, :1], "attention_mask": batch["attention_mask"][:, :1]}
            del batch["labels"]
        if kind == "inputs_embeds":  # embeddings given: the forward does not merge audio at all
            batch["inputs_embeds"] = torch.rand(batch_size, 8, TEXT, generator=g)
            del batch["input_ids"]
    return batch


def _empty_media(name: str, kind: str, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The media key present with no elements (a collator that concatenated nothing)."""
    long = torch.long
    if name in ("llava", "gemma3", "internvl"):
        batch["pixel_values"] = torch.zeros(0, 3, IMAGE, IMAGE)
    elif name == "llava_next":
        batch.update(pixel_values=torch.zeros(0, 3, 3, IMAGE, IMAGE), image_sizes=torch.zeros(0, 2, dtype=long))
    elif name == "llava_onevision" and kind == "empty_images":
        batch.update(pixel_values=torch.zeros(0, 2, 3, IMAGE, IMAGE), image_sizes=torch.zeros(0, 2, dtype=long))
    elif name == "llava_onevision":
        batch["pixel_values_videos"] = torch.zeros(0, 4, 3, IMAGE, IMAGE)
    elif name in ("qwen2_vl", "qwen2_5_vl"):
        key, grid = ("pixel_values", "image_grid_thw") if kind == "empty_images" else ("pixel_values_videos",
                                                                                       "video_grid_thw")
        batch.update({key: torch.zeros(0, QWEN_PATCH_DIM), grid: torch.zeros(0, 3, dtype=long)})
    elif name in ("idefics3", "smolvlm"):
        b = batch["input_ids"].shape[0]
        batch.update(pixel_values=torch.zeros(b, 0, 3, IMAGE, IMAGE),
                     pixel_attention_mask=torch.ones(b, 0, IMAGE, IMAGE, dtype=torch.bool))
    elif name == "mllama":
        b = batch["input_ids"].shape[0]
        batch.update(pixel_values=torch.zeros(b, 0, MLLAMA_TILES, 3, IMAGE, IMAGE),
                     aspect_ratio_ids=torch.zeros(b, 0, dtype=long), aspect_ratio_mask=torch.zeros(b, 0, MLLAMA_TILES,
                                                                                                   dtype=long))
    elif name == "qwen2_audio":
        batch.update(input_features=torch.zeros(0, MEL_BINS, 2 * AUDIO_POSITIONS),
                     feature_attention_mask=torch.zeros(0, 2 * AUDIO_POSITIONS, dtype=long))
    return batch
