#!/usr/bin/env python3
"""Checks what the emulator cannot see in the kernels' signatures: the attributes.

The emulator binds kernel arguments by position and ignores attributes, while Metal binds
them by attribute. So every [[kernel]] must take its buffers as [[buffer(0)]], [[buffer(1)]],
... in order, then exactly the four thread-position arguments, in this order:
  uint3 [[threadgroup_position_in_grid]], uint [[simdgroup_index_in_threadgroup]],
  uint [[thread_index_in_simdgroup]], uint [[thread_index_in_threadgroup]].
usage: lint_kernels.py file.metal...   (exit status 1 on a violation)
"""
import re
import sys

TAIL = [("uint3", "threadgroup_position_in_grid"), ("uint", "simdgroup_index_in_threadgroup"),
        ("uint", "thread_index_in_simdgroup"), ("uint", "thread_index_in_threadgroup")]


def split_args(text):
    """Top-level comma split of a parameter list."""
    depth, cur, out = 0, "", []
    for ch in text:
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def check(path):
    src = open(path, encoding="utf-8").read()
    src = re.sub(r"//[^\n]*", "", src)
    errors = []
    for m in re.finditer(r"\[\[kernel\]\]\s*void\s+(\w+)\s*\(", src):
        name, i, depth = m.group(1), m.end(), 1
        start = i
        while depth:
            depth += {"(": 1, ")": -1}.get(src[i], 0)
            i += 1
        args = split_args(src[start:i - 1])
        if len(args) < 4:
            errors.append(f"{path}: {name}: fewer than 4 arguments")
            continue
        for k, arg in enumerate(args[:-4]):
            b = re.search(r"\[\[\s*buffer\((\d+)\)\s*\]\]", arg)
            if not b or int(b.group(1)) != k:
                errors.append(f"{path}: {name}: argument {k} ({arg!r}) must be [[buffer({k})]]")
        for arg, (typ, attr) in zip(args[-4:], TAIL):
            if not re.match(rf"{typ}\s+\w+\s*\[\[\s*{attr}\s*\]\]$", arg):
                errors.append(f"{path}: {name}: expected '{typ} <name> [[{attr}]]', got {arg!r}")
    return errors


def main():
    errors = [e for p in sys.argv[1:] for e in check(p)]
    for e in errors:
        print(e, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
