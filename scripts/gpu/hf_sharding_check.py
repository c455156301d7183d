#!/usr/bin/env python3
"""Real Hugging Face VLMs sharded per layer by shardcoord (transformers 5.x, torch >= 2.6; run on the
GPU machine by scripts/gpu/run_hf_test.sh). The families, configs and batches are those of
hf_calls_check.py: the real ``<X>ForConditionalGeneration`` classes, built from tiny configs.

Part 1, "ranks" (2 processes, Gloo on CPU tensors: it runs whether one GPU or none is lent). For
each family, both ranks build the same model, freeze the tower and projector, and take
``shardcoord.torch.manifest(model)`` with no ``layer_lists``: the tower must come out as its rest
unit "" plus its layers. Then one microbatch under each decision (per_layer with both ranks'
media, twice-called where a batch holds images and videos; root and replicate with media on rank 0
only; skip with text only):
  - ``shardcoord.torch.Executor``: logits bitwise those of the unsharded model on the same batch,
    and the same all-gathers (module, unit) in the same order on both ranks;
  - ``shardcoord.fsdp2``: the loss equal to the unsharded model's, and the same number of FSDP
    all-gathers per microbatch on both ranks (with equal-sized units a mismatch can complete
    silently, so "it did not hang" is not enough).
Part 2, "memory" (one GPU, NCCL, world of 1, bf16): a LLaVA whose CLIP tower is scaled up, a
Qwen2.5-VL whose tower is, and Gemma 3, Idefics3, InternVL, Mllama and Qwen2-Audio with their towers
widened to 1024 and deepened to 24 layers, under FSDP2: the peak of CUDA memory above the resident shards during
a microbatch's forward, per decision, against the tower in the root unit (the one-unit tower the
manifest had to make before rest units existed). per_layer must stay far below root.

    python scripts/gpu/hf_sharding_check.py [ranks] [memory] [--family NAME ...]
"""

import argparse
import copy
import datetime
import gc
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hf_calls_check as calls  # noqa: E402  (families, configs, batches)


def media_kinds(kinds):
    media = [k for k in kinds if k not in ("text", "decode_step", "inputs_embeds", "cross_attention_states",
                                           "empty_images", "padding_only")]
    both = "image+video" if "image+video" in kinds else media[0]
    return media[0], both


def decision(specs, kind):
    return SimpleNamespace(modules={s.name: SimpleNamespace(decision=kind) for s in specs}, step=0, microbatch=0)


def bits(t):
    import torch
    return t.detach().float().contiguous().view(torch.uint8).numpy().tobytes()


def rank_family(name, rank, counter):
    import torch
    import torch.distributed as dist
    import transformers as tf

    import shardcoord.torch as sct
    from shardcoord import fsdp2

    cls_name, make_config, make_batch, kinds = calls.FAMILIES[name]
    cls = getattr(tf, cls_name, None)
    if cls is None:
        return f"skip {name}: this transformers has no {cls_name}"
    media, both = media_kinds(kinds)
    plan = [("per_layer", both, both), ("root", media, "text"), ("replicate", media, "text"),
            ("skip", "text", "text"), ("per_layer", media, media)]

    def build():
        torch.manual_seed(0)
        model = cls(make_config(tf)).eval()
        for p in calls.frozen(name):
            model.get_submodule(p).requires_grad_(False)
        return model

    def batch_for(i, kinds_pair, model):
        torch.manual_seed(1000 * i + rank)
        return make_batch(kinds_pair[rank], model)

    # -- the plain executor
    model = build()
    reference = copy.deepcopy(model)
    specs = sct.manifest(model)
    tower = next(s for s in specs if s.name == calls.frozen(name)[0])
    units = [u.name for u in tower.units]
    assert units[0] == "" and len(units) >= 3, f"{name}: the tower's units are {units}"
    batches = [batch_for(i, (k0, k1), reference) for i, (_, k0, k1) in enumerate(plan)]
    ex = sct.Executor(model, specs)
    log, original = [], ex._materialize

    def logged(mod, unit):
        if unit.full is None:
            log.append((mod.spec.name, unit.name))
        return original(mod, unit)

    ex._materialize = logged
    logs = []
    for (kind, _, _), batch in zip(plan, batches):
        print(f"  rank {rank} {name} executor {kind}", file=sys.stderr, flush=True)
        log.clear()
        ex.begin_microbatch({s.name: kind for s in specs})
        out = model(**batch).logits
        ex.end_microbatch()
        expected = reference(**batch).logits
        assert bits(out) == bits(expected), f"{name} {kind}: the executor's logits differ from the unsharded model's"
        logs.append(list(log))
    everyone = [None, None]
    dist.all_gather_object(everyone, logs)
    assert everyone[0] == everyone[1], f"{name}: the ranks gathered differently: {everyone}"
    assert logs[0][0] == (tower.name, ""), f"{name}: per_layer did not gather the rest unit first: {logs[0][:3]}"
    executor_line = (f"executor: {len(units) - 1} layer units + rest unit {tower.units[0].param_bytes} B, "
                     f"{len(logs[0])} gathers in the first per_layer microbatch, identical on both ranks")

    # -- FSDP2
    if not fsdp2.available():
        return f"ok {name}: {executor_line}; fsdp2: skipped (torch < 2.6)"
    model = build()
    specs = sct.manifest(model)
    ctl = fsdp2.shard(model, specs)
    gathers, losses, with_grad = [], [], []
    for (kind, _, _), batch in zip(plan, batches):
        print(f"  rank {rank} {name} fsdp2 {kind}", file=sys.stderr, flush=True)
        before = counter["n"]
        ctl.begin_microbatch(decision(specs, kind))
        loss = model(**batch).loss
        loss.backward()
        ctl.end_microbatch()
        gathers.append(counter["n"] - before)
        # Which trainable parameters hold a gradient (FSDP2 reduce-scatters only those): the same
        # set on both ranks, or the next reduce-scatter mismatches (fsdp2's fill_missing_grads).
        with_grad.append(sorted(n for n, p in model.named_parameters() if p.grad is not None))
        with torch.no_grad():
            expected = reference(**batch).loss
        losses.append((float(loss), float(expected)))
        close = torch.allclose(loss.detach(), expected, rtol=1e-5, atol=1e-6)
        assert close, f"{name} {kind}: FSDP2 loss {float(loss)} vs unsharded {float(expected)}"
    everyone = [None, None]
    dist.all_gather_object(everyone, gathers)
    assert everyone[0] == everyone[1], f"{name}: FSDP2 all-gathers per microbatch differ: {everyone}"
    everyone = [None, None]
    dist.all_gather_object(everyone, with_grad)
    assert everyone[0] == everyone[1], f"{name}: the parameters with a gradient differ between ranks: {everyone}"
    assert with_grad[-1], f"{name}: no trainable parameter has a gradient after five backwards"
    exact = sum(a == b for a, b in losses)
    return (f"ok {name}: {executor_line}; fsdp2: all-gathers per microbatch {gathers} on both ranks, losses equal "
            f"the unsharded model's ({exact} of {len(losses)} bitwise, all within 1e-5)")


def rank_main(rank, families, store, queue):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(4)
    results = []
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=30))
        sys.path.insert(0, str(HERE.parents[1] / "tests/gpu"))
        from fsdp2_check import count_all_gathers  # The same counter as the FSDP2 scenarios.
        counter = count_all_gathers()
        for name in families:
            try:
                results.append(rank_family(name, rank, counter))
            except Exception as e:  # noqa: BLE001 -- reported by the parent
                results.append(f"FAIL {name}: {type(e).__name__}: {str(e)[:600]}")
                traceback.print_exc()
                break  # The ranks may now disagree on what comes next: stop here.
            if rank == 0:
                print(results[-1], flush=True)
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001
        results.append(f"FAIL: {type(e).__name__}: {e}")
    queue.put((rank, results))


def part_ranks(families, timeout_s=300):
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=rank_main, args=(r, families, f"{tmp}/store", queue)) for r in range(2)]
        for p in procs:
            p.start()
        got, deadline = {}, time.monotonic() + timeout_s
        for _ in procs:
            try:
                rank, results = queue.get(timeout=max(1.0, deadline - time.monotonic()))
                got[rank] = results
            except Exception:
                break
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    if len(got) < 2:
        print(f"FAIL ranks: a rank did not report within {timeout_s} s (hung): {got}")
        return False
    ok = True
    for line in got[0]:
        print(("  " if line.startswith("ok") or line.startswith("skip") else "") + line, flush=True)
        ok &= not line.startswith("FAIL")
    ok &= all(not line.startswith("FAIL") for line in got[1]) and len(got[0]) == len(families)
    if any(line.startswith("FAIL") for line in got[1]):
        print("rank 1:", [line for line in got[1] if line.startswith("FAIL")])
    return ok


# -- Part 2: memory on one GPU

def scaled(family, width=1024, depth=24, heads=16):
    """A family's tiny config with its tower (vision or audio) widened to ``width`` (feed-forward
    4x), deepened to ``depth`` layers with ``heads`` heads, whatever the config names those sizes;
    the batch makers do not depend on them."""
    def make(tf):
        cls_name, make_config, make_batch, kinds = calls.FAMILIES[family]
        cfg = make_config(tf)
        tower = getattr(cfg, "vision_config", None) or cfg.audio_config
        for names, value in ((("hidden_size", "d_model"), width), (("intermediate_size", "encoder_ffn_dim"), 4 * width),
                             (("num_hidden_layers", "encoder_layers", "depth"), depth),
                             (("num_attention_heads", "attention_heads", "encoder_attention_heads", "num_heads"), heads)):
            for attr in names:
                if hasattr(tower, attr):
                    setattr(tower, attr, value)
        if hasattr(tower, "vision_output_dim"):  # Mllama: the layer outputs it concatenates.
            tower.vision_output_dim = width * (len(tower.intermediate_layers_indices) + 1)
        return getattr(tf, cls_name), cfg, make_batch, media_kinds(kinds)[0]
    make.__name__ = f"scaled_{family}"
    make.family = family
    return make


def part_memory():
    import torch
    import torch.distributed as dist
    import transformers as tf

    import shardcoord.torch as sct
    from shardcoord import fsdp2
    if not torch.cuda.is_available() or not fsdp2.available():
        print("skip memory: needs a GPU and torch >= 2.6")
        return True
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    ok = True
    print("family            tower params  rest params  placement                 peak above shards (MiB)")
    makes = [scaled("qwen2_5_vl", width=1280), scaled("llava", width=2048)]  # Wider, as measured first.
    makes += [scaled(f) for f in ("gemma3", "idefics3", "internvl", "mllama", "qwen2_audio")]
    for make in makes:
        try:
            cls, cfg, make_batch, kind = make(tf)
        except Exception as e:  # noqa: BLE001
            print(f"skip {make.__name__}: {type(e).__name__}: {e}")
            continue
        name = make.__name__
        peaks = {}
        try:
            measure_family(name, cls, cfg, make_batch, kind, peaks, make.family)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            print(f"FAIL memory {name}: {type(e).__name__}: {str(e)[:300]}")
            ok = False
            continue
        if peaks.get("per_layer", 1e9) >= 0.5 * peaks.get("root", 0):
            print(f"FAIL memory {name}: per_layer's peak is not far below root's: {peaks}")
            ok = False
    dist.destroy_process_group()
    return ok


def measure_family(name, cls, cfg, make_batch, kind, peaks, family):
    import torch

    import shardcoord.torch as sct
    from shardcoord import fsdp2
    for placement in ("per_layer", "root", "replicate", "one_unit_tower_in_root"):
        # The previous placement's model is garbage in reference cycles (FSDP's hooks): collected
        # now, not in the middle of this measurement (where freeing it lowered one root peak to
        # 72 MiB in a run of Qwen2-Audio, whose tower alone is 583 MiB).
        gc.collect()
        torch.cuda.empty_cache()
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):  # Initialized on the GPU: seconds, not minutes on the CPU.
            model = cls(cfg)
        torch.set_default_dtype(torch.float32)
        tower_path = calls.frozen(family)[0]
        model.get_submodule(tower_path).requires_grad_(False)
        layer_lists = {tower_path: ""} if placement == "one_unit_tower_in_root" else None
        specs = [s for s in sct.manifest(model, layer_lists=layer_lists) if s.name == tower_path]
        tower = specs[0]
        ctl = fsdp2.shard(model, specs)
        torch.manual_seed(1)
        batch = calls.to_device(make_batch(kind, model), "cuda")
        batch = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in batch.items()}
        kind_of = "root" if placement == "one_unit_tower_in_root" else placement
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ctl.begin_microbatch(decision(specs, kind_of))
        with torch.no_grad():
            model(**batch)
        ctl.end_microbatch()
        torch.cuda.synchronize()
        peaks[placement] = (torch.cuda.max_memory_allocated() - base) / 2**20
        rest = tower.units[0].param_bytes // 2 if tower.units[0].name == "" else 0
        print(f"{name:17s} {tower.param_bytes // 2 / 1e6:9.1f} M  {rest / 1e6:9.2f} M  {placement:24s} "
              f"{peaks[placement]:10.1f}", flush=True)
        del ctl, model, batch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="*", default=["ranks", "memory"])
    ap.add_argument("--family", action="append", choices=sorted(calls.FAMILIES))
    args = ap.parse_args()
    import torch
    try:
        import transformers as tf
    except ImportError:
        print("SKIP: transformers is not installed")
        return 0
    print(f"transformers {tf.__version__}, torch {torch.__version__}, {torch.cuda.device_count()} GPUs", flush=True)
    ok = True
    if "ranks" in args.parts:
        print("== 2 ranks, Gloo on CPU: manifest, executor and FSDP2 on the real classes", flush=True)
        ok &= part_ranks(args.family or sorted(calls.FAMILIES))
    if "memory" in args.parts:
        print("== one GPU, FSDP2, bf16: peak memory per placement", flush=True)
        ok &= part_memory()
    print("hf sharding check:", "all passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
