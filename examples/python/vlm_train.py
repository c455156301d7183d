#!/usr/bin/env python3
"""vlm_train: a small Hugging Face style VLM trained data-parallel on CPU (Gloo) whose frozen vision
tower and projector are sharded by ``shardcoord.torch.Executor`` and placed, per microbatch, by the
coordinator's decisions. The Python counterpart of examples/vlm_trainer (C++).

Started like torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/MASTER_PORT), by srun (SLURM_PROCID,
SLURM_NTASKS, SLURM_LOCALID; MASTER_ADDR/MASTER_PORT exported, as deploy/slurm/train.sbatch does) or with flags;
``--nproc N`` launches N ranks locally (a FileStore in a temporary folder: no ports to choose)::

    SHARDCOORD_ADDR=127.0.0.1:7871 python3 examples/python/vlm_train.py --nproc 2 --media mixed
    torchrun --nproc_per_node 2 examples/python/vlm_train.py --coordinator HOST:PORT --group-size 2
    torchrun --nproc_per_node 2 examples/python/vlm_train.py --coordinator HOST:PORT --fsdp2   # GPUs, NCCL

``--fsdp2`` (torch >= 2.6): FSDP2 instead of the plain executor: ``shardcoord.fsdp2.shard`` makes
each layer of the frozen tower its own ``fully_shard`` unit and the model the root unit (the
trainable weights are sharded too; FSDP reduce-scatters their gradients), one GPU per rank with
NCCL (``cuda:$LOCAL_RANK``), or Gloo on CPU when there are fewer GPUs than local ranks. The shard
group is the world. A ``shardcoord.torch.FailureWatch`` aborts the process group once the
coordinator declares a member dead, so no rank stays blocked in an NCCL collective with it.
``--fsdp2 --no-shard`` is its reference: ``fully_shard`` on the model alone, the frozen tower in
the root unit that every rank gathers in every forward.

Model: ``model.visual`` (frozen; a ``blocks`` ModuleList), ``model.multi_modal_projector`` (frozen),
``model.language_model`` (trainable: ``embed_tokens`` and ``layers``) and ``lm_head`` (trainable).
Every rank starts from the same weights (``torch.manual_seed``). Each step accumulates ``--accum``
microbatches; each has images or not (``--media``); plans are reported ahead by
``shardcoord.torch.PlanAhead``; trainable gradients are averaged over the world with an
all-reduce; plain SGD. Prints ``step S loss HEX`` per step (``float.hex``: bitwise comparable),
``final params hash H`` and a summary. ``--no-shard`` trains without the executor (frozen
parameters whole on every rank): the reference for bitwise equality.

Exit codes: 0 ok; 2 usage; 3 a shardcoord error (printed on stderr: the coordinator's reason,
e.g. "rank 1 declared dead"); with ``--nproc``, the first failing rank's code.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardcoord
import shardcoord.torch as sct
from shardcoord import fsdp2

IMAGE_IN, PATCHES, VISION_DIM, VISION_LAYERS = 16, 4, 32, 3
TEXT_IN, HIDDEN, TEXT_LAYERS, CLASSES, BATCH = 12, 24, 2, 5, 4


# -- the model (module names as Hugging Face VLMs, e.g. Qwen2-VL / Llava)

class VisionBlock(nn.Module):
    def __init__(self, dim_in: int, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim_in, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))


class VisionTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([VisionBlock(IMAGE_IN, VISION_DIM)] +
                                    [VisionBlock(VISION_DIM, VISION_DIM) for _ in range(VISION_LAYERS - 1)])

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = pixels
        for block in self.blocks:
            x = block(x)
        return x


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.mlp(x))


class LanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Linear(TEXT_IN, HIDDEN)
        self.layers = nn.ModuleList([DecoderLayer() for _ in range(TEXT_LAYERS)])

    def forward(self, text: torch.Tensor, media: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = torch.relu(self.embed_tokens(text))
        if media is not None:
            x = x + media
        for layer in self.layers:
            x = layer(x)
        return x


class VlmModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = VisionTower()
        self.multi_modal_projector = nn.Linear(VISION_DIM, HIDDEN)
        self.language_model = LanguageModel()

    def forward(self, text: torch.Tensor, pixels: Optional[torch.Tensor] = None) -> torch.Tensor:
        media = None
        if pixels is not None:
            with torch.no_grad():  # Frozen: no backward through the tower, so no backward collectives.
                media = self.multi_modal_projector(self.visual(pixels).mean(1))
        return self.language_model(text, media)


class VlmForConditionalGeneration(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = VlmModel()
        self.lm_head = nn.Linear(HIDDEN, CLASSES)
        self.model.visual.requires_grad_(False)
        self.model.multi_modal_projector.requires_grad_(False)

    def forward(self, text: torch.Tensor, pixels: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.lm_head(self.model(text, pixels))


# -- deterministic data

@dataclass
class Microbatch:
    text: torch.Tensor
    target: torch.Tensor
    pixels: Optional[torch.Tensor]  # None: text only.


def has_images(media: str, fraction: float, skew: float, seed: int, rank: int, step: int, mb: int) -> bool:
    """Which microbatches carry images: a function of (seed, rank, step, microbatch) only."""
    if media in ("all", "none"):
        return media == "all"
    if media == "rank0":
        return rank == 0
    h = 1469598103934665603
    for v in (seed, rank, step, mb):
        h = ((h ^ ((v + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    p = min(1.0, max(0.0, fraction + (skew if rank % 2 == 0 else -skew)))
    return (h % 10000) / 10000.0 < p


def make_microbatch(args: argparse.Namespace, rank: int, step: int, mb: int) -> Microbatch:
    gen = torch.Generator().manual_seed(args.seed * 1000003 + rank * 10007 + step * 101 + mb)
    text = torch.randn(BATCH, TEXT_IN, generator=gen)
    pixels = torch.randn(BATCH, PATCHES, IMAGE_IN, generator=gen)
    target = torch.randint(0, CLASSES, (BATCH,), generator=gen)
    images = has_images(args.media, args.image_fraction, args.skew, args.seed, rank, step, mb)
    return Microbatch(text, target, pixels if images else None)


def params_hash(model: nn.Module) -> str:
    """Of the trainable parameters, whole (under FSDP2 each rank gathers them: a collective)."""
    h = hashlib.sha256()
    for _, p in model.named_parameters():
        if p.requires_grad:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# -- training

def fsdp2_device(args: argparse.Namespace) -> torch.device:
    """cuda:$LOCAL_RANK when every local rank has a GPU of its own, else the CPU (Gloo)."""
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", args.rank)))
    # srun: SLURM_NTASKS_PER_NODE is set with --ntasks-per-node ("8"; the leading count if "8(x2)").
    per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0].split(",")[0]
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", per_node if per_node.isdigit() else args.world_size))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    env = os.environ.get
    ap.add_argument("--coordinator", default=env(shardcoord.ADDRESS_ENV, ""),
                    help="shardcoordd HOST:PORT (default $SHARDCOORD_ADDR)")
    ap.add_argument("--job", default="vlm-py")
    ap.add_argument("--rank", type=int, default=None, help="default $RANK (torchrun) or $SLURM_PROCID (srun)")
    ap.add_argument("--world-size", type=int, default=None, help="default $WORLD_SIZE (torchrun) or $SLURM_NTASKS (srun)")
    ap.add_argument("--group-size", type=int, default=None, help="shard group size (default: the world)")
    ap.add_argument("--init-method", default=None,
                    help="torch.distributed init method (default env:// when $MASTER_ADDR is set)")
    ap.add_argument("--nproc", type=int, default=0, help="launch this many ranks locally and wait for them")
    ap.add_argument("--policy", default="auto", choices=["auto", "per_layer", "root", "replicate"])
    ap.add_argument("--fallback", default="root", choices=["root", "replicate", "padded"])
    ap.add_argument("--media", default="mixed", choices=["mixed", "all", "none", "rank0"])
    ap.add_argument("--image-fraction", type=float, default=0.5)
    ap.add_argument("--skew", type=float, default=0.0, help="even ranks get fraction + skew, odd fraction - skew")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--accum", type=int, default=2, help="microbatches accumulated per optimizer step")
    ap.add_argument("--lookahead", type=int, default=4)
    ap.add_argument("--seed", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--memory-budget-bytes", type=int, default=0,
                    help="memory this rank can spare for replicating frozen modules (enables `auto` promotion)")
    ap.add_argument("--connect-timeout", type=float, default=30.0, help="seconds to reach the coordinator")
    ap.add_argument("--decision-timeout", type=float, default=60.0, help="seconds")
    ap.add_argument("--collective-timeout", type=float, default=60.0, help="seconds, for torch.distributed")
    ap.add_argument("--interval-ms", type=int, default=0, help="pause after each step (demos)")
    ap.add_argument("--no-shard", action="store_true", help="reference run: frozen parameters whole on every rank")
    ap.add_argument("--fsdp2", action="store_true",
                    help="FSDP2 (torch >= 2.6) instead of the plain executor: a GPU per rank with NCCL, else Gloo")
    ap.add_argument("--no-watch", action="store_true",
                    help="with --fsdp2: no FailureWatch (to show a rank blocked in NCCL when a peer hangs)")
    args = ap.parse_args(argv)
    if args.nproc:
        return args
    try:  # torchrun's RANK/WORLD_SIZE, or srun's SLURM_PROCID/SLURM_NTASKS.
        args.rank, args.world_size, _ = shardcoord.launcher_rank(args.rank, args.world_size)
    except shardcoord.InvalidArgument as e:
        ap.error(f"--rank/--world-size: {e}")
    if args.group_size is None:
        args.group_size = args.world_size
    if args.init_method is None:
        if "MASTER_ADDR" not in os.environ:
            ap.error("--init-method not given and $MASTER_ADDR is not set (use torchrun, --nproc or --init-method)")
        args.init_method = "env://"
    if args.steps < 1 or args.accum < 1:
        ap.error("--steps and --accum must be >= 1")
    if args.fsdp2 and not fsdp2.available():
        ap.error(f"--fsdp2 needs torch >= 2.6 (fully_shard); this is torch {torch.__version__}: leave --fsdp2 out "
                 f"to use the plain torch.distributed executor")
    if args.fsdp2 and args.group_size != args.world_size:
        ap.error(f"--fsdp2 shards over the world: --group-size must be the world size ({args.world_size}); "
                 f"for hybrid sharding build a 2-D DeviceMesh and pass it to shardcoord.fsdp2.shard(mesh=...)")
    return args


@dataclass
class Rank:
    """One rank's training: its model, worker and device, what places the frozen modules (the
    executor, or FSDP2's control) and averages the gradients, and the decisions received."""
    args: argparse.Namespace
    model: nn.Module
    specs: list
    worker: shardcoord.Worker
    device: torch.device
    executor: Optional[sct.Executor] = None
    control: Optional[object] = None  # fsdp2.shard's (--fsdp2 without --no-shard).
    watch: Optional[sct.FailureWatch] = None
    optimizer: Optional[torch.optim.Optimizer] = None  # --fsdp2: SGD on the sharded parameters.
    trainable: List[torch.Tensor] = field(default_factory=list)
    decided: Counter = field(default_factory=Counter)
    fallbacks: int = 0

    def check(self) -> None:
        """With a FailureWatch: raises the coordinator's verdict once it declared a member lost."""
        if self.watch is not None:
            self.watch.check()


def start(args: argparse.Namespace) -> Rank:
    """Builds the model (the same weights on every rank), registers the rank with the coordinator,
    joins the process group and places the frozen modules."""
    torch.set_num_threads(1)  # Deterministic, and small CPU machines are shared by all ranks.
    torch.manual_seed(1234)  # Identical initial weights on every rank.
    model = VlmForConditionalGeneration()
    # In the order the forward calls the modules (the tower, then the projector): the order a
    # padded decision's gather-only passes follow (fallback padded; DESIGN 3, "Padded").
    specs = sorted(sct.manifest(model), key=lambda spec: spec.name != "model.visual")
    worker = shardcoord.Worker(args.job, specs, args.group_size, rank=args.rank, world_size=args.world_size,
                               address=args.coordinator, policy=args.policy, fallback=args.fallback,
                               lookahead=args.lookahead, memory_budget_bytes=args.memory_budget_bytes,
                               connect_timeout=args.connect_timeout)
    timeout = datetime.timedelta(seconds=args.collective_timeout)
    device = fsdp2_device(args) if args.fsdp2 else torch.device("cpu")
    with sct.collective(worker, "process group rendezvous"):
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=args.init_method,
                                rank=args.rank, world_size=args.world_size, timeout=timeout)
    r = Rank(args, model, specs, worker, device)
    place(r)
    r.trainable = [p for p in model.parameters() if p.requires_grad]
    return r


def place(r: Rank) -> None:
    """--fsdp2: FSDP2 units (and the optimizer, and a FailureWatch); else, unless --no-shard, the executor."""
    args, model = r.args, r.model
    if args.fsdp2:
        model.to(r.device)
        if args.no_shard:
            fsdp2.fully_shard(model)  # The reference: the frozen tower gathered by every rank in every forward.
        else:
            r.control = fsdp2.shard(model, r.specs)
        r.optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=args.lr)
        if not args.no_watch:
            r.watch = sct.FailureWatch(r.worker).start()
    elif not args.no_shard:
        with sct.collective(r.worker, "shard process groups"):
            pg = sct.shard_process_group(r.worker)
        r.executor = sct.Executor(model, r.specs, r.worker, pg)


def run_microbatch(r: Rank, mb: int, batch: Microbatch, decision, calls: Dict[str, int]) -> float:
    """Forward and backward of one microbatch under its decision; ``calls``: the plan this rank
    reported for it. Returns its (scaled) loss."""
    args = r.args
    for d in decision.modules.values():
        r.decided[d.decision] += 1
        r.fallbacks += d.reason == "divergent"
    r.check()
    # This rank's planned calls (what PlanAhead reported): root releases after the last, padded
    # pads up to the group's passes.
    if r.executor is not None:
        r.executor.begin_microbatch(decision, calls=calls)
    if r.control is not None:
        r.control.begin_microbatch(decision, calls=calls)
    if args.fsdp2:
        r.model.set_requires_gradient_sync(mb == args.accum - 1)  # Reduce-scatter once per step.
    pixels = None if batch.pixels is None else batch.pixels.to(r.device)
    loss = F.cross_entropy(r.model(batch.text.to(r.device), pixels), batch.target.to(r.device)) / args.accum
    loss.backward()
    if r.executor is not None:
        r.executor.end_microbatch()
    if r.control is not None:
        r.control.end_microbatch()
    value = loss.item()  # Waits for the GPU: blocked here if a peer died mid-collective.
    r.check()
    return value


def average_and_step(r: Rank) -> None:
    """Data parallel: averages the trainable gradients over the world, then one SGD step."""
    with torch.no_grad():
        flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel()) for p in r.trainable])
        with sct.collective(r.worker, "gradient all-reduce"):
            work = dist.all_reduce(flat, async_op=True)
        sct.wait_collective(work, r.worker, "gradient all-reduce")  # Watches the coordinator meanwhile.
        flat.div_(r.args.world_size)
        offset = 0
        for p in r.trainable:
            p.sub_(flat[offset:offset + p.numel()].view_as(p) * r.args.lr)
            offset += p.numel()


def end_step(r: Rank, step: int, step_loss: float) -> None:
    """After a step's last microbatch: the optimizer step, then the step's line."""
    if r.optimizer is not None:  # FSDP2 averaged the gradients over the world (reduce-scatter).
        r.optimizer.step()
        r.optimizer.zero_grad()
    else:
        average_and_step(r)
        if r.executor is not None:
            r.worker.report_memory(r.executor.memory_usage())  # Shown by `shardctl ranks`.
    print(f"step {step} loss {float.hex(step_loss)} ({step_loss:.6f})", flush=True)
    if r.args.interval_ms:
        time.sleep(r.args.interval_ms / 1000)


def print_summary(r: Rank) -> None:
    summary = (f"summary rank {r.args.rank}: decisions per_layer={r.decided['per_layer']} skip={r.decided['skip']} "
               f"root={r.decided['root']} replicate={r.decided['replicate']} padded={r.decided['padded']} "
               f"fallbacks={r.fallbacks}")
    if r.executor is not None:
        gathered = sum(b.gathered for b in r.executor.bytes.values())
        summary += f" gathered_bytes={gathered} peak_frozen_bytes={r.executor.peak_total_bytes}"
    if r.device.type == "cuda":
        summary += f" peak_gpu_mib={torch.cuda.max_memory_allocated(r.device) / 2**20:.1f}"
    print(summary, flush=True)


def train(args: argparse.Namespace) -> int:
    r = start(args)
    controlled = [s.name for s in r.specs]
    total = args.steps * args.accum
    batches = ((i // args.accum, i % args.accum, make_microbatch(args, args.rank, i // args.accum, i % args.accum))
               for i in range(total))
    plans = sct.PlanAhead(r.worker, batches,
                          lambda mb: {name: 0 if mb.pixels is None else 1 for name in controlled},
                          lookahead=args.lookahead, timeout=args.decision_timeout)
    step_loss = 0.0
    # Under FSDP2 a collective that fails (aborted by the watch, or NCCL's own error) raises the
    # coordinator's verdict, naming the lost rank, instead of a bare RuntimeError.
    guard = sct.collective(r.worker, "FSDP2 training step") if args.fsdp2 else contextlib.nullcontext()
    with guard:
        for step, mb, batch, decision in plans:
            if mb == 0:
                for p in r.trainable:
                    p.grad = None
                step_loss = 0.0
            step_loss += run_microbatch(r, mb, batch, decision, plans.plan)
            if mb == args.accum - 1:
                end_step(r, step, step_loss)
        final = params_hash(r.model)
    r.check()
    print(f"final params hash {final}")
    print_summary(r)
    if r.watch is not None:
        r.watch.stop()
    r.worker.close()
    dist.destroy_process_group()
    return 0


# -- local launcher

def _strip_nproc(argv: List[str]) -> List[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def launch(nproc: int, argv: List[str], grace: float = 30.0) -> int:
    """Runs ``nproc`` ranks of this script (RANK / WORLD_SIZE set, a FileStore in a temporary folder),
    prefixing their output with the rank. Once one fails, the others get ``grace`` seconds to stop
    on their own (they should: the coordinator names the lost rank), then are killed. Returns the
    first failing rank's exit code, or 0."""
    child_argv = [sys.executable, os.path.abspath(__file__), *_strip_nproc(argv)]
    procs: List[subprocess.Popen] = []
    pumps: List[threading.Thread] = []
    lock = threading.Lock()

    def pump(rank: int, stream) -> None:
        for line in stream:
            with lock:
                sys.stdout.write(f"[rank {rank}] {line}")
                sys.stdout.flush()

    first_failure: Optional[int] = None
    with tempfile.TemporaryDirectory(prefix="vlm_train-") as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        try:
            for r in range(nproc):
                env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc))
                p = subprocess.Popen([*child_argv, "--init-method", init], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
                procs.append(p)
                t = threading.Thread(target=pump, args=(r, p.stdout), daemon=True)
                t.start()
                pumps.append(t)
            deadline: Optional[float] = None
            while any(p.poll() is None for p in procs):
                if first_failure is None:
                    failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
                    if failed:
                        first_failure, deadline = failed[0], time.monotonic() + grace
                if deadline is not None and time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            for t in pumps:
                t.join(5)
    codes = [p.returncode for p in procs]
    failed = [c for c in codes if c != 0]
    if first_failure is not None:
        return first_failure
    return (failed[0] if failed[0] > 0 else 1) if failed else 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.nproc:
        return launch(args.nproc, argv)
    try:
        return train(args)
    except shardcoord.Error as e:
        print(f"vlm_train: rank {args.rank}: {type(e).__name__}: {e}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        # No clean goodbye and no process group teardown: peers may be gone. The coordinator sees
        # this rank's session end and tells its group.
        os._exit(3)


if __name__ == "__main__":
    sys.exit(main())
