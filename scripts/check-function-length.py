#!/usr/bin/env python3
"""Fails when a product function is longer than the house limit (60 lines, DESIGN 2).

C++ (coordinator/, worker/, contract/, client/, proto/, examples/, python/src/): functions are
found by matching braces, with comments, strings and character literals blanked first; a block
opened after a `)` outside any function body is a function (lambdas and local blocks count
toward the function around them). Python (python/shardcoord/, examples/python/): every `def`,
by its `ast` line span. Tests, benchmarks and fuzzers are not product code.

    scripts/check-function-length.py [--max 60] [ROOT]     (exit 0: none over; 1: the list)
"""
import argparse
import ast
import os
import re
import sys

CPP_DIRS = ["coordinator", "worker", "contract", "client", "proto", "examples", "python/src"]
PY_DIRS = ["python/shardcoord", "examples/python"]
CPP_EXT = (".cc", ".h", ".cpp")
CONTROL = re.compile(r"\b(if|for|while|switch|catch|do|else)\b\s*(\(|$|\{)")
TYPE_BLOCK = re.compile(r"\b(class|struct|union|enum|namespace)\b")


def blank(text: str) -> str:
    """Comments, strings and character literals replaced by spaces (newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        two = text[i:i + 2]
        if two == "//":
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif two == "/*":
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text.startswith('R"', i):
            m = re.match(r'R"([^(]*)\(', text[i:])
            end = text.find(")" + (m.group(1) if m else "") + '"', i)
            j = n if end < 0 else end + len(m.group(1) if m else "") + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text[i] in "\"'":
            q, j = text[i], i + 1
            while j < n and text[j] != q and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(" " * (min(j + 1, n) - i))
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def cpp_functions(path: str):
    """(name, first line, line count) of every function body in a C++ file."""
    text = blank(open(path, encoding="utf-8", errors="replace").read())
    stack, head_start, found = [], 0, []
    line = 1
    for i, ch in enumerate(text):
        if ch == "\n":
            line += 1
        if ch in ";":
            head_start = i + 1
        elif ch == "{":
            head = text[head_start:i]
            in_function = any(kind == "function" for kind, _, _ in stack)
            if in_function:
                kind = "block"
            elif TYPE_BLOCK.search(head) and "(" not in head.split("{")[-1]:
                kind = "type"
            elif ")" in head and not CONTROL.search(head.strip()) and "=" not in head.rsplit(")", 1)[-1]:
                kind = "function"
            else:
                kind = "block"
            name = re.findall(r"([A-Za-z_~][\w:~<>]*)\s*\(", head)
            stack.append((kind, line, name[0] if name else "?"))
            head_start = i + 1
        elif ch == "}":
            if stack:
                kind, start, name = stack.pop()
                if kind == "function":
                    found.append((name, start, line - start + 1))
            head_start = i + 1
    return found


def py_functions(path: str):
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def files(root: str, dirs, ext):
    for d in dirs:
        for base, _, names in os.walk(os.path.join(root, d)):
            for name in sorted(names):
                if name.endswith(ext):
                    yield os.path.join(base, name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
    ap.add_argument("--max", type=int, default=60, help="longest function allowed, in lines (default 60)")
    args = ap.parse_args()
    root = os.path.normpath(args.root)
    over = []
    for path in files(root, CPP_DIRS, CPP_EXT):
        over += [(path, *f) for f in cpp_functions(path) if f[2] > args.max]
    for path in files(root, PY_DIRS, ".py"):
        over += [(path, *f) for f in py_functions(path) if f[2] > args.max]
    for path, name, start, length in sorted(over):
        print(f"{os.path.relpath(path, root)}:{start}: {name} is {length} lines (at most {args.max}): "
              f"split it into named steps")
    if not over:
        print(f"function length: no product function over {args.max} lines")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
