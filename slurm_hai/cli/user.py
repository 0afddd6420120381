"""hai: follow and control your HAI jobs (status, list, logs, stop, suspend, ckpt, run-local)."""

from __future__ import annotations

import os
import re
import sys
import time

import click

from ..jobstate import status as hai_status
from ..slurm import backend
from .ckpt import ckpt
from .common import check_owner, emit_json, job_id_arg, lookup, one_line_errors, table

RUN_MARK = re.compile(r"^==== slurm-hai run (\d+) ")
TERMINAL = ("finished-succeeded", "finished-failed", "finished-stopped")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def main():
    """Follow and control HAI jobs submitted with hai-submit.

    \b
    States: waiting (not started yet), running, suspended (requeued, will run again),
    finished-succeeded, finished-failed, finished-stopped.
    """


def _status_of(job_id: int, queue: list | None = None):
    """The HAI status of one job; `queue` (every job Slurm knows) lets the policy explain it."""
    from ..policy import find_policy
    from ..scheduling import explain

    job, jobdir = lookup(job_id)
    events = jobdir.events()
    runs = sum(1 for e in events if e.get("event") == "suspended")
    last_run = max((int(e.get("run", 0)) for e in events if e.get("event") == "start"), default=0)
    explained = None
    if job is not None and job.state in ("PENDING", "RUNNING"):
        explained = explain(job, queue if queue is not None else backend().jobs(), find_policy())
    return hai_status(job_id, job, jobdir.final(), jobdir.request(), runs, explained, last_run), job, jobdir


@main.command()
@click.argument("job", callback=lambda c, p, v: job_id_arg(v) if v else None, required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@one_line_errors
def status(job, as_json):
    """Show the HAI state of JOB (or of all your jobs), with the reason in words."""
    if job is None:
        return _list(all_users=False, as_json=as_json)
    st, _, jobdir = _status_of(job)
    if as_json:
        emit_json(st.as_dict() | {"job_dir": str(jobdir.path)})
        return
    for key, value in st.as_dict().items():
        click.echo(f"{key.replace('_', ' '):<10} {'-' if value in (None, '') else value}")


def _list(all_users: bool, as_json: bool) -> None:
    import getpass

    queue = backend().jobs()
    me = getpass.getuser()
    rows = [_status_of(j.job_id, queue)[0] for j in sorted(queue, key=lambda j: j.job_id)
            if all_users or j.user == me]
    if as_json:
        emit_json([r.as_dict() for r in rows])
        return
    click.echo(table(["JOB", "NAME", "USER", "STATE", "LEVEL", "NODES", "RESTARTS", "REASON"],
                     [[r.job_id, r.name, r.user, r.state, r.level, r.nodes, r.restarts, r.reason] for r in rows]))


@main.command(name="list")
@click.option("--all", "all_users", is_flag=True, help="Jobs of every user, not only yours.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@one_line_errors
def list_jobs(all_users, as_json):
    """List your jobs that Slurm still knows (running, waiting, suspended, recently ended)."""
    _list(all_users, as_json)


def split_runs(text: str) -> list[tuple[int, str]]:
    """Cut a rank log into (run, text) pieces at the run marker lines."""
    runs: list[tuple[int, list[str]]] = []
    for line in text.splitlines(keepends=True):
        m = RUN_MARK.match(line)
        if m:
            runs.append((int(m.group(1)), [line]))
        elif runs:
            runs[-1][1].append(line)
        else:
            runs.append((0, [line]))
    return [(k, "".join(lines)) for k, lines in runs]


def follow_logs(job_id: int, rank: int, restart: int | None) -> None:
    """Print the rank's log and keep printing as it grows, across suspensions, until the end."""
    _, jobdir = lookup(job_id)
    path = jobdir.rank_log(rank)
    offset = 0
    while True:
        if path.exists():
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            if chunk:
                offset += len(chunk)
                text = chunk.decode(errors="replace")
                if restart is not None:
                    text = "".join(t for k, t in split_runs(text) if k == restart)
                sys.stdout.write(text)
                sys.stdout.flush()
        st, _, _ = _status_of(job_id)
        if st.state in TERMINAL or st.state == "unknown":
            click.echo(f"---- job {job_id} {st.state}", err=True)
            return
        time.sleep(0.5)


@main.command()
@click.argument("job", callback=lambda c, p, v: job_id_arg(v))
@click.option("-f", "--follow", is_flag=True, help="Keep printing new output, across suspensions, until the job ends.")
@click.option("--rank", type=int, default=0, show_default=True, help="Node rank whose output to show.")
@click.option("--restart", type=int, help="Only this run (0 = the first, 1 = after the first restart, ...).")
@one_line_errors
def logs(job, follow, rank, restart):
    """Print the output of JOB on node RANK: every run, in order, each opened by a
    '==== slurm-hai run K' line."""
    _, jobdir = lookup(job)
    path = jobdir.rank_log(rank)
    if follow:
        return follow_logs(job, rank, restart)
    if not path.exists():
        raise click.ClickException(f"no output yet for job {job} rank {rank} ({path})")
    runs = split_runs(path.read_text(errors="replace"))
    if restart is not None:
        runs = [r for r in runs if r[0] == restart]
        if not runs:
            raise click.ClickException(f"job {job} has no run {restart} on rank {rank}")
    sys.stdout.write("".join(text for _, text in runs))


@main.command()
@click.argument("job", callback=lambda c, p, v: job_id_arg(v))
@one_line_errors
def stop(job):
    """Stop JOB for good: it is cancelled and never restarted."""
    info, jobdir = lookup(job)
    check_owner(info, "stop")
    backend().cancel(job)
    if jobdir.path.is_dir():
        jobdir.set_final("stopped", 0, reason="stopped by its user")
        jobdir.event("stop", by=os.getuid())
    click.echo(f"job {job} stopped")


@main.command()
@click.argument("job", callback=lambda c, p, v: job_id_arg(v))
@one_line_errors
def suspend(job):
    """Suspend JOB gracefully: rank 0 gets the suspend notice, the job commits, calls
    go_suspend() (or is suspended by force after its grace time) and is requeued."""
    info, jobdir = lookup(job)
    check_owner(info, "suspend")
    if info is None or info.state != "RUNNING":
        raise click.ClickException(f"job {job} is not running ({info.state if info else 'unknown to Slurm'}); "
                                   "only a running job can be suspended")
    backend().cancel(job, signal="USR2")  # to the job's steps only; Slurm checks ownership
    jobdir.event("suspend_requested", by=os.getuid())
    click.echo(f"suspend notice sent to job {job}")


main.add_command(ckpt)


@main.command(name="run-local", context_settings={"ignore_unknown_options": True})
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--suspend-after", type=float, default=10, show_default=True,
              help="Seconds into each run when the suspend notice arrives.")
@click.option("--restarts", type=int, default=1, show_default=True, help="How many times to suspend and restart.")
@click.option("--grace", type=float, default=5, show_default=True, help="Seconds before a forced suspend.")
@click.option("--python", "python", default=sys.executable, show_default="this interpreter")
@click.option("--job-dir", type=click.Path(file_okay=False), help="State directory (default: a new temporary one).")
@one_line_errors
def run_local(script, args, suspend_after, restarts, grace, python, job_dir):
    """Run SCRIPT here, without Slurm, as a one-node job that gets the suspend notice
    after --suspend-after seconds and is restarted, to test resume logic locally."""
    from ..simulate import simulate

    cmd = [python, script, *args] if script.endswith(".py") else [script, *args]
    rc = simulate(cmd, suspend_after=suspend_after, restarts=restarts, grace=grace, job_dir=job_dir)
    sys.exit(rc)
