"""docs/reference.md, written from the commands themselves: every command and subcommand of
`hai`, `hai-submit` and `hai-admin`, with its --help as the command prints it (so the
reference cannot drift: tests/unit/test_docs.py compares the two).

    python -m slurm_hai.cli.reference > docs/reference.md      (make docs)
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import click

# the front ends, as pyproject.toml's [project.scripts] name them
FRONT_ENDS = (("hai-submit", "slurm_hai.cli.submit"), ("hai", "slurm_hai.cli.user"), ("hai-admin", "slurm_hai.cli.admin"))
WIDTH = 100  # the help's width, fixed: not the terminal's of whoever generates it


def commands() -> Iterator[tuple[str, click.Command, click.Context]]:
    """(`hai status`, its command, its context) for every front end and subcommand, in order."""
    for name, module in FRONT_ENDS:
        top: click.Command = importlib.import_module(module).main
        yield from _walk(name, top, None)


def _walk(path: str, command: click.Command, parent: click.Context | None) -> Iterator[tuple[str, click.Command,
                                                                                             click.Context]]:
    ctx = click.Context(command, info_name=path.rsplit(" ", 1)[-1], parent=parent, terminal_width=WIDTH,
                        max_content_width=WIDTH)
    yield path, command, ctx
    if isinstance(command, click.Group):
        for sub in command.list_commands(ctx):
            child = command.get_command(ctx, sub)
            if child is not None and not child.hidden:
                yield from _walk(f"{path} {sub}", child, ctx)


def reference() -> str:
    out = ["# Command reference",
           "",
           "Every command and option of `hai-submit`, `hai` and `hai-admin`, as their `--help` prints it.",
           "Written by `make docs` (`python -m slurm_hai.cli.reference`) from the commands themselves;",
           "the guides explain them ([user-guide.md](user-guide.md), [admin-guide.md](admin-guide.md)).",
           ""]
    for path, command, ctx in commands():
        out += [f"## `{path}`", "", "```", command.get_help(ctx).rstrip(), "```", ""]
    return "\n".join(out)


if __name__ == "__main__":
    print(reference(), end="")
