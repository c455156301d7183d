#!/usr/bin/env python3
"""A Lightning fine-tune of a VLM with FSDP2 (``ModelParallelStrategy``), made safe by two lines.

The same tiny Qwen2.5-VL and mixed media as ``hf_trainer_vlm.py`` (its vision tower frozen), in a
LightningModule whose ``configure_model`` applies ``fully_shard`` to every decoder layer and vision
block (``--wrap all``, the usual per-layer recipe) and then the model. Without shardcoord that hangs on
mixed media as soon as the ranks disagree on running the tower. The two lines marked ``# shardcoord``
add the callback: it shards the tower's layers before ``configure_model`` (which then skips modules
that already are FSDP units, as accelerate's wrap loop does) and carries out the coordinator's decision
around each batch. Delete them and it is the stock script. With torchrun (no ``SHARDCOORD_ADDR``:
rank 0 starts a coordinator for the job)::

    torchrun --nproc_per_node 2 examples/python/lightning_vlm.py

Needs torch >= 2.6, lightning >= 2.4 and transformers >= 5; ``--process-group-backend gloo`` for ranks
that share one GPU (docs/GPU.md says how they are started there).
"""

import argparse
import random
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import FSDPModule, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_qwen_vl import MixedMedia, tiny_qwen2_5_vl  # noqa: E402  (the model and the data)
import shardcoord.lightning  # noqa: E402  # shardcoord


class VLM(L.LightningModule):
    def __init__(self, wrap: str):
        super().__init__()
        self.model = tiny_qwen2_5_vl()
        self.model.model.visual.requires_grad_(False)  # The frozen vision tower.
        self.wrap = wrap

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        kinds = ("Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock") if self.wrap == "all" else ("Qwen2_5_VLDecoderLayer",)
        for module in self.model.modules():
            if type(module).__name__ in kinds and not isinstance(module, FSDPModule):
                fully_shard(module, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("loss", loss, on_step=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--wrap", choices=("all", "decoder"), default="all",
                        help="decoder: the tower stays in the root unit (the unsharded reference)")
    parser.add_argument("--process-group-backend", default=None)
    parser.add_argument("--devices", type=int, default=-1, help="GPUs per node (1 where ranks share one GPU)")
    parser.add_argument("--num-nodes", type=int, default=1)
    args = parser.parse_args()

    random.seed(0)
    torch.manual_seed(0)
    module = VLM(args.wrap)
    loader = torch.utils.data.DataLoader(MixedMedia(64, seed=1), batch_size=1, shuffle=True,
                                         collate_fn=lambda features: features[0])
    losses = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    if args.process_group_backend == "gloo" and torch.cuda.is_available() and not torch.distributed.is_initialized():
        # Ranks sharing one GPU over Gloo (the GPU check, docs/GPU.md): Lightning would bind the group to
        # the GPU, and torch 2.11's device mesh then splits it, which fails for Gloo ("cannot pickle
        # '_Options' object"). An unbound group is made here from the launcher's environment; with NCCL,
        # Lightning makes its own.
        torch.distributed.init_process_group("gloo")
    trainer = L.Trainer(
        accelerator="cuda", devices=args.devices, num_nodes=args.num_nodes, max_steps=args.steps,
        accumulate_grad_batches=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
        strategy=ModelParallelStrategy(process_group_backend=args.process_group_backend),
        callbacks=[Losses(),
                   shardcoord.lightning.Shardcoord(),  # shardcoord
                   ])
    trainer.fit(module, loader)
    print(f"rank {trainer.global_rank} losses {[round(x, 6) for x in losses]}", flush=True)
    for callback in trainer.callbacks:
        if hasattr(callback, "decisions") and trainer.global_rank == 0:
            print(f"decisions {callback.decisions}", flush=True)


if __name__ == "__main__":
    main()
