"""What the click front ends share: one-line errors, tables, JSON, finding a job's files."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from itertools import repeat
from pathlib import Path
from typing import Callable, Iterable, Sequence

import click

from ..jobs.jobdir import JobDir, default_root
from ..jobs.request import did_you_mean
from ..policy import placement
from ..slurm import SlurmError, config_missing
from ..slurm import backend as slurm_backend
from ..slurm.records import JobInfo
from .front import current_user


def timeline_options(fn: Callable) -> Callable:
    """The options of `hai timeline` and `hai-admin timeline`."""
    for option in reversed((
        click.option("--since", default="1h", show_default=True, metavar="WHEN",
                     help="Start of the window: 30m, 2h, 1d (ago), HH:MM (today) or YYYY-MM-DD[THH:MM]."),
        click.option("--until", metavar="WHEN", help="End of the window, same forms (default: now)."),
        click.option("--out", "-o", default="timeline.html", show_default=True, type=click.Path(dir_okay=False),
                     help="The HTML file to write."),
        click.option("--json", "as_json", is_flag=True, help="Print the timeline's data as JSON instead."))):
        fn = option(fn)
    return fn


def one_line_errors(fn: Callable) -> Callable:
    """Turn the errors a user can act on into `Error: ...` on one line, exit 1, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BrokenPipeError:
            raise  # output cut short by `head` or a pager: Command/Group end quietly
        except SlurmError as e:
            raise click.ClickException(no_config_hint(str(e)) or " ".join(str(e).split())) from None
        except (ValueError, OSError) as e:
            raise click.ClickException(" ".join(str(e).split())) from None

    return wrapper


# Output cut short by `head` or a pager (EPIPE): the exit status of a Unix tool killed by
# SIGPIPE, as the shell reports it for `cat` or `grep` (128 + 13), and not a word.
BROKEN_PIPE_EXIT = 141


class _FrontDoor:
    """What the three front ends (hai, hai-submit, hai-admin) do around click:
    - output cut short (EPIPE) ends quietly, exit BROKEN_PIPE_EXIT, whatever was printing
      (a command, --help, --version);
    - a usage error (a bad option value, a missing argument) is one line, exit 2, with
      where to look: `Error: Invalid value for '-n' / '--nodes': ... (see hai-submit --help)`."""

    def make_context(self, *args, **kwargs):
        with _front_door():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with _front_door():
            result = super().invoke(ctx)
            sys.stdout.flush()  # output still buffered cut short: here, not at the interpreter's exit
            return result


@contextlib.contextmanager
def _front_door():
    try:
        yield
    except BrokenPipeError:
        _quiet_streams()
        raise click.exceptions.Exit(BROKEN_PIPE_EXIT) from None
    except click.exceptions.NoArgsIsHelpError:  # `hai` alone: the help, as click prints it
        raise
    except click.UsageError as error:
        where = f" (see {error.ctx.command_path} --help)" if error.ctx is not None else ""
        raise Refused(" ".join(error.format_message().split()) + where) from None


def _quiet_streams() -> None:
    """Send what is still buffered for stdout and stderr to /dev/null: Python flushes them at
    exit, and a second EPIPE there would print `Exception ignored ...`."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):  # not a file (e.g. click's test runner)
            pass
    os.close(devnull)


class Command(_FrontDoor, click.Command):
    """A front end that is one command (hai-submit)."""


class Group(_FrontDoor, click.Group):
    """A front end with subcommands (hai, hai-admin)."""


class Refused(click.ClickException):
    """A request refused before anything reached Slurm: one line, exit 2 (like a usage error)."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))  # a user's value with a newline stays one line


def parse_priority(text: str | None, policy):
    """The level (or AUTO) of the user's -p in the cluster's `policy` (None: its default
    level), or Refused in the policy's words with a near match suggested, as the SPANK
    plugin's --hai-priority says it."""
    try:
        return placement.request_level(policy, text)
    except placement.Refused as e:
        raise Refused(f"{e}{placement.level_hint(policy, str(text))}") from None


# What Slurm's commands print when they find no configuration (no SLURM_CONF, no
# /etc/slurm/slurm.conf, and no configless DNS SRV record).
NO_CONFIG_SIGNS = ("Could not establish a configuration source", "fetch_config: DNS SRV lookup failed",
                   "resolve_ctls_from_dns_srv", "Unable to process configuration file")


def backend():
    """The Slurm backend, after a quick look for a Slurm configuration: a SLURM_CONF that
    names no file would make every Slurm command retry for 60 s before failing."""
    if config_missing():
        raise click.ClickException(no_config_hint("Could not establish a configuration source"))
    return slurm_backend()


LOCAL_CLUSTER_ENV = "/var/lib/slurm-hai/localcluster/etc/env"  # contrib/localcluster's default state directory


def no_config_hint(message: str) -> str:
    """One line in place of Slurm's DNS SRV errors when no Slurm configuration was found."""
    if not any(sign in message for sign in NO_CONFIG_SIGNS):
        return ""
    conf = os.environ.get("SLURM_CONF")
    where = f"SLURM_CONF={conf} does not point at a readable slurm.conf" if conf else (
        "SLURM_CONF is not set and there is no /etc/slurm/slurm.conf")
    local = LOCAL_CLUSTER_ENV if os.path.exists(LOCAL_CLUSTER_ENV) else ""  # this host runs the local test cluster
    return (f"no Slurm configuration found: {where}; ask your cluster's admin where its slurm.conf is and "
            "`export SLURM_CONF=/path/to/slurm.conf`"
            + (f" (slurm-hai's local test cluster on this host: source {local})" if local else ""))


def emit_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Columns two spaces apart, each as wide as its widest cell; None shows as "-"."""
    return table_of_columns(headers, list(zip(*rows)) or [() for _ in headers])


def table_of_columns(headers: Sequence[str], columns: Sequence[Iterable[object]]) -> str:
    """table() of its columns (the loops are map's, not Python's: a 10,000-row table stays fast)."""
    return table_of_texts(headers, column_texts(columns))


def column_texts(columns: Iterable[Iterable[object]]) -> list[list[str]]:
    """Each column's cells as a table shows them (None as "-")."""
    return [list(map(str, _dashed(list(column)))) for column in columns]


def table_of_texts(headers: Sequence[str], texts: Sequence[list[str]]) -> str:
    """table() of column_texts()."""
    cells = [[h, *text] for h, text in zip(headers, texts)]
    padded = [list(map(str.ljust, text, repeat(max(map(len, text))))) for text in cells[:-1]]
    return "\n".join(map(str.rstrip, map("  ".join, zip(*padded, cells[-1]))))


def _dashed(values: list) -> list:
    return ["-" if v is None else v for v in values] if None in values else values


def job_dir_of(job_id: int, job: JobInfo | None, own_root: Path | None = None) -> JobDir:
    """The job's state directory: from the job's comment (hai-dir=ROOT), else our own root
    (`own_root`: default_root(), found once by a caller with many jobs)."""
    root = job.tags.get("hai-dir") if job else None
    return JobDir.for_job(job_id, root or own_root or default_root())


def lookup(job_id: int, queue: Sequence[JobInfo] | None = None) -> tuple[JobInfo | None, JobDir]:
    """The job's Slurm record and its directory, or a one-line error when neither exists.
    The record comes from `queue` when the command has read the whole queue already, else
    from one squeue call for this job alone."""
    job = backend().job(job_id) if queue is None else next((j for j in queue if j.job_id == job_id), None)
    jobdir = job_dir_of(job_id, job)
    if job is None and not jobdir.path.is_dir():
        # slurmctld forgets a job MinJobAge after its end; slurmdbd still has it (sacct)
        unread = ""
        try:
            job = backend().accounting(job_id)
        except SlurmError as e:  # no accounting on this cluster, or slurmdbd is down: say which
            job, unread = None, f" (and {e})"
        if job is None:
            raise click.ClickException(f"no job {job_id}: Slurm does not know it and there is no {jobdir.path}; "
                                       f"see `hai list`{unread}")
        jobdir = job_dir_of(job_id, job)
    return job, jobdir


def check_owner(job: JobInfo | None, action: str) -> None:
    """Only the job's owner (or root / the SlurmUser) may act on it; Slurm checks again."""
    if job is not None and os.getuid() != 0 and job.user != current_user():
        raise click.ClickException(f"job {job.job_id} belongs to {job.user}; only its owner or root may {action} it")


def job_id_arg(value: str) -> int:
    if not value.isdigit():
        raise click.BadParameter(f"{value!r} is not a job id (a number, as printed by hai-submit)")
    return int(value)


__all__ = ["Command", "Group", "BROKEN_PIPE_EXIT", "one_line_errors", "emit_json", "table", "lookup", "check_owner",
           "job_id_arg", "Refused", "did_you_mean", "parse_priority", "no_config_hint", "current_user", "job_dir_of"]
