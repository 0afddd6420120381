"""A process's descendants, from /proc: what ends with a run that is ended (the launcher's
end of its command, runtime/launcher.py). Standard library only."""

from __future__ import annotations

from pathlib import Path


def descendants(pid: int) -> set[int]:
    """Every process below `pid`, from /proc. A command may start processes in sessions of
    their own (torchrun starts each worker so), which its process group does not reach and
    which, once their parent is gone, Slurm's proctrack/linuxproc no longer finds."""
    children: dict[int, list[int]] = {}
    for proc_stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(proc_stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        children.setdefault(ppid, []).append(int(proc_stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found.update(below)
        todo += below
    return found
