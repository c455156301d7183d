#!/usr/bin/env python3
"""A stock Hugging Face ``Trainer`` fine-tune of a VLM with FSDP2, made safe by one changed line.

Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``, built from a tiny config: random weights, nothing
downloaded; tiny_qwen_vl.py) with its vision tower frozen, fine-tuned on a synthetic mix shaped like the
Qwen2.5-VL SFT mix (50 % text only, 36 % one image, 4 % two images, 10 % video),
one sample per microbatch, two microbatches per step, with accelerate's FSDP2 plugin wrapping every
``_no_split_modules`` class (``Qwen2_5_VLVisionBlock`` included) as its own unit: the default, which
shards the tower per layer.

Without shardcoord this hangs as soon as the ranks of a step disagree on running the tower (one has
an image, another text only): their FSDP all-gathers no longer pair. The line marked ``# shardcoord``
replaces ``transformers.Trainer`` by the same class with ``shardcoord.hf.TrainerMixin``: each rank
reports the plans of a step's microbatches when the Trainer fetches them, and the coordinator gives
the group one decision per microbatch (per_layer, skip, or the fallback). Delete that line and it is
the stock script. Run it with torchrun (with no ``SHARDCOORD_ADDR``, rank 0 starts a coordinator for
the job; README, Install)::

    torchrun --nproc_per_node 2 examples/python/hf_trainer_vlm.py

Needs torch >= 2.6, transformers >= 5 and accelerate >= 1.8 (FSDP2), and a GPU per rank, or
``--ddp-backend gloo`` for ranks that share one GPU (docs/GPU.md).
"""

import argparse
import sys
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments
from shardcoord.hf import Trainer  # noqa: F811  # shardcoord: the only change to the stock script

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_qwen_vl import MixedMedia, tiny_qwen2_5_vl  # noqa: E402  (the model and the data)

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ddp-backend", default=None, help="gloo where ranks share one GPU")
    parser.add_argument("--output-dir", default="/tmp/hf_trainer_vlm")
    parser.add_argument("--wrap", choices=("all", "decoder"), default="all",
                        help="decoder: only the decoder layers are units, the tower stays in the root unit "
                             "(the unsharded reference)")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = tiny_qwen2_5_vl()
    model.model.visual.requires_grad_(False)  # The frozen vision tower (merger included).
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=1,
        gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
        fsdp="full_shard", fsdp_config={"fsdp_version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                                        **({"transformer_layer_cls_to_wrap": ["Qwen2_5_VLDecoderLayer"]}
                                           if args.wrap == "decoder" else {})},
        ddp_backend=args.ddp_backend, remove_unused_columns=False, dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=training, train_dataset=MixedMedia(64, seed=1),
                      data_collator=lambda features: features[0])  # One sample per microbatch.
    trainer.train()
    if trainer.is_world_process_zero():
        print(f"losses {[round(e['loss'], 6) for e in trainer.state.log_history if 'loss' in e]}", flush=True)
    if hasattr(trainer, "shardcoord_decisions") and trainer.is_world_process_zero():
        print(f"decisions {trainer.shardcoord_decisions}", flush=True)


if __name__ == "__main__":
    main()
