"""What a login node's warm-start service preloads for `hai` and `hai-submit` (`hai-admin
warm-start --preload slurm_hai.cli.preload`; contrib/systemd/slurm-hai-commands.service): the
two commands, the modules they import on first use (jinja2, the Slurm commands backend, and
runtime/warm.py, whose socket path a job's script names),
the job templates compiled, each command's options parsed once (click's parser, and the abc
and gettext lookups it makes: cached here, not in every child) and this host's policy read
(`find_policy` keeps it while its file is unchanged and readable). A command forked from the
service then imports and compiles nothing of its own (tests/unit/test_front.py checks it); a
template changed on disk since is compiled again by the command that renders it (jinja2 looks
at its file each time), a policy changed since read again.

`started` runs in each child the service forks, once it is the client's process: `hai`'s
first queue read starts there, before the command's own start (runtime/warm_service.py).
`reusable` tells a child that ran `hai` or `hai-submit` that it may run its user's next command
(the service checks the rest: nothing left running or open, the same user, environment and
directory)."""

import difflib  # noqa: F401  (a near miss's suggestion)
import sys

import click._textwrap  # noqa: F401  (--help's text, wrapped)

from .. import render
from ..jobs.request import JOB_TEMPLATE, PARTS_TEMPLATE
from ..policy.model import PolicyError, find_policy
from ..runtime import warm  # noqa: F401  (render_script names its DEFAULT_SOCKET)
from ..slurm import cli, commands, pyslurm_backend, squeue, version  # noqa: F401  (the backend a command picks)
from . import submit, user  # noqa: F401
from .front import COMMANDS, start_first_read

for _template in (JOB_TEMPLATE, PARTS_TEMPLATE):
    render.environment().get_template(_template)
for _command, (_module, _name) in COMMANDS.items():
    getattr(sys.modules[_module], _name).make_context(_command, [], resilient_parsing=True)
try:
    find_policy()
except PolicyError:
    pass  # each command says why, when it needs the policy


def started(argv: list[str]) -> None:
    """In a child of the service, as its client's process: `python -m slurm_hai.cli hai ARGS`
    starts the queue read that `hai ARGS` makes first."""
    if argv[:3] == ["-m", "slurm_hai.cli", "hai"]:
        start_first_read(argv[3:])


def reusable(argv: list[str]) -> bool:
    """In a child of the service after its command: whether it may run its user's next one.
    `hai` and `hai-submit` may, where no queue read started ahead waits to be taken."""
    return argv[:2] == ["-m", "slurm_hai.cli"] and squeue.nothing_ahead()
