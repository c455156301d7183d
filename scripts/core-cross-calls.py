#!/usr/bin/env python3
"""Calls between the files of CoordinatorCore (docs/BENCHMARKS.md, "Issue 27").

Counts, in coordinator/core/coordinator_core*.cc, the calls to a CoordinatorCore method that
another of those files defines, and the pairs of files that call each other both ways. A
lexical count (a name followed by "("), good enough to compare one tree with another:

    python3 scripts/core-cross-calls.py [ROOT]
"""
import collections
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
files = sorted((root / "coordinator" / "core").glob("coordinator_core*.cc"))
if not files:
    files = sorted((root / "coordinator").glob("coordinator_core*.cc"))  # Trees before the folders.
defined = {}
for f in files:
    for name in re.findall(r"^[\w:<>,*& ]*?CoordinatorCore::(\w+)\(", f.read_text(), re.M):
        defined.setdefault(name, f.name)
calls = collections.Counter()
for f in files:
    text = re.sub(r"//.*", "", f.read_text())
    for name, home in defined.items():
        if home == f.name:
            continue
        n = len(re.findall(r"(?<![\w:.>])" + name + r"\(", text))
        if n:
            calls[(f.name, home)] += n
both = sorted({tuple(sorted(p)) for p in calls if (p[1], p[0]) in calls})
print(f"{sum(calls.values())} calls across {len(files)} files, {len(both)} pairs both ways")
base = sum(n for (src, dst), n in calls.items() if dst == "coordinator_core.cc")
print(f"  into coordinator_core.cc: {base}; between the other files: {sum(calls.values()) - base}")
for (src, dst), n in sorted(calls.items()):
    print(f"  {src} -> {dst}: {n}")
for a, b in both:
    print(f"  both ways: {a} <-> {b}")
