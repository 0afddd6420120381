"""What a login node's warm-start service preloads for `hai` and `hai-submit` (`hai-admin
warm-start --preload slurm_hai.cli.preload`; contrib/systemd/slurm-hai-commands.service): the
two commands, the modules they import on first use (jinja2 and the Slurm commands backend),
and the job templates compiled. A command forked from the service then imports and compiles
nothing of its own (tests/unit/test_front.py checks it); a template changed on disk since is
compiled again by the command that renders it (jinja2 looks at its file each time).

`started` runs in each child the service forks, once it is the client's process: `hai`'s
first queue read starts there, before the command's own start (runtime/warm_service.py)."""

import difflib  # noqa: F401  (a near miss's suggestion)

import click._textwrap  # noqa: F401  (--help's text, wrapped)

from .. import render
from ..jobs.request import JOB_TEMPLATE, PARTS_TEMPLATE
from ..slurm import cli, commands, pyslurm_backend, version  # noqa: F401  (the backend a command picks)
from . import submit, user  # noqa: F401
from .front import start_first_read

for _template in (JOB_TEMPLATE, PARTS_TEMPLATE):
    render.environment().get_template(_template)


def started(argv: list[str]) -> None:
    """In a child of the service, as its client's process: `python -m slurm_hai.cli hai ARGS`
    starts the queue read that `hai ARGS` makes first."""
    if argv[:3] == ["-m", "slurm_hai.cli", "hai"]:
        start_first_read(argv[3:])
