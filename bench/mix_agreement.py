#!/usr/bin/env python3
"""How often the shard groups agree, per published data mix, with and without shardcoord.sampler
(results in docs/BENCHMARKS.md, "Agreement by data mix"). Standard library only.

For every mix of docs/MIXES.md, samples per microbatch S and arrangement (none: draw order;
spread: shardcoord.sampler.arrange_step per rank and step; group_by_modality: LLaVA's sampler
order for the whole job), scripts/make_trace.py writes a trace (the same seed, so the same samples
in every arrangement), and `shardctl replay` plays it through a shardcoordd of its own, policy
per_layer with fallback root, for every group size G. Counted: the group decisions (one per
group, microbatch and controlled module) that are per_layer, skip and the fallback (root). The
contract's rule applied in Python to the trace must give the same counts (checked: a mismatch
is an error).

  bench/mix_agreement.py                                  # the documented run (a few minutes, 2 cores)
  bench/mix_agreement.py --mixes qwen25vl_sft --group-sizes 8 --samples 4
  bench/mix_agreement.py --mixes mm1_pretrain,llava_ov_ov --calls per_item   # a tower call per image

Prints markdown: the fallback share per mix, S, G and arrangement, then every share. Exit code 0
when every replay succeeded and agreed with the rule; 1 otherwise; 2 setup error.
"""

import argparse
import collections
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
MAKE_TRACE = os.path.join(ROOT, "scripts", "make_trace.py")
ARRANGEMENTS = ("none", "spread", "group_by_modality")
SHORT = {"none": "none", "spread": "spread", "group_by_modality": "by modality"}


def load_make_trace():
    sys.path.insert(0, os.path.dirname(MAKE_TRACE))
    import make_trace  # noqa: E402  (the mixes and their default --calls)
    return make_trace


def rule_counts(trace_path, world_size, group_size):
    """The contract's decision rule (policy per_layer) on the trace: all zero -> skip, all equal ->
    per_layer, else the fallback."""
    calls = collections.defaultdict(dict)  # (step, mb, module) -> rank -> calls
    modules = set()
    with open(trace_path) as f:
        for line in f:
            j = json.loads(line)
            for module, c in j["calls"].items():
                calls[(j["step"], j["microbatch"], module)][j["rank"]] = c
                modules.add(module)
    counts = collections.Counter()
    for key, per_rank in calls.items():
        for g in range(0, world_size, group_size):
            got = {per_rank.get(r, 0) for r in range(g, g + group_size)}
            counts["skip" if got == {0} else "per_layer" if len(got) == 1 else "root"] += 1
    return counts


def replay(shardctl, trace_path, world_size, group_size, job):
    try:
        p = subprocess.run([shardctl, "replay", trace_path, "--world-size", str(world_size), "--group-size",
                            str(group_size), "--policy", "per_layer", "--fallback", "root", "--job-id", job],
                           capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"shardctl replay {trace_path} --group-size {group_size}: {e}") from None
    if p.returncode != 0:
        tail = "\n".join(p.stderr.splitlines()[-5:])
        raise RuntimeError(f"shardctl replay {trace_path} --group-size {group_size} exited {p.returncode}:\n{tail}")
    counts = collections.Counter()
    for line in p.stdout.splitlines():
        counts[json.loads(line)["decision"]] += 1
    return counts


def pct(part, total):
    return f"{100.0 * part / total:.0f}" if total else "-"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--world-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step (gradient accumulation)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--group-sizes", default="2,4,8,16")
    p.add_argument("--samples", default="1,4", help="samples per microbatch, comma-separated")
    p.add_argument("--mixes", default="all", help="comma-separated mix names (scripts/make_trace.py --list-mixes)")
    p.add_argument("--arrange", default=",".join(ARRANGEMENTS))
    p.add_argument("--calls", choices=["batched", "per_kind", "per_item"],
                   help="how the model calls its tower, for every mix (default: each mix's model's)")
    p.add_argument("--keep", help="write the traces here (default: a temporary folder, removed)")
    a = p.parse_args()

    mt = load_make_trace()
    shardctl = os.path.join(a.build, "client", "shardctl")
    if not os.access(shardctl, os.X_OK):
        print(f"mix_agreement: no {shardctl}; build first (scripts/build.sh)", file=sys.stderr)
        return 2
    mixes = sorted(mt.MIXES) if a.mixes == "all" else a.mixes.split(",")
    unknown = [m for m in mixes if m not in mt.MIXES]
    arrangements = a.arrange.split(",")
    if unknown or any(x not in ARRANGEMENTS for x in arrangements):
        print(f"mix_agreement: unknown mix or arrangement in {unknown or arrangements}", file=sys.stderr)
        return 2
    groups = [int(g) for g in a.group_sizes.split(",")]
    samples = [int(s) for s in a.samples.split(",")]
    if any(a.world_size % g for g in groups):
        print(f"mix_agreement: every group size must divide --world-size {a.world_size}", file=sys.stderr)
        return 2

    tmp = None
    folder = a.keep
    if folder is None:
        tmp = tempfile.TemporaryDirectory(prefix="mix_agreement.")
        folder = tmp.name
    os.makedirs(folder, exist_ok=True)

    started = time.monotonic()
    results = {}  # (mix, S, G, arrangement) -> Counter
    failed = 0
    for mix in mixes:
        for s in samples:
            for arrangement in arrangements:
                trace = os.path.join(folder, f"{mix}_s{s}_{arrangement}.jsonl")
                with open(trace, "w") as out:
                    subprocess.run([sys.executable, MAKE_TRACE, "--mix", mix, "--world-size", str(a.world_size),
                                    "--steps", str(a.steps), "--microbatches", str(a.microbatches),
                                    "--samples-per-microbatch", str(s), "--arrange", arrangement,
                                    "--seed", str(a.seed)] + (["--calls", a.calls] if a.calls else []),
                                   stdout=out, check=True, timeout=600)
                for g in groups:
                    try:
                        got = replay(shardctl, trace, a.world_size, g, f"{mix}-s{s}-g{g}-{arrangement}")
                    except RuntimeError as e:
                        print(f"mix_agreement: {e}", file=sys.stderr)
                        failed += 1
                        continue
                    want = rule_counts(trace, a.world_size, g)
                    if +got != +want:
                        print(f"mix_agreement: {mix} S={s} G={g} {arrangement}: shardctl replay decided "
                              f"{dict(got)}, the contract's rule says {dict(want)}", file=sys.stderr)
                        failed += 1
                    results[(mix, s, g, arrangement)] = got
                print(f"mix_agreement: {mix} S={s} {arrangement} done ({time.monotonic() - started:.0f} s)",
                      file=sys.stderr)
    elapsed = time.monotonic() - started

    command = " ".join(["bench/mix_agreement.py"] + sys.argv[1:])
    print(f"`{command}`: world size {a.world_size}, {a.steps} steps x {a.microbatches} microbatches, seed {a.seed}, "
          f"policy per_layer with fallback root; {datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, "
          f"{os.cpu_count()} cores ({platform.machine()}), {elapsed:.0f} s.\n")
    print("Fallback (root) share of the group decisions, % (" +
          " -> ".join(SHORT[x] for x in arrangements) + "):\n")
    print("| mix | calls | S | " + " | ".join(f"G={g}" for g in groups) + " |")
    print("|---|---|---|" + "---|" * len(groups))
    for mix in mixes:
        for s in samples:
            cells = []
            for g in groups:
                parts = []
                for x in arrangements:
                    c = results.get((mix, s, g, x))
                    parts.append(pct(c["root"], sum(c.values())) if c else "?")
                cells.append(" -> ".join(parts))
            print(f"| {mix} | {a.calls or mt.MIXES[mix].calls} | {s} | " + " | ".join(cells) + " |")
    print("\nEvery share, % of the group decisions: per_layer / skip / fallback (rounded):\n")
    print("| mix | S | G | decisions | " + " | ".join(SHORT[x] for x in arrangements) + " |")
    print("|---|---|---|---|" + "---|" * len(arrangements))
    for mix in mixes:
        for s in samples:
            for g in groups:
                cells = []
                total = 0
                for x in arrangements:
                    c = results.get((mix, s, g, x))
                    if not c:
                        cells.append("?")
                        continue
                    total = sum(c.values())
                    cells.append(" / ".join(pct(c[k], total) for k in ("per_layer", "skip", "root")))
                print(f"| {mix} | {s} | {g} | {total} | " + " | ".join(cells) + " |")
    if tmp is not None:
        tmp.cleanup()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
