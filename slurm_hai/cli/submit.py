"""hai-submit: submit a training script as a HAI job (priority level, nodes, suspend protocol)."""

from __future__ import annotations

import sys
import time

import click

from .. import __version__
from ..jobs.jobdir import default_root
from ..jobs.request import JobRequest, RequestError
from ..jobs.submit import dry_run_report, prepare, submit
from ..policy.model import PolicyError, find_policy
from ..policy.sizes import NodeRange
from .common import Command, Refused, backend, emit_json, no_config_hint, one_line_errors, parse_priority


def script_args(args: tuple[str, ...]) -> list[str]:
    """The script's own arguments: as given, less one `--` right after SCRIPT (the older
    `hai-submit train.py -- --lr 0.1` form)."""
    return list(args[1:] if args[:1] == ("--",) else args)


def _node_range(ctx, param, value: str) -> str:
    try:
        NodeRange.parse(value, "")
    except ValueError as e:
        raise click.BadParameter(str(e).lstrip()) from None
    return value


@click.command(cls=Command, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100,
                                 "allow_interspersed_args": False})
@click.version_option(__version__, "--version", prog_name="hai-submit", message="%(prog)s (slurm-hai) %(version)s")
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--name", help="Job name (letters, digits, . _ -). Default: the script's name.")
@click.option("-n", "--nodes", default="1", show_default=True, metavar="N|MIN:MAX[:STEP]", callback=_node_range,
              help="Number of nodes (whole nodes). A range makes the job elastic: it starts once MIN nodes "
                   "are free, on as many as it may up to MAX (in steps of STEP), and its size may change "
                   "between runs. Slurm's MIN-MAX works too.")
@click.option("-p", "--priority", default=None, show_default="the policy's default_level",
              help="Level name or number of the cluster's ladder (`hai-admin check` lists it; HAI's is "
                   "EXTREME_HIGH 50 ... LOW 0), or AUTO: the highest level where you still have quota.")
@click.option("--gpus-per-node", type=int, default=None,
              help="GPUs per node. Default: what the nodes of the job's group have (0 where they have none).")
@click.option("-g", "--group", help="Node group (Slurm partition). Default: the cluster's default group.")
@click.option("-e", "env", multiple=True, metavar="KEY=VALUE", help="Environment variable for the job (repeatable).")
@click.option("--time", "time_limit", metavar="TIME",
              help="Time limit per run (MINUTES, HH:MM:SS, D-HH:MM:SS). Near the limit the job gets the "
                   "suspend notice and continues in a new run.")
@click.option("--grace", type=int, default=None, show_default="the policy's grace_seconds",
              help="Seconds between the suspend notice and a forced suspend, at most the policy's "
                   "max_grace_seconds.")
@click.option("--retries", type=int, default=0, show_default=True,
              help="Times a failed run (non-zero exit) is started again.")
@click.option("--workdir", default=".", show_default=True, help="Working directory of the job.")
@click.option("--python", "python", default=sys.executable, show_default="this interpreter",
              help="Interpreter for a .py SCRIPT.")
@click.option("--torchrun", is_flag=True,
              help="Run SCRIPT (.py) with torchrun, once per node: one process per GPU (1 on CPU nodes), "
                   "RANK/LOCAL_RANK/WORLD_SIZE as torchrun sets them; every process of node 0 gets the "
                   "suspend notice.")
@click.option("--in-place", "in_place", is_flag=True,
              help="With -n MIN:MAX: run the job as MAX parts, one per node (a job array), that leave and "
                   "rejoin one by one when a higher level needs some of their nodes, while the others train "
                   "on (SCRIPT uses slurm_hai.runtime.parts; docs/elastic-in-place.md). Needs the cluster's "
                   "lighthouse service.")
@click.option("-f", "--follow", is_flag=True, help="After submitting, stream the logs of rank 0 until the job ends (exit 1 unless it succeeded).")
@click.option("--dry-run", is_flag=True, help="Print the rendered sbatch script; submit nothing.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the result as JSON (with --dry-run: the checked request, its script and warnings).")
@one_line_errors
def main(script, args, name, nodes, priority, gpus_per_node, group, env, time_limit, grace, retries, workdir,
         python, torchrun, in_place, follow, dry_run, as_json):
    """Submit SCRIPT (with ARGS) as a HAI job.

    Options come before SCRIPT; everything after SCRIPT is passed to it unchanged, as
    with `sbatch script args` (a `--` right after SCRIPT is dropped).

    The job runs SCRIPT once on every node (RANK = node rank, WORLD_SIZE = nodes,
    MASTER_IP/MASTER_PORT of rank 0); start one process per GPU with
    slurm_hai.spawn. With --torchrun, torchrun runs once per node and starts them
    (RANK, LOCAL_RANK and WORLD_SIZE then count processes, as torchrun sets them).
    When a higher level needs the nodes, receive_suspend_command() turns True on rank
    0's node: commit a checkpoint and call go_suspend(). The job is requeued and later
    runs SCRIPT again from the start (resume from your checkpoint). Logs of every run:
    `hai logs JOB`.

    \b
    Examples:
      hai-submit -n 2 -p HIGH train.py --lr 0.1
      hai-submit -n 2:4 -p LOW train.py
      hai-submit --dry-run -p LOW --time 2:00:00 train.py
      hai-submit --torchrun -n 2 -p LOW examples/torchrun_train.py --steps 300
    """
    args = script_args(args)

    try:
        policy = find_policy()
    except PolicyError as e:
        raise Refused(f"the cluster's policy cannot be read: {e}") from None
    parse_priority(priority, policy)  # a near miss gets a suggestion before anything else is checked
    req = JobRequest(script=script, args=args, name=name, nodes=nodes, priority=priority,
                     gpus_per_node=gpus_per_node, group=group, env=list(env), time=time_limit, grace=grace,
                     retries=retries, workdir=workdir, python=python, job_root=str(default_root()),
                     torchrun=torchrun, in_place=in_place)
    slurm = backend()
    try:
        prepared = prepare(req, slurm, policy, dry_run, home=default_root().parent)
        if prepared.slurm_unreachable:
            why = no_config_hint(prepared.slurm_unreachable) or prepared.slurm_unreachable
            click.echo(f"hai-submit: cannot ask Slurm about the node group ({why}); assuming "
                       f"{prepared.context['gpus']} GPUs per node", err=True)
        for warning in prepared.warnings:
            click.echo(warning, err=True)
        if dry_run:
            if as_json:
                emit_json(dry_run_report(prepared))
            else:
                click.echo(prepared.script, nl=False)
            return
        job = submit(prepared, slurm, default_root())
    except RequestError as e:
        raise Refused(str(e)) from None
    if as_json:
        emit_json({"job_id": job.job_id, "name": job.name, "level": job.level, "nodes": job.nodes,
                   "node_range": job.node_range,
                   "job_dir": str(job.job_dir)})
    else:
        click.echo(f"Submitted job {job.job_id} ({job.name}: {job.node_range} node(s) at {job.level}); "
                   f"follow it with `hai logs -f {job.job_id}`")
    if follow:
        from .user import follow_logs  # lazy: +6 ms to every hai-submit

        time.sleep(0.5)
        follow_logs(job.job_id, rank=0, restart=None)
