#!/usr/bin/env python3
"""Towers that train under a stock Hugging Face ``Trainer`` with accelerate's FSDP2 plugin, with and
without shardcoord (DESIGN 10, "Towers that train"). Runs on the GPU machine like
``hf_trainer_check.py`` (several ranks share the one GPU over Gloo: FSDP2 units, collectives, losses,
gradients and memory are real there, times are not).

Two real models from tiny configs, on the family's published mix (docs/MIXES.md), one collated
microbatch per dataset item, 2 microbatches per step:

- ``qwen2_5_vl-trains``: Qwen2.5-VL with its vision tower (and merger) fully trainable; batches call
  it 0, 1 or 2 times (text; image, images or video; image+video);
- ``llava-lora``: LLaVA with LoRA adapters (peft, ``q_proj`` / ``v_proj``) on the attention of its
  CLIP tower and of its decoder, the only trainable parameters (the tower's base frozen); batches call
  the tower 0 or 1 times (text; image).

Runs of each, at the same seed:

- ``shardcoord``: the stock script plus ``shardcoord.hf.patch(trainer, trainable=True)``, the tower's
  layers FSDP units of their own;
- ``reference``: trained without sharding: DDP (``ddp_find_unused_parameters``: a rank whose batch
  had no image contributes zeros for the tower), the same global batch; ``--reference fsdp``
  instead: FSDP2 with only the decoder layers wrapped (the tower stays in the root unit, gathered
  whole by every rank) and 0 x every trainable tower parameter added to the loss, so that every
  rank has a gradient for each (FSDP2 would otherwise reduce-scatter other parameters on the ranks
  without images);
- ``stock``: the tower per layer without shardcoord. Expected to hang (killed at ``--hang-timeout``)
  or to fail in a mismatched collective;
- ``dummy`` (LLaVA only, with ``--dummy``): the tower per layer with the workaround frameworks use (torchtitan's open PR
  for trained encoders, verl): a rank whose batch has no image runs the tower on a dummy image and
  adds 0 x its output to the loss. It only helps where ranks call the tower 0 or 1 times; Qwen's
  image+video batches call it twice, so no dummy run there.

Checked for every shardcoord run: exit 0 on every rank; per step, the loss, the gradient norm the
Trainer logs (every trainable parameter), the tower's trainable gradients (sum of squares, before the
optimizer step) and its trainable parameters (sum of squares, after it) equal the reference's within
``--rtol``; the decisions include per_layer and root in each case, and skip in one at least; the
stock runs do not complete. Prints a
table; writes ``$OUT/trainable_tower_check.json``; exit 1 on any failure.

    python3 scripts/gpu/trainable_tower_check.py [--case qwen2_5_vl-trains ...] [--ranks 2] [--steps 8]
"""

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hf_trainer_check as base  # noqa: E402  (launch, finish, the mixes and wrap classes)

CASES = {"qwen2_5_vl-trains": "qwen2_5_vl", "llava-lora": "llava"}
TOWER = {"qwen2_5_vl": "visual", "llava": "vision_tower"}  # Last name component of the tower's path.
TOWER_LAYER = {"qwen2_5_vl": "Qwen2_5_VLVisionBlock", "llava": "CLIPEncoderLayer"}


# --tower-size: the LLaVA case's CLIP tower at the size of a real one (ViT-L/14's width, depth and
# heads, about 300 M parameters; the images stay 16 x 16, so activations stay small): peaks and
# gathered bytes then show the weights' share.
TOWER_SIZES = {"tiny": {}, "vit-l": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                        num_attention_heads=16)}


def build(case: str, tower_size: str = "tiny"):
    """The model of ``case``: its tower trainable (Qwen) or with LoRA on it (LLaVA), the rest as in the
    drop-in check."""
    import torch
    import transformers as tf

    import hf_calls_check as calls

    family = CASES[case]
    cls_name, make_config, _, _ = calls.FAMILIES[family]
    torch.manual_seed(0)
    config = make_config(tf)
    for key, value in TOWER_SIZES[tower_size].items():
        setattr(config.vision_config, key, value)
    model = getattr(tf, cls_name)(config)
    if case == "llava-lora":
        import peft

        model.get_submodule("model.vision_tower").requires_grad_(False)
        # peft's usual attention targets, in the decoder and the tower alike (LoRA on the tower alone
        # leaves the decoder frozen, so its backward runs only on the ranks whose batch had an image:
        # the decoder's FSDP units then differ between ranks, outside any tower; docs/GPU.md).
        # The projector trains too (peft's modules_to_save, as LLaVA recipes do): it stays in the root unit.
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                 modules_to_save=["multi_modal_projector"])
        model = peft.get_peft_model(model, config)  # Freezes everything but the adapters.
    return model


def tower_params(model, family: str) -> list:
    return [p for name, p in model.named_parameters() if f".{TOWER[family]}." in f".{name}." and p.requires_grad]


def tower_sums(model, family: str, grads: bool) -> float:
    """Sum of squares of the tower's trainable parameters (or their gradients): each rank's shards, summed
    over the ranks in one all-reduce (every rank calls this at the same point)."""
    import torch
    import torch.distributed as dist

    total = torch.zeros((), dtype=torch.float64)
    for p in tower_params(model, family):
        t = p.grad if grads else p
        if t is not None:  # A shard (FSDP2's DTensor), or a whole replica on every rank (DDP).
            local = t.to_local() if hasattr(t, "to_local") else t / dist.get_world_size() ** 0.5
            total += local.detach().double().pow(2).sum().cpu()
    dist.all_reduce(total)
    return float(total)


def touch_every_trainable(model, family: str):
    """The reference: 0 x every trainable tower parameter joins the loss, so every rank has a gradient
    for each (zeros where its batch had no image), as DDP's find_unused_parameters would give; without
    it, FSDP2 reduce-scatters other parameters on the ranks without images (a mismatched collective)."""
    original = model.forward

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)  # Inside the root unit's forward: the parameters are gathered.
        out.loss = out.loss + 0.0 * sum(p.sum() for p in tower_params(model, family))
        return out

    model.forward = forward


def dummy_forward(model, family: str):
    """The workaround: a rank whose batch has no image runs the tower on one dummy image where the
    other ranks run it on theirs (LLaVA's forward: after the input embeddings, before the decoder),
    and 0 x its features join the decoder's input, as real features do. It runs in a pre-hook of the
    language model, not in a hook of the embeddings: accelerate makes the embeddings an FSDP unit, and
    the tower run inside its forward would put the tower's units before it in FSDP2's post-forward
    order, which its backward prefetch follows (a hang: docs/GPU.md)."""
    import torch

    import hf_calls_check as calls

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    size = inner.config.vision_config.image_size
    original = model.forward
    text_only = [False]  # This forward's batch has no image (reset after every forward, raised or not).

    def forward(*args, **kwargs):
        text_only[0] = kwargs.get("pixel_values") is None
        if os.environ.get("TRACE_FSDP"):
            print(f"TRACE forward text_only={text_only[0]}", flush=True)
        try:
            return original(*args, **kwargs)
        finally:
            text_only[0] = False

    def merge(_module, args, kwargs):
        if not text_only[0]:
            return None
        text_only[0] = False
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            raise RuntimeError("dummy_forward: the language model was called without inputs_embeds=")
        image = torch.zeros(1, 3, size, size, device=embeds.device, dtype=inner.dtype)
        dummy = calls.pooled(inner.model.get_image_features(pixel_values=image))
        dummy = torch.cat(list(dummy)) if isinstance(dummy, (list, tuple)) else dummy
        return args, dict(kwargs, inputs_embeds=embeds + 0.0 * dummy.sum())

    inner.model.language_model.register_forward_pre_hook(merge, with_kwargs=True)
    model.forward = forward


def trace_fsdp() -> None:
    """TRACE_FSDP=1: each FSDP2 unit's unshard and post-backward, printed in the order this rank
    issues them (a hung run's two logs then show where the ranks' collectives part)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    for name in ("unshard", "post_backward"):
        original = getattr(group.FSDPParamGroup, name)

        def traced(self, *args, _name=name, _original=original, **kwargs):
            print(f"TRACE {_name} {getattr(self, '_module_fqn', '?') or '<root>'} {getattr(getattr(self, '_training_state', None), 'name', '?')}", flush=True)
            return _original(self, *args, **kwargs)

        setattr(group.FSDPParamGroup, name, traced)


def rank_main(case: str, mode: str, steps: int, out: Path, tower_size: str = "tiny") -> None:
    import torch
    import transformers as tf

    import hf_calls_check as calls

    family = CASES[case]
    model = build(case, tower_size)
    _, _, make_batch, _ = calls.FAMILIES[family]
    rng = random.Random(1)
    mix = base.MIXES[family]
    kinds = rng.choices(list(mix), weights=list(mix.values()), k=64)
    torch.manual_seed(1)
    data = [make_batch(kind, model) for kind in kinds]
    if os.environ.get("TRACE_FSDP"):
        trace_fsdp()
    if os.environ.get("DUMP_AFTER"):  # A hung rank prints where it waits before the driver kills it.
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["DUMP_AFTER"]), exit=False)
    ddp = mode == "reference"  # Trained without sharding.
    fsdp_config = {"fsdp_version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                   "transformer_layer_cls_to_wrap": [base.DECODER_LAYER[family]] +
                   ([] if mode == "reference-fsdp" else [TOWER_LAYER[family]])}
    sharding = {} if ddp else {"fsdp": "full_shard", "fsdp_config": fsdp_config}
    args = tf.TrainingArguments(
        output_dir=str(out / f"{case}-{mode}"), max_steps=steps, per_device_train_batch_size=1,
        gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
        ddp_backend="gloo", ddp_find_unused_parameters=True, remove_unused_columns=False,
        dataloader_num_workers=0, seed=0, **sharding)
    sums = {"grads": [], "params": []}

    class Sums(tf.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            sums["grads"].append(tower_sums(model, family, grads=True))

        def on_step_end(self, args, state, control, model=None, **kw):
            sums["params"].append(tower_sums(model, family, grads=False))

    trainer = tf.Trainer(model=model, args=args, train_dataset=data, data_collator=lambda features: features[0],
                         callbacks=[Sums()])
    if mode == "shardcoord":
        import shardcoord.hf
        trainer = shardcoord.hf.patch(trainer, trainable=True)  # The line a user adds, opting the tower in.
    elif mode == "dummy":
        dummy_forward(model, family)
    elif mode == "reference-fsdp":
        touch_every_trainable(model, family)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.monotonic()
    trainer.train()
    seconds = time.monotonic() - start
    history = trainer.state.log_history
    result = {"case": case, "mode": mode, "rank": int(os.environ["RANK"]),
              "losses": [e["loss"] for e in history if "loss" in e],
              "grad_norms": [e["grad_norm"] for e in history if "grad_norm" in e],
              "tower_grad_sums": sums["grads"], "tower_param_sums": sums["params"],
              "seconds": round(seconds, 2), "seconds_per_step": round(seconds / max(steps, 1), 3),
              "decisions": dict(getattr(trainer, "shardcoord_decisions", {})),
              "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if torch.cuda.is_available() else 0}
    print("RESULT " + json.dumps(result), flush=True)


def worst(a: list, b: list) -> float:
    """Worst relative difference of two equally long series (inf when lengths differ or one is empty)."""
    if not a or len(a) != len(b):
        return float("inf")
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def check_case(case: str, codes: dict, out: Path, args) -> tuple:
    """(row, failures) of one case."""
    failures = []
    ok = [0] * args.ranks
    sc, ref = base.results(out, case, "shardcoord", args.ranks), base.results(out, case, args.reference, args.ranks)
    row = {"case": case, "ranks": args.ranks, "reference": args.reference,
           **{f"exit_{m.replace('-fsdp', '')}": c for (k, m), c in codes.items() if k == case},
           "stock_tail": base.tail(out, case, "stock", 0)}
    for mode, got in (("shardcoord", sc), (args.reference, ref)):
        if codes[(case, mode)] != ok or len(got) != args.ranks:
            failures.append(f"{case}: {mode} run exited {codes[(case, mode)]}: {base.tail(out, case, mode, 0)}")
    if sc and ref:
        for key in ("losses", "grad_norms", "tower_grad_sums", "tower_param_sums"):
            w = worst(sc[0][key], ref[0][key])
            row[f"worst_{key}"] = w
            if len(sc[0][key]) != args.steps or w > args.rtol:
                failures.append(f"{case}: {key} differ from the reference (worst relative {w:.2e}): "
                                f"{sc[0][key]} vs {ref[0][key]}")
        row.update(decisions=sc[0]["decisions"], losses=sc[0]["losses"], tower_param_sums=sc[0]["tower_param_sums"],
                   peak_mib_shardcoord=[r["peak_mib"] for r in sc], peak_mib_reference=[r["peak_mib"] for r in ref],
                   seconds_per_step_shardcoord=[r["seconds_per_step"] for r in sc],
                   seconds_per_step_reference=[r["seconds_per_step"] for r in ref])
        missing = [k for k in ("per_layer", "root") if not sc[0]["decisions"].get(k)]
        if missing:
            failures.append(f"{case}: decisions {sc[0]['decisions']}: none of {missing}")
    if codes[(case, "stock")] == ok:
        failures.append(f"{case}: the stock run (per-layer tower, mixed media) completed: nothing shown")
    if (case, "dummy") in codes:
        dummy = base.results(out, case, "dummy", args.ranks)
        if codes[(case, "dummy")] != ok or len(dummy) != args.ranks:
            failures.append(f"{case}: dummy run exited {codes[(case, 'dummy')]}: {base.tail(out, case, 'dummy', 0)}")
        else:
            row.update(peak_mib_dummy=[r["peak_mib"] for r in dummy],
                       seconds_per_step_dummy=[r["seconds_per_step"] for r in dummy],
                       worst_losses_dummy=worst(dummy[0]["losses"], ref[0]["losses"]) if ref else None)
    return row, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES))
    base.add_run_arguments(parser)
    parser.add_argument("--reference", choices=("reference", "reference-fsdp"), default="reference",
                        help="reference: DDP (unsharded); reference-fsdp: FSDP2 with the tower in the root unit")
    parser.add_argument("--dummy", action="store_true",
                        help="also the dummy-forward workaround for LLaVA (time and peak against shardcoord's)")
    parser.add_argument("--tower-size", choices=sorted(TOWER_SIZES), default="tiny",
                        help="the LLaVA tower's size: tiny (the drop-in check's), or vit-l (a real tower's width and depth)")
    parser.add_argument("--rank-of", nargs=2, metavar=("CASE", "MODE"))
    args = parser.parse_args()
    out = Path(args.out)
    if args.rank_of:
        rank_main(*args.rank_of, args.steps, out, args.tower_size)
        return 0
    cases = args.case or sorted(CASES)
    env = dict(os.environ)
    runs = {}
    for case in cases:  # Every run at once (one GPU, 16 cores: they are small); the stock runs are expected to hang.
        for mode in ("shardcoord", args.reference, "stock") + (("dummy",) if case == "llava-lora" and args.dummy else ()):
            argv = [__file__, "--rank-of", case, mode, "--steps", str(args.steps), "--out", str(out),
                    "--tower-size", args.tower_size]
            limit = args.hang_timeout if mode == "stock" else args.timeout
            runs[(case, mode)] = base.launch(f"{case}-{mode}", argv, args.ranks, out,
                                             dict(env, DUMP_AFTER=str(max(5.0, limit - 30))))
    start = time.monotonic()
    codes = {key: base.finish(procs, start + (args.hang_timeout if key[1] == "stock" else args.timeout))
             for key, procs in runs.items()}
    table, failures = [], []
    for case in cases:
        row, failed = check_case(case, codes, out, args)
        table.append(row)
        failures += failed
    # Skip is asked of the whole check; LLaVA's mix alone has no microbatch without an image on both
    # ranks in a few steps, so a run of chosen cases is not held to it.
    if not args.case and not any((row.get("decisions") or {}).get("skip") for row in table):
        failures.append("no case was decided skip: run more --steps")
    for row in table:
        case = row["case"]
        print(f"{case:18s} exits shardcoord {row.get('exit_shardcoord')} reference {row.get('exit_reference')} "
              f"stock {row.get('exit_stock')} dummy {row.get('exit_dummy', '-')}; decisions {row.get('decisions')}",
              flush=True)
        print(f"{'':18s} worst relative diff: " + ", ".join(f"{k[6:]} {row[k]:.2e}" for k in row
                                                             if k.startswith("worst_") and row[k] is not None), flush=True)
        print(f"{'':18s} peak MiB shardcoord {row.get('peak_mib_shardcoord')} reference {row.get('peak_mib_reference')}"
              f" dummy {row.get('peak_mib_dummy', '-')}; s/step shardcoord {row.get('seconds_per_step_shardcoord')} "
              f"dummy {row.get('seconds_per_step_dummy', '-')}", flush=True)
        print(f"{'':18s} stock: {row['stock_tail']}", flush=True)
    (out / "trainable_tower_check.json").write_text(json.dumps(table, indent=1))
    for f in failures:
        print("FAIL " + f, flush=True)
    print(f"== trainable_tower_check: {'all passed' if not failures else f'{len(failures)} FAILED'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
