#!/usr/bin/env python3
"""The coordinator's parts and who may include them (DESIGN 2, "Parts"): each folder of
coordinator/ includes only the folders before it in LAYERS (and its own); the what-if planner
(client/plan.*, client/cost_model.*, client/trace.*) includes the engine and the settings of
the coordinator, nothing else of it. CMake keeps the links apart; this keeps the headers apart,
which the include path (the repository root) does not.

    scripts/check-layering.py [ROOT]     exit 1, a line per include that breaks the order
"""
import re
import sys
from pathlib import Path

LAYERS = ["journal", "settings", "engine", "core", "ops", "server", "daemon"]
PLANNER = ["client/plan.h", "client/plan.cc", "client/cost_model.h", "client/cost_model.cc",
           "client/trace.h", "client/trace.cc"]
PLANNER_MAY = {"engine", "settings"}
INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"coordinator/([a-z_]+)/', re.M)


def problems(root: Path):
    out = []
    for part in LAYERS:
        allowed = set(LAYERS[: LAYERS.index(part) + 1])
        for f in sorted((root / "coordinator" / part).glob("*.[ch]*")):
            for m in INCLUDE.finditer(f.read_text(errors="replace")):
                if m.group(1) not in allowed:
                    line = f.read_text(errors="replace")[: m.start()].count("\n") + 1
                    out.append(f"{f.relative_to(root)}:{line}: coordinator/{part} includes coordinator/{m.group(1)}, "
                               f"a part above it (the order: {', '.join(LAYERS)})")
    for rel in PLANNER:
        f = root / rel
        if not f.exists():
            continue
        for m in INCLUDE.finditer(f.read_text(errors="replace")):
            if m.group(1) not in PLANNER_MAY:
                line = f.read_text(errors="replace")[: m.start()].count("\n") + 1
                out.append(f"{rel}:{line}: the planner includes coordinator/{m.group(1)}; it may use only "
                           f"coordinator/engine and coordinator/settings (shardctl plan links the engine alone)")
    return out


def main():
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
    found = problems(root)
    for p in found:
        print(p)
    print("Layering: " + (f"{len(found)} includes out of order" if found else "every part includes only those below it"))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
