"""The `hai` command's entry point: the queue read a command makes first is started before
the command has loaded. Python's start and slurm-hai's imports take about 0.1 s, as long as
squeue takes over a queue of 10,000 jobs; started first, the two overlap (docs/benchmarks.md,
issue 32). The command itself is cli/user.py; the commands backend's jobs() takes the read
started here when its call is the same (slurm/squeue.py)."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence


def main() -> None:
    first = first_read(sys.argv[1:])
    if first is not None:
        from ..slurm import config_missing, reads_with_commands, squeue

        if reads_with_commands() and not config_missing():
            squeue.start_ahead(*first)
    from .user import main as hai

    hai()


def first_read(args: Sequence[str]) -> tuple[tuple[int, ...], str | None] | None:
    """What `hai ARGS` asks the queue first, from its arguments alone, as backend.jobs()'s
    (job ids, user): `list` your jobs, `list --all` everyone's, `status JOB` and `logs JOB`
    that job; None for any other command or arguments (nothing is read ahead)."""
    words = [a for a in args if a != "--json"]
    if words == ["list"]:
        return (), current_user()
    if words == ["list", "--all"]:
        return (), None
    if len(words) == 2 and words[0] in ("status", "logs") and words[1].isascii() and words[1].isdigit():
        return (int(words[1]),), None
    return None


def current_user() -> str:
    return _user_name(os.getuid())


@functools.lru_cache(maxsize=8)
def _user_name(uid: int) -> str:  # asked once per job by `hai list`: NSS may be a network call
    import pwd

    return pwd.getpwuid(uid).pw_name
