#!/usr/bin/env python3
"""A stock Hugging Face ``Trainer`` with accelerate's FSDP2 plugin on real VLM classes, with and
without shardcoord (issue: drop-in for the trainers people run). Runs on the GPU machine (torch 2.11,
transformers 5.x, accelerate 1.x); several ranks share the one GPU over Gloo (each process
``LOCAL_RANK=0``, ``TrainingArguments(ddp_backend="gloo")``): FSDP2 units, collectives, losses and
memory are real there, times are not.

For each family (the real ``<X>ForConditionalGeneration`` from a tiny config, scripts/gpu/hf_calls_check.py),
its tower and projector frozen, a synthetic mix shaped like the family's published one
(``docs/MIXES.md``, as docs/GPU.md cites), one collated microbatch per dataset item, 2 microbatches
per step, three runs at the same seed:

- ``shardcoord``: the stock script plus ``shardcoord.hf.patch(trainer)``, accelerate's default FSDP2
  wrapping (``TRANSFORMER_BASED_WRAP`` on ``_no_split_modules``, or for LLaVA and Gemma 3, whose
  ``_no_split_modules`` accelerate cannot use, the decoder's and the tower's layer classes listed: the
  tower's layers are units of their own), a real shardcoordd;
- ``reference``: the same without shardcoord, but only the decoder layers wrapped (the tower stays in
  the root unit, gathered whole by every rank in every forward: safe, and the same math);
- ``stock``: the same as ``shardcoord`` without it: the tower per layer on mixed media. Expected to
  hang (killed at ``--hang-timeout``) or to fail in a mismatched collective.

Checked: shardcoord's runs exit 0 on every rank, their per-step losses equal the reference's (within
``--rtol``), the decisions seen include per_layer and at least one other kind; the stock runs do not
complete. Prints a table; writes ``$OUT/hf_trainer_check.json``; exit 1 on any failure.

    python3 scripts/gpu/hf_trainer_check.py [--family qwen2_5_vl ...] [--ranks 2] [--steps 8]
    python3 scripts/gpu/hf_trainer_check.py --rank-of FAMILY MODE   # one rank (the driver starts these)
"""

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

# The family's mix of batch kinds (hf_calls_check.py's kinds), from docs/MIXES.md.
MIXES = {
    "qwen2_5_vl": {"text": 0.50, "image": 0.36, "images": 0.04, "video": 0.06, "image+video": 0.04},  # Qwen2.5-VL SFT
    "llava": {"text": 0.238, "image": 0.762},  # Cambrian-7M
    "gemma3": {"text": 0.238, "image": 0.70, "images": 0.062},  # Cambrian-7M, a few multi-image
    "qwen2_audio": {"text": 0.5, "audio": 0.5},  # VITA-1.5: about half the questions spoken
}
DECODER_LAYER = {"qwen2_5_vl": "Qwen2_5_VLDecoderLayer", "llava": "LlamaDecoderLayer",
                 "gemma3": "Gemma3DecoderLayer", "qwen2_audio": "Qwen2DecoderLayer"}
# Where accelerate's default (the model's _no_split_modules) cannot be used: LLaVA's and Gemma 3's
# name text-side classes of CLIP and SigLIP (CLIPTextEmbeddings, SiglipTextEmbeddings) that the
# vision-only towers do not have, and accelerate refuses them ("Could not find the transformer layer
# class ...", stock as well, seen on the GPU machine). Their users list the classes, as here: the
# decoder's layers and the tower's, per layer.
LISTED_LAYERS = {"llava": ["LlamaDecoderLayer", "CLIPEncoderLayer"],
                 "gemma3": ["Gemma3DecoderLayer", "SiglipEncoderLayer"]}


def rank_main(family: str, mode: str, steps: int, out: Path) -> None:
    import torch
    import transformers as tf

    import hf_calls_check as calls

    cls_name, make_config, make_batch, _ = calls.FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(tf, cls_name)(make_config(tf))
    for path in calls.frozen(family):
        model.get_submodule(path).requires_grad_(False)
    if mode.endswith("-lora"):  # LoRA adapters on the decoder's attention (peft freezes the rest).
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    rng = random.Random(1)
    mix = MIXES[family]
    kinds = rng.choices(list(mix), weights=list(mix.values()), k=64)
    torch.manual_seed(1)
    data = [make_batch(kind, model) for kind in kinds]
    fsdp_config = {"fsdp_version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}
    if mode.startswith("reference"):
        fsdp_config["transformer_layer_cls_to_wrap"] = [DECODER_LAYER[family]]
    elif family in LISTED_LAYERS:
        fsdp_config["transformer_layer_cls_to_wrap"] = LISTED_LAYERS[family]
    args = tf.TrainingArguments(
        output_dir=str(out / f"{family}-{mode}"), max_steps=steps, per_device_train_batch_size=1,
        gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
        fsdp="full_shard", fsdp_config=fsdp_config, ddp_backend="gloo", remove_unused_columns=False,
        dataloader_num_workers=0, seed=0)
    trainer = tf.Trainer(model=model, args=args, train_dataset=data, data_collator=lambda features: features[0])
    if mode.startswith("shardcoord"):
        import shardcoord.hf
        trainer = shardcoord.hf.patch(trainer)  # The one line a user adds.
    units = []
    start = time.monotonic()
    trainer.train()
    for name, m in trainer.model.named_modules():
        # Under peft the tower is base_model.model.model.visual: matched as a dotted part of the name.
        if type(m).__name__.startswith("FSDP") and any(f".{p.split('.', 1)[1]}." in f".{name}." or
                                                       f".{p}." in f".{name}."
                                                       for p in calls.frozen(family)):
            units.append(name)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    result = {"family": family, "mode": mode, "rank": int(os.environ["RANK"]), "losses": losses,
              "seconds": round(time.monotonic() - start, 1), "tower_units": len(units),
              "decisions": dict(getattr(trainer, "shardcoord_decisions", {})),
              "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if torch.cuda.is_available() else 0}
    print("RESULT " + json.dumps(result), flush=True)


def _close(a: str, b: str, rtol: float) -> bool:
    """Two printed loss lists ("[0.1, 0.2]") equal within ``rtol``, same length."""
    x, y = json.loads(a), json.loads(b)
    return len(x) == len(y) > 0 and all(abs(p - q) <= rtol * max(abs(q), 1e-12) for p, q in zip(x, y))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(name: str, argv: list, ranks: int, out: Path, env: dict, lightning: bool = False) -> list:
    """``ranks`` processes of ``argv`` sharing the one GPU (each LOCAL_RANK 0), logs in out/NAME-rankR.log."""
    port = free_port()
    procs = []
    for r in range(ranks):
        log = open(out / f"{name}-rank{r}.log", "w")
        e = dict(env, RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), SHARDCOORD_JOB=f"{name}-{port}", PYTHONUNBUFFERED="1")
        if lightning:  # Lightning's own environment: one device per "node", NODE_RANK the rank.
            e.update(NODE_RANK=str(r))
        procs.append((subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT, env=e,
                                       start_new_session=True), log))
    return procs


def rank_argv(family: str, mode: str, steps: int, out: Path) -> list:
    return [__file__, "--rank-of", family, mode, "--steps", str(steps), "--out", str(out)]


def stock_copy(example: Path, out: Path) -> Path:
    """The example without its lines marked ``# shardcoord``: the stock script (printed as a diff)."""
    lines = example.read_text().splitlines(keepends=True)
    kept = [l for l in lines if "  # shardcoord" not in l]
    removed = [l.rstrip() for l in lines if "  # shardcoord" in l]
    print(f"{example.name}: {len(removed)} line(s) differ from the stock script: {removed}", flush=True)
    copy = example.parent / f"stock_{example.name}"
    copy.write_text("".join(kept))
    return copy


def finish(procs: list, deadline: float) -> list:
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            codes.append("hung")
        log.close()
    return codes


def log_lines(out: Path, name: str, rank: int) -> list:
    return (out / f"{name}-rank{rank}.log").read_text(errors="replace").splitlines()


def results(out: Path, family: str, mode: str, ranks: int) -> list:
    return [json.loads(line[7:]) for r in range(ranks) for line in log_lines(out, f"{family}-{mode}", r)
            if line.startswith("RESULT ")]


def tail(out: Path, family: str, mode: str, rank: int, n: int = 3) -> str:
    lines = [l for l in log_lines(out, f"{family}-{mode}" if mode else family, rank) if l.strip()]
    return " | ".join(lines[-n:])[-400:]


def prefixed(out: Path, name: str, prefix: str) -> str:
    """The last line of rank 0's log starting with ``prefix`` (the examples print losses and decisions)."""
    found = [l for l in log_lines(out, name, 0) if l.startswith(prefix)]
    return found[-1][len(prefix):].strip() if found else ""


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every GPU check of this kind takes (this one and trainable_tower_check.py)."""
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=240, help="seconds for a run that must complete")
    parser.add_argument("--hang-timeout", type=float, default=90, help="seconds before a stock run counts as hung")
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", action="append", choices=sorted(MIXES))
    add_run_arguments(parser)
    parser.add_argument("--examples", action="store_true",
                        help="also run examples/python/hf_trainer_vlm.py and lightning_vlm.py, with and without "
                             "their lines marked '# shardcoord'")
    parser.add_argument("--rank-of", nargs=2, metavar=("FAMILY", "MODE"))
    args = parser.parse_args()
    out = Path(args.out)
    if args.rank_of:
        rank_main(*args.rank_of, args.steps, out)
        return 0
    families = args.family or sorted(MIXES)
    env = dict(os.environ)
    runs = {}
    # Every run at once (one GPU, 16 cores: they are small); the stock runs are expected to hang.
    for family in families:
        for mode in ("shardcoord", "reference", "stock"):
            runs[(family, mode)] = launch(f"{family}-{mode}", rank_argv(family, mode, args.steps, out), args.ranks,
                                          out, env)
    if "qwen2_5_vl" in families:  # LoRA (peft) on the decoder, the tower frozen: with and without shardcoord.
        for mode in ("shardcoord-lora", "reference-lora"):
            runs[("qwen2_5_vl", mode)] = launch(f"qwen2_5_vl-{mode}", rank_argv("qwen2_5_vl", mode, args.steps, out),
                                                args.ranks, out, env)
    examples = ROOT / "examples" / "python"
    if args.examples:
        steps = ["--steps", str(args.steps)]
        hf_example, pl_example = examples / "hf_trainer_vlm.py", examples / "lightning_vlm.py"
        hf_stock, pl_stock = stock_copy(hf_example, out), stock_copy(pl_example, out)
        gloo_hf = ["--ddp-backend", "gloo"] + steps
        gloo_pl = ["--process-group-backend", "gloo", "--devices", "1", "--num-nodes", str(args.ranks)] + steps
        for name, argv, lightning in (
                ("example-hf-shardcoord", [str(hf_example)] + gloo_hf, False),
                ("example-hf-reference", [str(hf_stock), "--wrap", "decoder"] + gloo_hf, False),
                ("example-hf-stock", [str(hf_stock)] + gloo_hf, False),
                ("example-lightning-shardcoord", [str(pl_example)] + gloo_pl, True),
                ("example-lightning-reference", [str(pl_stock), "--wrap", "decoder"] + gloo_pl, True),
                ("example-lightning-stock", [str(pl_stock)] + gloo_pl, True)):
            runs[(name, "")] = launch(name, argv, args.ranks, out, env, lightning)
    start = time.monotonic()
    codes = {key: finish(procs, start + (args.hang_timeout if "stock" in key[0] + key[1] else args.timeout))
             for key, procs in runs.items()}
    failures, table = [], []
    for family in families:
        sc, ref = results(out, family, "shardcoord", args.ranks), results(out, family, "reference", args.ranks)
        c_sc, c_ref, c_stock = codes[(family, "shardcoord")], codes[(family, "reference")], codes[(family, "stock")]
        row = {"family": family, "ranks": args.ranks, "exit_shardcoord": c_sc, "exit_reference": c_ref,
               "exit_stock": c_stock, "stock_tail": tail(out, family, "stock", 0)}
        if c_sc != [0] * args.ranks or len(sc) != args.ranks:
            failures.append(f"{family}: shardcoord run exited {c_sc}: {tail(out, family, 'shardcoord', 0)}")
        if c_ref != [0] * args.ranks or len(ref) != args.ranks:
            failures.append(f"{family}: reference run exited {c_ref}: {tail(out, family, 'reference', 0)}")
        if sc and ref:
            a, b = sc[0]["losses"], ref[0]["losses"]
            worst = max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=float("inf"))
            row.update(losses_shardcoord=a, losses_reference=b, worst_rel_diff=worst,
                       decisions=sc[0]["decisions"], tower_units=sc[0]["tower_units"],
                       peak_mib_shardcoord=[r["peak_mib"] for r in sc], peak_mib_reference=[r["peak_mib"] for r in ref])
            if len(a) != args.steps or len(a) != len(b) or worst > args.rtol:
                failures.append(f"{family}: losses differ from the reference (worst relative {worst:.2e}): {a} vs {b}")
            if not sc[0]["decisions"].get("per_layer") or len(sc[0]["decisions"]) < 2:
                failures.append(f"{family}: decisions {sc[0]['decisions']}: want per_layer and another kind")
            if not sc[0]["tower_units"]:
                failures.append(f"{family}: the tower has no FSDP units of its own: not sharded per layer")
        if c_stock == [0] * args.ranks:
            failures.append(f"{family}: the stock run (per-layer tower, mixed media) completed: nothing shown")
        table.append(row)
        print(f"{family:12s} shardcoord {c_sc} reference {c_ref} stock {c_stock}; decisions "
              f"{row.get('decisions')}; tower units {row.get('tower_units')}; worst loss diff "
              f"{row.get('worst_rel_diff', float('nan')):.2e}; peak MiB {row.get('peak_mib_shardcoord')} vs "
              f"{row.get('peak_mib_reference')}", flush=True)
        print(f"{'':12s} losses {row.get('losses_shardcoord')}", flush=True)
        print(f"{'':12s} stock: {row['stock_tail']}", flush=True)
    if ("qwen2_5_vl", "shardcoord-lora") in runs:
        sc, ref = results(out, "qwen2_5_vl", "shardcoord-lora", args.ranks), \
            results(out, "qwen2_5_vl", "reference-lora", args.ranks)
        c_sc, c_ref = codes[("qwen2_5_vl", "shardcoord-lora")], codes[("qwen2_5_vl", "reference-lora")]
        a, b = (sc[0]["losses"] if sc else []), (ref[0]["losses"] if ref else [])
        worst = max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=float("inf"))
        print(f"qwen2_5_vl + LoRA shardcoord {c_sc} reference {c_ref}; decisions {sc[0]['decisions'] if sc else None}; "
              f"worst loss diff {worst:.2e}", flush=True)
        table.append({"family": "qwen2_5_vl+lora", "exit_shardcoord": c_sc, "exit_reference": c_ref, "losses_shardcoord": a,
                      "losses_reference": b, "worst_rel_diff": worst, "decisions": sc[0]["decisions"] if sc else None})
        if c_sc != [0] * args.ranks or c_ref != [0] * args.ranks or not a or len(a) != len(b) or worst > args.rtol:
            failures.append(f"qwen2_5_vl + LoRA: exits {c_sc} / {c_ref}, losses {a} vs {b}: "
                            f"{tail(out, 'qwen2_5_vl', 'shardcoord-lora', 0)}")
    for kind in ("hf", "lightning") if args.examples else ():
        sc, ref, stock = (f"example-{kind}-{m}" for m in ("shardcoord", "reference", "stock"))
        c_sc, c_ref, c_stock = codes[(sc, "")], codes[(ref, "")], codes[(stock, "")]
        losses_sc, losses_ref = prefixed(out, sc, "losses") or prefixed(out, sc, "rank 0 losses"), \
            prefixed(out, ref, "losses") or prefixed(out, ref, "rank 0 losses")
        decisions = prefixed(out, sc, "decisions")
        print(f"example {kind:9s} shardcoord {c_sc} reference {c_ref} stock {c_stock}; decisions {decisions}", flush=True)
        print(f"{'':17s} losses {losses_sc} vs reference {losses_ref}", flush=True)
        print(f"{'':17s} stock: {tail(out, stock, '', 0)}", flush=True)
        row = {"example": kind, "exit_shardcoord": c_sc, "exit_reference": c_ref, "exit_stock": c_stock,
               "losses_shardcoord": losses_sc, "losses_reference": losses_ref, "decisions": decisions,
               "stock_tail": tail(out, stock, "", 0)}
        table.append(row)
        if c_sc != [0] * args.ranks or c_ref != [0] * args.ranks:
            failures.append(f"example {kind}: exits shardcoord {c_sc}, reference {c_ref}: {tail(out, sc, '', 0)}")
        elif not losses_sc or not _close(losses_sc, losses_ref, args.rtol):
            failures.append(f"example {kind}: losses {losses_sc} differ from the reference's {losses_ref}")
        if "per_layer" not in decisions:
            failures.append(f"example {kind}: decisions {decisions!r}: want per_layer among them")
        if c_stock == [0] * args.ranks:
            failures.append(f"example {kind}: the stock run completed: nothing shown")
    (out / "hf_trainer_check.json").write_text(json.dumps(table, indent=1))
    for f in failures:
        print("FAIL " + f, flush=True)
    print(f"== hf_trainer_check: {'all passed' if not failures else f'{len(failures)} FAILED'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
