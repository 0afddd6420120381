"""Slurm hostlist expressions (pure): "n[1-3,7],gpu[01-02]" -> n1 n2 n3 n7 gpu01 gpu02.

An expression this module cannot read (unbalanced brackets, a range that is not
`LOW[-HIGH]` in decimal digits with LOW <= HIGH, more than MAX_HOSTS hosts) is a ValueError
of one line, never a guess.
"""

from __future__ import annotations

import re

MAX_HOSTS = 1 << 17  # more than any Slurm cluster has nodes (MaxNodeCount is at most 64k)
_BRACKETS = re.compile(r"([^\[\]]*)\[([^\[\]]+)\](.*)", re.S)
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")


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


def _ranges(text: str, expr: str) -> list[tuple[int, int, int]]:
    """`1-3,07` -> [(1, 3, width 1), (7, 7, width 2)]."""
    out = []
    for rng in text.split(","):
        m = _RANGE.fullmatch(rng)
        if not m or int(m.group(1)) > int(m.group(2) or m.group(1)):
            raise ValueError(f"hostlist {expr!r}: {rng!r} is not a range LOW-HIGH of node numbers")
        out.append((int(m.group(1)), int(m.group(2) or m.group(1)), len(m.group(1))))
    return out


def _expand_one(expr: str, whole: str) -> list[str]:
    if "[" not in expr and "]" not in expr:
        return [expr]
    m = _BRACKETS.fullmatch(expr)
    if not m:
        raise ValueError(f"hostlist {whole!r}: unbalanced brackets")
    prefix, ranges, rest = m.groups()
    numbers = _ranges(ranges, whole)
    if sum(hi - lo + 1 for lo, hi, _ in numbers) > MAX_HOSTS:
        raise ValueError(f"hostlist {whole!r}: more than {MAX_HOSTS} hosts")
    tails = _expand_one(rest, whole)
    if sum(hi - lo + 1 for lo, hi, _ in numbers) * len(tails) > MAX_HOSTS:
        raise ValueError(f"hostlist {whole!r}: more than {MAX_HOSTS} hosts")
    return [prefix + str(n).zfill(width) + tail for lo, hi, width in numbers for n in range(lo, hi + 1)
            for tail in tails]


def expand(hostlist: str) -> list[str]:
    hosts = [host for part in _split_top(hostlist.strip()) for host in _expand_one(part, hostlist)]
    if len(hosts) > MAX_HOSTS:
        raise ValueError(f"hostlist {hostlist!r}: more than {MAX_HOSTS} hosts")
    return hosts
