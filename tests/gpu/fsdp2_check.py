"""FSDP2 under shardcoord decisions, 2 ranks: NCCL on 2 GPUs, else Gloo on CPU tensors.

Run on the GPU machine by scripts/gpu/run_fsdp2_test.sh (torch >= 2.6; it skips otherwise).
Each scenario runs in fresh processes against a real shardcoordd: every rank registers a
worker, reports plans, takes the group's decision and carries it out with shardcoord.fsdp2.
Checked per scenario: nobody hangs (bounded), the decisions are the expected kinds, and every
rank issued the SAME FSDP all-gathers in every microbatch: their number, and the sequence of
units gathered (each named by its first parameter, with its element count), since with
equal-sized units a mismatch can complete silently with wrong data, so "it did not hang" (or
equal counts) is not enough. Media per microbatch is the number of tower calls on each rank.
`padded_divergent`: ranks call the tower different numbers of times (2 and 0, 3 and 1, ...) under
fallback `padded`; each rank must also gather the tower's units exactly K x UNITS times per
microbatch (K the most calls). Its decisions come from the coordinator when the binding and
daemon know `padded`, else (an older build) they are made locally in the mapping form
({"visual": ("padded", K)}); the output says which.
`padded_chain`: a second tower `audio` (2 units, before `visual` in the manifest and in the
forward) and both towers padded in one microbatch (the pad chain): one rank calls the audio tower
and pads the visual one, the other the reverse, one calls both and the other neither; media per
rank is then (audio calls, visual calls), and the decisions are made locally in the mapping form.
Negative controls run the same asymmetric microbatches without one of the mechanisms and
must show different all-gather counts across ranks (or hang): proof the mechanism matters.

    python tests/gpu/fsdp2_check.py --shardcoordd PATH [scenario ...]
"""

import argparse
import contextlib
import datetime
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import shardcoord
from shardcoord import fsdp2

WORLD = 2
HIDDEN = 256
UNITS = 4

# scenario -> (policy, fallback, media per microbatch as [rank0, rank1], expected decisions, mechanism off)
SCENARIOS = {
    "per_layer_uniform": ("per_layer", "root", [[1, 1]] * 4, {"per_layer"}, None),
    "root_asymmetric": ("auto", "root", [[1, 0], [0, 1]] * 2, {"root"}, None),
    "replicate_asymmetric": ("auto", "replicate", [[1, 0], [0, 1], [1, 1], [0, 1]], {"replicate"}, None),
    "skip_with_accumulation": ("auto", "root", [[0, 0], [0, 0], [1, 1], [0, 0]], {"skip", "per_layer"}, None),
    "auto_mixed": ("auto", "root", [[1, 1], [0, 0], [1, 0], [0, 1], [1, 1], [0, 0]],
                   {"per_layer", "skip", "root"}, None),
    # Divergent calls under fallback padded: every rank makes the busiest rank's passes.
    "padded_divergent": ("auto", "padded", [[2, 0], [3, 1], [1, 2], [2, 2], [0, 0], [0, 3]],
                         {"padded", "per_layer", "skip"}, None),
    # Two padded towers in one microbatch: their passes form a chain in manifest order (audio, visual).
    "padded_chain": ("auto", "padded", [[(1, 0), (0, 1)], [(2, 1), (0, 0)], [(0, 2), (1, 1)], [(1, 0), (0, 1)],
                                        [(1, 1), (0, 1)]], {"padded/padded", "padded/per_layer"}, None),
    # Each of the two root mechanisms alone keeps the collectives identical (measured: both
    # variants below pass); the controller uses both (see fsdp2.py).
    "root_reshard_after_forward_only": ("auto", "root", [[1, 0], [0, 1]] * 2, {"root"}, "unshard_in_backward"),
    "root_unshard_in_backward_only": ("auto", "root", [[1, 0], [0, 1]] * 2, {"root"}, "reshard_after_forward"),
    # Negative control: root by unshard() alone (neither mechanism) must make the ranks'
    # collectives differ (or hang): proof that the mechanisms are needed.
    "control_naive_root": ("auto", "root", [[1, 0], [0, 1]] * 2, {"root"}, "both"),
}
CONTROLS = {"control_naive_root"}
CHAINS = {"padded_chain"}  # Media per rank: (audio calls, visual calls); two controlled towers.
AUDIO_UNITS = 2


class Tower(nn.Module):
    def __init__(self, units=UNITS):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(units)])

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


class Vlm(nn.Module):
    def __init__(self, audio=False):
        super().__init__()
        self.audio = Tower(AUDIO_UNITS) if audio else None
        self.visual = Tower()
        self.language_model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN))

    def forward(self, x, media):
        # Media: how often this rank calls the tower in the microbatch; with an audio tower,
        # (audio calls, visual calls), every audio call first.
        audio, visual = media if isinstance(media, tuple) else (0, media)
        for _ in range(audio):
            x = x + self.audio(x)
        for _ in range(visual):
            x = x + self.visual(x)
        return self.language_model(x)


def manifest(model):
    """The controlled towers in the order the forward calls them: audio (if any), then visual."""
    specs = []
    for name in ("audio", "visual"):
        if getattr(model, name) is None:
            continue
        units = tuple(shardcoord.LayerUnit(f"blocks.{i}", sum(p.numel() * p.element_size() for p in b.parameters()))
                      for i, b in enumerate(getattr(model, name).blocks))
        specs.append(shardcoord.ModuleSpec(name, sum(u.param_bytes for u in units), units))
    return specs


def count_all_gathers():
    """Counts FSDP's all-gathers and records each as "first parameter:elements" (parameter names
    from counter["names"], id(sharded parameter) -> name, set once the model is sharded)."""
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as C
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as G
    counter = {"n": 0, "sequence": [], "names": {}}
    original = C.foreach_all_gather

    def counted(*a, **k):
        counter["n"] += 1
        params = list(a[0] if a else k.get("fsdp_params", []))
        sharded = [getattr(fp, "sharded_param", None) for fp in params]
        first = counter["names"].get(id(sharded[0]), "?") if sharded else "?"
        counter["sequence"].append(f"{first}:{sum(p.numel() for p in sharded if p is not None)}")
        return original(*a, **k)

    C.foreach_all_gather = counted
    G.foreach_all_gather = counted
    return counter


def local_decision(calls):
    """The contract's rule for one microbatch, in the mapping form (an older binding or daemon);
    ``calls`` per rank: visual calls, or (audio calls, visual calls)."""
    def rule(per_rank):
        k = max(per_rank)
        return "skip" if k == 0 else "per_layer" if min(per_rank) == k else ("padded", k)

    if not isinstance(calls[0], tuple):
        return {"visual": rule(calls)}
    return {"audio": rule([c[0] for c in calls]), "visual": rule([c[1] for c in calls])}


def kind_of(decision):
    def kind(d):
        return d if isinstance(d, str) else d[0] if isinstance(d, tuple) else d.decision

    if isinstance(decision, dict) and "audio" in decision:
        return f"{kind(decision['audio'])}/{kind(decision['visual'])}"
    return kind(decision["visual"])


def planned_calls(has):
    """This rank's planned calls for begin_microbatch: visual calls, or (audio, visual) calls."""
    return {"audio": has[0], "visual": has[1]} if isinstance(has, tuple) else {"visual": has}


@contextlib.contextmanager
def decisions(scenario, spec, rank, address, result):
    """Yields decision(mb): the group's decision for microbatch mb, from the coordinator (plans
    kept a lookahead window ahead), or made locally for `padded` where this build lacks it."""
    policy, fallback, media, _, _ = SCENARIOS[scenario]
    if scenario in CHAINS:
        result["source"] = "local mapping form (two towers)"
        yield lambda mb: local_decision(media[mb])
        return
    try:
        w = shardcoord.Worker(f"fsdp2-{scenario}", spec, WORLD, rank=rank, world_size=WORLD, address=address,
                              policy=policy, fallback=fallback, connect_timeout=30)
    except shardcoord.Error as e:
        if fallback != "padded":
            raise
        result["source"] = f"local mapping form (this build refused fallback padded: {e})"[:300]
        yield lambda mb: local_decision(media[mb])
        return
    with w:
        result["source"] = "coordinator"
        window = w.group.lookahead
        for mb, has in enumerate(media[:window]):
            w.report_plan(0, mb, {"visual": has[rank]})

        def decision(mb):
            d = w.get_decision(0, mb, timeout=60)
            if mb + window < len(media):  # Keep the lookahead window full.
                w.report_plan(0, mb + window, {"visual": media[mb + window][rank]})
            return d

        yield decision


def rank_main(rank, scenario, address, store_dir, queue):
    policy, fallback, media, _, off = SCENARIOS[scenario]
    result = {"rank": rank, "all_gathers": [], "sequences": [], "decisions": [], "losses": []}
    try:
        cuda = torch.cuda.device_count() >= WORLD
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store_dir}/pg", rank=rank,
                                world_size=WORLD, timeout=datetime.timedelta(seconds=30))
        counter = count_all_gathers()
        torch.manual_seed(0)
        model = Vlm(audio=scenario in CHAINS).to(device)
        for tower in (model.audio, model.visual):
            if tower is not None:
                tower.requires_grad_(False)
        spec = manifest(model)
        ctl = fsdp2.shard(model, spec)
        counter["names"] = {id(p): n for n, p in model.named_parameters()}
        if off in ("unshard_in_backward", "both"):
            for unit in model.visual.blocks:
                unit.set_unshard_in_backward(True)
        opt = torch.optim.SGD(model.language_model.parameters(), lr=0.01)
        with decisions(scenario, spec, rank, address, result) as decision:
            for mb, has in enumerate(media):
                d = decision(mb)
                result["decisions"].append(kind_of(d))
                before, before_sequence = counter["n"], len(counter["sequence"])
                if off in ("reshard_after_forward", "both") and kind_of(d) == "root":
                    for unit in model.visual.blocks:  # Root "by unshard()" alone: the naive way.
                        unit.unshard()
                    ctl._controlled["visual"].decision = "root"
                elif fallback == "padded":
                    ctl.begin_microbatch(d, calls=planned_calls(has[rank]))  # Padded needs this rank's plan.
                else:
                    ctl.begin_microbatch(d)
                last = mb % 2 == 1
                model.set_requires_gradient_sync(last)
                torch.manual_seed(100 + mb * WORLD + rank)
                x = torch.randn(8, HIDDEN, device=device)
                loss = model(x, has[rank]).pow(2).mean()
                loss.backward()
                if off not in ("reshard_after_forward", "both"):
                    ctl.end_microbatch()
                else:
                    for unit in model.visual.blocks:
                        unit.reshard()
                if last:
                    opt.step()
                    opt.zero_grad()
                if cuda:
                    torch.cuda.synchronize()
                result["all_gathers"].append(counter["n"] - before)
                result["sequences"].append(counter["sequence"][before_sequence:])
                result["losses"].append(loss.item())
        result["ok"] = True
        if cuda:
            result["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    except Exception as e:  # Reported to the parent; the parent decides.
        result["error"] = f"{type(e).__name__}: {e}"[:400]
    queue.put(result)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def run(scenario, address, timeout_s=90):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as store_dir:
        procs = [ctx.Process(target=rank_main, args=(r, scenario, address, store_dir, queue)) for r in range(WORLD)]
        for p in procs:
            p.start()
        results, deadline = [], time.monotonic() + timeout_s
        for _ in range(WORLD):
            try:
                results.append(queue.get(timeout=max(1.0, deadline - time.monotonic())))
            except Exception:
                break
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    return sorted(results, key=lambda r: r["rank"])


def tower_passes_ok(scenario, results):
    """Padded: each rank gathered the tower's units K x UNITS times per microbatch, K the most
    calls any rank makes (the same holds for per_layer and skip); other scenarios: not checked."""
    _, fallback, media, _, _ = SCENARIOS[scenario]
    if fallback != "padded":
        return True
    if scenario in CHAINS:  # K passes over each tower, every audio pass before the first visual one.
        return all([e.split(".")[0] for e in r["sequences"][mb] if e.startswith(("audio.", "visual."))] ==
                   ["audio"] * (max(c[0] for c in calls) * AUDIO_UNITS) +
                   ["visual"] * (max(c[1] for c in calls) * UNITS)
                   for r in results for mb, calls in enumerate(media))
    return all(sum(e.startswith("visual.") for e in r["sequences"][mb]) == max(calls) * UNITS
               for r in results for mb, calls in enumerate(media))


def verdict(scenario, results):
    _, _, _, expected, off = SCENARIOS[scenario]
    hung = len(results) < WORLD or any("ok" not in r for r in results)
    same = not hung and results[0]["all_gathers"] == results[1]["all_gathers"] and \
        results[0]["sequences"] == results[1]["sequences"]
    kinds = set(results[0]["decisions"]) if results else set()
    if scenario in CONTROLS:  # A control passes when the mechanisms are shown to matter.
        ok = hung or not same
        why = "hung" if hung else ("all-gathers differ across ranks" if not same else "identical: control FAILED")
    else:
        passes = not hung and tower_passes_ok(scenario, results)
        ok = not hung and same and passes and kinds == expected and \
            all(r["decisions"] == results[0]["decisions"] for r in results)
        why = "identical collectives" if ok else ("hung or failed" if hung else
                                                  f"all-gathers {[r['all_gathers'] for r in results]}, "
                                                  f"same sequence {same}, tower passes as expected {passes}, "
                                                  f"decisions {kinds} (expected {expected})")
    return ok, why


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shardcoordd", required=True)
    ap.add_argument("scenarios", nargs="*", default=list(SCENARIOS))
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.device_count()} GPUs, fsdp2 available: {fsdp2.available()}",
          flush=True)
    if not fsdp2.available():
        print("SKIP: FSDP2 needs torch >= 2.6")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        addr_file = os.path.join(tmp, "addr")
        daemon = subprocess.Popen([args.shardcoordd, "--listen", "127.0.0.1:0", "--address-file", addr_file,
                                   "--log-level", "warn"])
        try:
            deadline = time.monotonic() + 20
            while not os.path.exists(addr_file) and time.monotonic() < deadline:
                time.sleep(0.05)
            address = open(addr_file).read().strip()
            passed = failed = 0
            for scenario in args.scenarios:
                results = run(scenario, address)
                ok, why = verdict(scenario, results)
                passed, failed = passed + ok, failed + (not ok)
                print(f"{'PASS' if ok else 'FAIL'} {scenario}: {why}", flush=True)
                for r in results:
                    print(f"    rank {r['rank']}: decisions {r.get('decisions')} all-gathers {r.get('all_gathers')} "
                          f"peak {r.get('peak_mib', '-')} MiB {r.get('error', '')}", flush=True)
                    if "source" in r:
                        print(f"      decisions from: {r['source']}", flush=True)
                    if not ok and r.get("sequences"):
                        print(f"      sequences: {r['sequences']}"[:2000], flush=True)
            print(f"{passed} passed, {failed} failed")
            return 0 if failed == 0 else 1
        finally:
            daemon.terminate()
            daemon.wait(10)


if __name__ == "__main__":
    sys.exit(main())
