"""The entry points of `hai` and `hai-submit` (pyproject.toml): light until the command runs.

`hai` starts the queue read a command makes first before the command has loaded: Python's
start and slurm-hai's imports take about as long as squeue over a large queue; started
first, the two overlap (docs/figures.md, "A command's start"). The commands backend's jobs() takes the read started
here when its call is the same (slurm/squeue.py).
"""

from __future__ import annotations

import functools
import importlib
import os
import pwd
import sys
from collections.abc import Sequence

# each command's click object: (module, name)
COMMANDS = {"hai": ("slurm_hai.cli.user", "main"), "hai-submit": ("slurm_hai.cli.submit", "main")}


def hai() -> None:
    run_here("hai", sys.argv[1:])


def hai_submit() -> None:
    run_here("hai-submit", sys.argv[1:])


def run_here(command: str, args: list[str]) -> None:
    """Run the command in this process; `hai` starts its first queue read before the command
    loads."""
    if command == "hai":
        start_first_read(args)
    module, name = COMMANDS[command]
    getattr(importlib.import_module(module), name)(args=args, prog_name=command)


def start_first_read(args: Sequence[str]) -> None:
    """Start the queue read `hai ARGS` makes first (first_read), where it reads with Slurm's
    commands; once per process (squeue.start_ahead)."""
    first = first_read(args)
    if first is not None:
        from ..slurm import config_missing, reads_with_commands, squeue  # lazy: +9 ms to hai

        if reads_with_commands() and not config_missing():
            squeue.start_ahead(*first)


def first_read(args: Sequence[str]) -> tuple[tuple[int, ...], str | None] | None:
    """What `hai ARGS` asks the queue first, from its arguments alone, as backend.jobs()'s
    (job ids, user): `list` your jobs, `list --all` everyone's, `status JOB` and `logs JOB`
    that job; None for any other command or arguments (nothing is read ahead). `list --all`
    reads your jobs alone where the policy daemon answers for everyone else's (cli/user.py)."""
    words = [a for a in args if a != "--json"]
    if words == ["list"]:
        return (), current_user()
    if words == ["list", "--all"]:
        return (), current_user() if daemon_service() else None
    if len(words) == 2 and words[0] in ("status", "logs") and words[1].isascii() and words[1].isdigit():
        return (int(words[1]),), None
    return None


def daemon_service() -> str:
    """The policy daemon's service the policy names, "" when none (or when the policy cannot be
    read: the command says why when it needs the policy)."""
    from ..policy.model import PolicyError, find_policy  # lazy: +20 ms to hai

    try:
        return find_policy().daemon_service or ""
    except PolicyError:
        return ""


def current_user() -> str:
    return _user_name(os.getuid())


@functools.lru_cache(maxsize=8)
def _user_name(uid: int) -> str:  # asked once per job by `hai list`: NSS may be a network call

    return pwd.getpwuid(uid).pw_name
