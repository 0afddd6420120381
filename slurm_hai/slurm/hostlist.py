"""Slurm hostlist expressions (pure): "n[1-3,7],gpu[01-02]" -> n1 n2 n3 n7 gpu01 gpu02."""

from __future__ import annotations

import re


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_one(expr: str) -> list[str]:
    m = re.match(r"^([^\[]*)\[([^\]]+)\](.*)$", expr)
    if not m:
        return [expr]
    prefix, ranges, rest = m.groups()
    out = []
    for rng in ranges.split(","):
        lo, _, hi = rng.partition("-")
        width = len(lo)
        for n in range(int(lo), int(hi or lo) + 1):
            out.extend(prefix + str(n).zfill(width) + tail for tail in _expand_one(rest))
    return out


def expand(hostlist: str) -> list[str]:
    return [host for part in _split_top(hostlist.strip()) for host in _expand_one(part)]
