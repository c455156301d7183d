#!/usr/bin/env python3
"""Writes a synthetic mixed-modality plan trace for `shardctl replay` (JSON lines).

Each rank and microbatch gets a line saying how often it calls each frozen module.
Group layout is contiguous blocks of --group-size ranks. Per group, a microbatch is
"uniform image" (every rank has images), "text only" (nobody does) or "mixed" (some
ranks do); audio appears on whole groups at once or on single ranks.

  python3 scripts/make_trace.py --world-size 8 --group-size 4 --steps 10 \
      --microbatches 4 --seed 7 > examples/traces/mixed_8ranks.jsonl
"""
import argparse
import json
import random


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--image-fraction", type=float, default=0.5,
                   help="probability that a rank's microbatch carries images in a mixed microbatch")
    p.add_argument("--seed", type=int, default=7)
    a = p.parse_args()
    rng = random.Random(a.seed)
    groups = a.world_size // a.group_size
    for step in range(a.steps):
        for mb in range(a.microbatches):
            for g in range(groups):
                kind = rng.choices(["uniform", "text", "mixed"], weights=[4, 3, 3])[0]
                audio_all = rng.random() < 0.2
                for r in range(g * a.group_size, (g + 1) * a.group_size):
                    if kind == "uniform":
                        images = 1
                    elif kind == "text":
                        images = 0
                    else:
                        images = 1 if rng.random() < a.image_fraction else 0
                    audio = 1 if audio_all or rng.random() < 0.05 else 0
                    calls = {"vision_tower": images, "multi_modal_projector": images,
                             "audio_tower": audio}
                    print(json.dumps({"rank": r, "step": step, "microbatch": mb, "calls": calls},
                                     separators=(",", ":")))


if __name__ == "__main__":
    main()
