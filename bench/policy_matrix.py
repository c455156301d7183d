#!/usr/bin/env python3
"""policy_matrix: what each placement of a frozen vision tower costs under FSDP2, per data mix.

A VLM with random bf16 weights (a frozen ViT-like tower, a frozen projector, a trainable decoder)
is trained data-parallel with FSDP2 on --gpus GPUs (default 2, NCCL), in shard groups of
--group-size (default: all; smaller groups shard within the group and replicate across groups:
HSDP). The same model and processes run every cell (data mix x placement) in turn:

  placements  root                 every rank gathers the whole tower before each microbatch (static)
              replicate            a full copy of the tower on every rank, made once (static)
              per_layer            FSDP per-layer units; only where every rank agrees (uniform mixes)
              per_layer_dummy      per_layer, ranks without images run the tower on a 1-token dummy
              per_layer_allreduce  an in-band all-reduce(MAX) of "has images" before each
                                   microbatch: per_layer / skip when the ranks agree, root otherwise
              sc_per_layer         shardcoord, policy per_layer, fallback root
              sc_auto              shardcoord, policy auto (promotion to replicate allowed)
  mixes       all, none, random50 (per rank and microbatch), skewed (even ranks 90 %, odd ranks
              10 %), alternating (every rank has images on even steps)

Per cell: tokens/s over all ranks (median of the measured steps, min, max), peak GPU memory
(max over ranks), GiB all-gathered per step, and for shardcoord the decisions that were not
ready when the trainer asked (a wait > 1 ms). Every run is bounded.

    python bench/policy_matrix.py --shardcoordd PATH [--gpus N] [--group-size G] [--quick] [--mixes ...]
                                  [--placements ...]

Run by scripts/gpu/run_policy_matrix.sh (which builds the binding on the GPU machine).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

MIXES = ["all", "none", "random50", "skewed", "alternating"]
UNIFORM_MIXES = {"all", "none", "alternating"}
PLACEMENTS = ["root", "replicate", "per_layer", "per_layer_dummy", "per_layer_allreduce", "sc_per_layer", "sc_auto"]


@dataclass
class Config:
    vit_layers: int = 32
    vit_hidden: int = 1280
    vit_heads: int = 16
    vit_mlp: int = 5120
    patch_dim: int = 588  # 14 x 14 x 3
    image_tokens: int = 576
    dec_layers: int = 20
    dec_hidden: int = 2048
    dec_heads: int = 16
    dec_mlp: int = 8192
    vocab: int = 32000
    text_tokens: int = 1024
    accum: int = 4
    steps: int = 20
    warmup: int = 3


QUICK = Config(vit_layers=4, vit_hidden=256, vit_heads=4, vit_mlp=1024, image_tokens=64, dec_layers=2, dec_hidden=256,
               dec_heads=4, dec_mlp=1024, vocab=1000, text_tokens=128, steps=3, warmup=1)


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


# ---------------------------------------------------------------------------------------------
# The model (built in rank processes only: torch is imported there)

def build_model(cfg: Config, device):
    import torch
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

    class VisionTower(nn.Module):  # Qwen-VL style names: visual.patch_embed, visual.blocks
        def __init__(self):
            super().__init__()
            self.patch_embed = nn.Linear(cfg.patch_dim, cfg.vit_hidden)
            self.blocks = nn.ModuleList([Block(cfg.vit_hidden, cfg.vit_heads, cfg.vit_mlp, False)
                                         for _ in range(cfg.vit_layers)])

        def forward(self, pixels):
            x = self.patch_embed(pixels)
            for blk in self.blocks:
                x = blk(x)
            return x

    class Vlm(nn.Module):
        def __init__(self):
            super().__init__()
            self.visual = VisionTower()
            self.multi_modal_projector = nn.Sequential(nn.Linear(cfg.vit_hidden, cfg.dec_hidden), nn.GELU(),
                                                       nn.Linear(cfg.dec_hidden, cfg.dec_hidden))
            self.embed_tokens = nn.Embedding(cfg.vocab, cfg.dec_hidden)
            self.layers = nn.ModuleList([Block(cfg.dec_hidden, cfg.dec_heads, cfg.dec_mlp, True)
                                         for _ in range(cfg.dec_layers)])
            self.norm = nn.LayerNorm(cfg.dec_hidden)
            self.lm_head = nn.Linear(cfg.dec_hidden, cfg.vocab, bias=False)

        def forward(self, tokens, labels, pixels=None, dummy=False):
            x = self.embed_tokens(tokens)
            if pixels is not None:
                with torch.no_grad():  # Frozen tower and projector: no graph, no backward collectives.
                    img = self.multi_modal_projector(self.visual(pixels))
                if not dummy:
                    x = torch.cat([img, x], dim=1)
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


# ---------------------------------------------------------------------------------------------
# One rank

class Counters:
    def __init__(self):
        self.gathered_bytes = 0


def count_all_gathers(counters: Counters):
    """Counts the bytes of every all_gather_into_tensor output (FSDP2's unit gathers) and of the
    gathers that make a replica (DTensor.full_tensor)."""
    import torch.distributed as dist
    from shardcoord import fsdp2

    original = dist.all_gather_into_tensor

    def counted(output_tensor, input_tensor, *a, **k):
        counters.gathered_bytes += output_tensor.numel() * output_tensor.element_size()
        return original(output_tensor, input_tensor, *a, **k)

    dist.all_gather_into_tensor = counted
    materialize = fsdp2._materialize

    def counted_materialize(c):
        replica = materialize(c)
        counters.gathered_bytes += sum(p.numel() * p.element_size() for p in replica.parameters())
        return replica

    fsdp2._materialize = counted_materialize


def rank_main(args) -> int:
    import torch
    import torch.distributed as dist

    import shardcoord
    import shardcoord.torch as sct
    from shardcoord import fsdp2

    cfg = QUICK if args.quick else Config()
    if args.steps > 0:
        cfg.steps = args.steps
    if args.warmup >= 0:
        cfg.warmup = args.warmup
    rank = int(os.environ["RANK"])
    world, group_size = args.gpus, args.group_size or args.gpus
    cuda = torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=args.init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.collective_timeout))
    mesh = shard_pg = None
    if group_size < world:  # HSDP: shard within a group of group_size, replicate across groups.
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device.type, (world // group_size, group_size), mesh_dim_names=("replicate", "shard"))
        shard_pg = mesh.get_group("shard")
    counters = Counters()
    count_all_gathers(counters)
    model = build_model(cfg, device)
    tower_bytes = sum(p.numel() * p.element_size() for p in model.visual.parameters())
    units = tuple(shardcoord.LayerUnit(f"blocks.{i}", sum(p.numel() * p.element_size() for p in b.parameters()))
                  for i, b in enumerate(model.visual.blocks))
    specs = [shardcoord.ModuleSpec("visual", tower_bytes, units)]
    for layer in model.layers:
        fsdp2.fully_shard(layer, mesh=mesh)
    ctl = fsdp2.shard(model, specs, mesh=mesh)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print("INFO " + json.dumps({
            "torch": torch.__version__, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "gpus": world, "group_size": group_size,
            "tower_params": sum(p.numel() for p in model.visual.parameters()), "total_params": params,  # DTensor.numel() is the global count
            "config": asdict(cfg)}), flush=True)

    def batch(step, mb, images):
        g = torch.Generator(device=device).manual_seed(rank * 1_000_003 + step * 101 + mb)
        tokens = torch.randint(cfg.vocab, (1, cfg.text_tokens), device=device, generator=g)
        labels = torch.randint(cfg.vocab, (1, cfg.text_tokens), device=device, generator=g)
        pixels = torch.randn(1, cfg.image_tokens if images else 1, cfg.patch_dim, device=device, generator=g,
                             dtype=torch.bfloat16)
        return tokens, labels, pixels

    def local(kind, step, mb):
        return shardcoord.Decision(0, step, mb, 0, 0, 0, {"visual": shardcoord.ModuleDecision(kind, "static")})

    flags = torch.zeros(2, dtype=torch.int32, device=device)

    def in_band(images, step, mb):  # One all-reduce(MAX) of (has images, has none) per microbatch.
        flags[0], flags[1] = int(images), int(not images)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=shard_pg)  # Over the shard group.
        any_images, any_without = flags.tolist()
        kind = "root" if any_images and any_without else ("per_layer" if any_images else "skip")
        return local(kind, step, mb)

    run_id = args.run_id  # The same on every rank: one shardcoord job per cell.
    total_steps = cfg.warmup + cfg.steps
    for mix in args.mixes:
        for placement in args.placements:
            if placement == "per_layer" and mix not in UNIFORM_MIXES:
                if rank == 0:
                    print("CELL " + json.dumps({"mix": mix, "placement": placement, "skipped": "unsafe: ranks "
                                                "disagree, static per_layer would hang"}), flush=True)
                continue
            worker = plans = None
            if placement.startswith("sc_"):
                policy = placement[3:]
                worker = shardcoord.Worker(f"matrix-{run_id}-{mix}-{placement}", specs, group_size, rank=rank,
                                           world_size=world, address=args.coordinator, policy=policy,
                                           fallback="root", lookahead=4,
                                           memory_budget_bytes=(8 << 30) if policy == "auto" else 0)
                keys = ((i // cfg.accum, i % cfg.accum, has_images(mix, rank, i // cfg.accum, i % cfg.accum))
                        for i in range(total_steps * cfg.accum))
                plans = iter(sct.PlanAhead(worker, keys, lambda images: {"visual": int(images)}, timeout=30))
            ctl.release()
            torch.cuda.synchronize() if cuda else None
            torch.cuda.reset_peak_memory_stats() if cuda else None
            step_s, tokens_per_step, gathered, kinds, stalls, waits = [], [], [], {}, 0, []
            for step in range(total_steps):
                t0 = time.perf_counter()
                g0 = counters.gathered_bytes
                tokens = 0
                for mb in range(cfg.accum):
                    images = has_images(mix, rank, step, mb)
                    if plans is not None:
                        w0 = time.perf_counter()
                        _, _, _, decision = next(plans)
                        waited = time.perf_counter() - w0
                        if step >= cfg.warmup:
                            waits.append(waited)
                            stalls += waited > 1e-3
                    elif placement == "per_layer_allreduce":
                        decision = in_band(images, step, mb)
                    elif placement in ("per_layer", "per_layer_dummy"):
                        decision = local("per_layer" if (images or placement == "per_layer_dummy") else "skip",
                                         step, mb)
                    else:
                        decision = local(placement, step, mb)
                    kind = decision["visual"].decision
                    kinds[kind] = kinds.get(kind, 0) + 1
                    ctl.begin_microbatch(decision)
                    model.set_requires_gradient_sync(mb == cfg.accum - 1)
                    tok, lab, pix = batch(step, mb, images)
                    run_tower = images or placement == "per_layer_dummy"
                    loss = model(tok, lab, pix if run_tower else None, dummy=not images)
                    loss.backward()
                    ctl.end_microbatch()
                    tokens += cfg.text_tokens + (cfg.image_tokens if images else 0)
                optimizer.step()
                optimizer.zero_grad()
                if cuda:
                    torch.cuda.synchronize()
                if step >= cfg.warmup:
                    step_s.append(time.perf_counter() - t0)
                    tokens_per_step.append(tokens)
                    gathered.append(counters.gathered_bytes - g0)
            if worker is not None:
                worker.close()
            # Over all ranks: tokens add up, a step takes the slowest rank's time.
            stats = torch.tensor([sum(tokens_per_step), torch.cuda.max_memory_allocated() if cuda else 0, stalls],
                                 dtype=torch.float64, device=device)
            times = torch.tensor(step_s, dtype=torch.float64, device=device)
            total_tokens = stats[0].clone()
            dist.all_reduce(total_tokens)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            if rank == 0:
                per_step = total_tokens.item() / len(step_s)
                tok_s = [per_step / t for t in times.tolist()]
                print("CELL " + json.dumps({
                    "mix": mix, "placement": placement, "steps": len(step_s),
                    "tok_s_median": round(statistics.median(tok_s)), "tok_s_min": round(min(tok_s)),
                    "tok_s_max": round(max(tok_s)), "step_ms_median": round(1000 * statistics.median(times.tolist()), 1),
                    "peak_gib": round(stats[1].item() / 2**30, 2),
                    "gathered_gib_per_step": round(statistics.mean(gathered) / 2**30, 3),
                    "decisions": kinds, "stalls": int(stats[2].item()) if plans is not None else None,
                    "decision_wait_ms_max": round(1000 * max(waits), 2) if waits else None,
                    "hung": False}), flush=True)
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------
# The launcher

def table(cells, info) -> str:
    out = []
    for mix in dict.fromkeys(c["mix"] for c in cells):
        rows = [c for c in cells if c["mix"] == mix]
        root = next((c for c in rows if c["placement"] == "root" and "tok_s_median" in c), None)
        out.append(f"\nmix `{mix}`\n")
        out.append("| placement | tokens/s median (min-max) | vs root | peak GiB | vs root | all-gathered GiB/step | "
                   "decisions | stalls |")
        out.append("|---|---|---|---|---|---|---|---|")
        for c in rows:
            if "tok_s_median" not in c:
                out.append(f"| {c['placement']} | {c.get('skipped') or ('HUNG' if c.get('hung') else 'not run')} "
                           f"| | | | | | |")
                continue
            dt = f"{100 * (c['tok_s_median'] / root['tok_s_median'] - 1):+.1f} %" if root else "-"
            dm = f"{c['peak_gib'] - root['peak_gib']:+.2f}" if root else "-"
            kinds = " ".join(f"{k}={v}" for k, v in sorted(c["decisions"].items()))
            out.append(f"| {c['placement']} | {c['tok_s_median']} ({c['tok_s_min']}-{c['tok_s_max']}) | {dt} | "
                       f"{c['peak_gib']} | {dm} | {c['gathered_gib_per_step']} | {kinds} | "
                       f"{'-' if c['stalls'] is None else c['stalls']} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shardcoordd", help="the daemon binary (the launcher starts one)")
    ap.add_argument("--gpus", type=int, default=2, help="ranks, one GPU each (default 2)")
    ap.add_argument("--group-size", type=int, default=0, help="shard group size (default: --gpus)")
    ap.add_argument("--quick", action="store_true", help="a tiny model and 3 steps: checks the harness")
    ap.add_argument("--mixes", nargs="+", default=MIXES, choices=MIXES)
    ap.add_argument("--placements", nargs="+", default=PLACEMENTS, choices=PLACEMENTS)
    ap.add_argument("--steps", type=int, default=0, help="measured steps per cell (default 20; --quick 3)")
    ap.add_argument("--warmup", type=int, default=-1, help="steps per cell before measuring (default 3; --quick 1)")
    ap.add_argument("--timeout", type=float, default=540, help="seconds for the whole matrix")
    ap.add_argument("--collective-timeout", type=float, default=120)
    ap.add_argument("--json", help="write the cells here (JSON lines)")
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--init-method", help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", help=argparse.SUPPRESS)
    ap.add_argument("--run-id", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        return rank_main(args)
    if args.steps < 0 or args.timeout <= 0:
        ap.error("--steps must be >= 0 and --timeout > 0")
    if args.gpus < 1 or args.group_size < 0 or args.gpus % (args.group_size or args.gpus):
        ap.error(f"--gpus {args.gpus} must be >= 1 and a multiple of --group-size {args.group_size}")
    if not args.shardcoordd:
        ap.error("--shardcoordd is required")
    cells, info = [], {}
    with tempfile.TemporaryDirectory(prefix="policy_matrix-") as tmp:
        addr_file = os.path.join(tmp, "addr")
        daemon = subprocess.Popen([args.shardcoordd, "--listen", "127.0.0.1:0", "--address-file", addr_file,
                                   "--log-level", "warn"])
        procs = []
        try:
            deadline = time.monotonic() + 20
            while not os.path.exists(addr_file) and time.monotonic() < deadline:
                time.sleep(0.05)
            address = open(addr_file).read().strip()
            child = [sys.executable, os.path.abspath(__file__), "--rank-main", "--init-method", f"file://{tmp}/store",
                     "--coordinator", address, "--run-id", f"{os.getpid()}-{int(time.time())}",
                     "--collective-timeout", str(args.collective_timeout), "--gpus", str(args.gpus),
                     "--group-size", str(args.group_size),
                     "--steps", str(args.steps), "--warmup", str(args.warmup), "--mixes", *args.mixes,
                     "--placements", *args.placements] + (["--quick"] if args.quick else [])
            for r in range(args.gpus):
                env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.gpus))
                procs.append(subprocess.Popen(child, env=env, stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                                              text=True))
            deadline = time.monotonic() + args.timeout

            def read_rank0():
                for line in procs[0].stdout:
                    if line.startswith(("CELL ", "INFO ")):
                        print(line, end="", flush=True)
                        if line.startswith("CELL "):
                            cells.append(json.loads(line[5:]))
                        else:
                            info.update(json.loads(line[5:]))
                    else:
                        print(f"[rank 0] {line}", end="", flush=True)

            reader = threading.Thread(target=read_rank0, daemon=True)
            reader.start()
            while time.monotonic() < deadline and procs[0].poll() is None:
                time.sleep(0.2)
            reader.join(5)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
            daemon.terminate()
            daemon.wait(10)
    done = {(c["mix"], c["placement"]) for c in cells}
    for mix in args.mixes:
        for placement in args.placements:
            if (mix, placement) not in done:
                cells.append({"mix": mix, "placement": placement, "hung": True})
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps({"info": info}) + "\n")
            for c in cells:
                f.write(json.dumps(c) + "\n")
    cells.sort(key=lambda c: (args.mixes.index(c["mix"]), args.placements.index(c["placement"])))
    print(table(cells, info))
    hung = [f"{c['mix']}/{c['placement']}" for c in cells if c.get("hung")]
    print(f"\n{len(cells) - len(hung)} cells measured or skipped, {len(hung)} hung or not run {hung}")
    return 0 if not hung else 1


if __name__ == "__main__":
    sys.exit(main())
