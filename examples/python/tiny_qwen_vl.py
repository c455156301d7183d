"""The tiny Qwen2.5-VL and the mixed-media data of the framework examples (hf_trainer_vlm.py,
lightning_vlm.py): the real ``Qwen2_5_VLForConditionalGeneration`` from a tiny config (random
weights, nothing downloaded), and samples shaped as its processor makes them, drawn from a mix
shaped like the published Qwen2.5-VL SFT mix (50 % text only, 36 % one image, 4 % two images,
10 % video: the Qwen2.5-VL technical report, section 2.3.1; the split of the multimodal half is
assumed)."""

import random

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

TEXT, IMAGE, VIDEO, VISION_END, VISION_START = 7, 100, 101, 104, 103
MIX = (("text", 0.50), ("image", 0.36), ("images", 0.04), ("video", 0.10))  # Qwen2.5-VL SFT


def tiny_qwen2_5_vl() -> Qwen2_5_VLForConditionalGeneration:
    vision = dict(depth=4, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=2, patch_size=2,
                  temporal_patch_size=2, spatial_merge_size=2, window_size=8, fullatt_block_indexes=[3])
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6]})
    config = Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=IMAGE, video_token_id=VIDEO,
                              vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    return Qwen2_5_VLForConditionalGeneration(config)


def sample(kind: str, rng: random.Random) -> dict:
    """One sample as the processor and a collator of one make it: placeholders for every merged patch."""
    ids, types, out = [TEXT + rng.randrange(5) for _ in range(4)], [0] * 4, {}
    images = {"image": 1, "images": 2}.get(kind, 0)
    if images:
        grid = torch.tensor([[1, 4, 4]] * images)
        out.update(pixel_values=torch.rand(int(grid.prod(-1).sum()), 24), image_grid_thw=grid)
        for _ in range(images):
            ids += [VISION_START] + [IMAGE] * 4 + [VISION_END]
            types += [0] + [1] * 4 + [0]
    if kind == "video":
        grid = torch.tensor([[2, 4, 4]])
        out.update(pixel_values_videos=torch.rand(int(grid.prod(-1).sum()), 24), video_grid_thw=grid)
        ids += [VISION_START] + [VIDEO] * 8 + [VISION_END]
        types += [0] + [2] * 8 + [0]
    ids += [TEXT + rng.randrange(5) for _ in range(4)]
    types += [0] * 4
    input_ids = torch.tensor([ids])
    return dict(out, input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=input_ids.clone(),
                mm_token_type_ids=torch.tensor([types], dtype=torch.int))


class MixedMedia(torch.utils.data.Dataset):
    def __init__(self, size: int, seed: int):
        rng = random.Random(seed)
        kinds = rng.choices([k for k, _ in MIX], weights=[w for _, w in MIX], k=size)
        self.samples = [sample(kind, rng) for kind in kinds]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        return self.samples[i]
