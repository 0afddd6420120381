"""hai-submit: submit a training script as a HAI job (priority level, nodes, suspend protocol)."""

from __future__ import annotations

import getpass
import json
import secrets
import sys
import time

import click

from .. import __version__
from ..jobs.jobdir import JobDir, default_root, write_atomic
from ..policy.levels import AUTO
from ..slurm import SlurmError
from ..jobs.request import (JobRequest, RequestError, check_files, fit_to_group, render_script,
                      single_process_warning, validate)
from .common import Refused, backend, did_you_mean, no_config_hint, emit_json, one_line_errors, parse_priority


def term_is_notice(slurm) -> bool:
    """Without send_user_signal, Slurm's preemption notice is SIGTERM."""
    return not slurm.preempt_sends_user_signal()


# Everything after SCRIPT belongs to the script, as with `sbatch script args`: option
# parsing stops at the first positional argument.
def group_gpus(slurm, group: str | None, nodes: int, gpus_per_node: int | None, dry_run: bool) -> int:
    """--gpus-per-node fitted to the job's node group (Slurm's partition): the default is
    what its nodes have; a request they can never satisfy is refused here, in our words."""
    try:
        parts = slurm.partitions()
        name = group or next((p["PartitionName"] for p in parts if p.get("Default") == "YES"), None)
        if name is None:
            raise Refused("this cluster has no default node group; pass -g GROUP")
        if name not in {p["PartitionName"] for p in parts}:
            known = [p["PartitionName"] for p in parts]
            raise Refused(f"-g {name}: no such node group; {did_you_mean(name, known)}"
                          f"groups: {', '.join(known)}")
        return fit_to_group(name, {n.name: (n.gpus, n.partitions) for n in slurm.nodes()}, nodes, gpus_per_node)
    except RequestError as e:
        raise Refused(str(e)) from None
    except SlurmError as e:
        if not dry_run:
            raise
        click.echo(f"hai-submit: cannot ask Slurm about the node group ({no_config_hint(str(e)) or e}); assuming "
                   f"{gpus_per_node or 0} GPUs per node", err=True)
        return gpus_per_node or 0


def script_args(args: tuple[str, ...]) -> list[str]:
    """The script's own arguments: as given, less one `--` right after SCRIPT (the older
    `hai-submit train.py -- --lr 0.1` form)."""
    return list(args[1:] if args[:1] == ("--",) else args)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100,
                                 "allow_interspersed_args": False})
@click.version_option(__version__, "--version", prog_name="hai-submit", message="%(prog)s (slurm-hai) %(version)s")
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--name", help="Job name (letters, digits, . _ -). Default: the script's name.")
@click.option("-n", "--nodes", type=int, default=1, show_default=True, help="Number of nodes (whole nodes).")
@click.option("-p", "--priority", default="NORMAL", show_default=True,
              help="Level name or number (EXTREME_HIGH 50 ... LOW 0), or AUTO: the highest level "
                   "where you still have quota.")
@click.option("--gpus-per-node", type=int, default=None,
              help="GPUs per node. Default: what the nodes of the job's group have (0 where they have none).")
@click.option("-g", "--group", help="Node group (Slurm partition). Default: the cluster's default group.")
@click.option("-e", "env", multiple=True, metavar="KEY=VALUE", help="Environment variable for the job (repeatable).")
@click.option("--time", "time_limit", metavar="TIME",
              help="Time limit per run (MINUTES, HH:MM:SS, D-HH:MM:SS). Near the limit the job gets the "
                   "suspend notice and continues in a new run.")
@click.option("--grace", type=int, default=5, show_default=True,
              help="Seconds between the suspend notice and a forced suspend.")
@click.option("--retries", type=int, default=0, show_default=True,
              help="Times a failed run (non-zero exit) is started again.")
@click.option("--workdir", default=".", show_default=True, help="Working directory of the job.")
@click.option("--python", "python", default=sys.executable, show_default="this interpreter",
              help="Interpreter for a .py SCRIPT.")
@click.option("-f", "--follow", is_flag=True, help="After submitting, stream the logs of rank 0 until the job ends.")
@click.option("--dry-run", is_flag=True, help="Print the rendered sbatch script; submit nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@one_line_errors
def main(script, args, name, nodes, priority, gpus_per_node, group, env, time_limit, grace, retries, workdir,
         python, follow, dry_run, as_json):
    """Submit SCRIPT (with ARGS) as a HAI job.

    Options come before SCRIPT; everything after SCRIPT is passed to it unchanged, as
    with `sbatch script args` (a `--` right after SCRIPT is dropped).

    The job runs SCRIPT once on every node (RANK = node rank, WORLD_SIZE = nodes,
    MASTER_IP/MASTER_PORT of rank 0); start one process per GPU with
    slurm_hai.spawn. When a higher level needs the nodes, rank 0's
    receive_suspend_command() turns True: commit a checkpoint and call go_suspend(). The
    job is requeued and later runs SCRIPT again from the start (resume from your
    checkpoint). Logs of every run: `hai logs JOB`.

    \b
    Examples:
      hai-submit -n 2 -p HIGH train.py --lr 0.1
      hai-submit --dry-run -p LOW --time 2:00:00 train.py
    """
    args = script_args(args)
    slurm = backend()
    root = default_root()
    level = parse_priority(priority)
    req = JobRequest(script=script, args=args, name=name, nodes=nodes, priority=priority,
                     gpus_per_node=gpus_per_node, group=group, env=list(env), time=time_limit, grace=grace,
                     retries=retries, workdir=workdir, python=python, job_root=str(root))
    try:
        check_files(req)
    except RequestError as e:
        raise Refused(str(e)) from None
    req.gpus_per_node = group_gpus(slurm, group, nodes, gpus_per_node, dry_run)
    if level == AUTO:
        from ..policy.rules import resolve_auto_for_user  # needs the policy and the live queue

        req.priority = resolve_auto_for_user(getpass.getuser(), nodes, slurm)
    try:
        context = validate(req)
    except RequestError as e:
        raise Refused(str(e)) from None
    warning = single_process_warning(req)
    if warning:
        click.echo(warning, err=True)
    # Ties this submission to its job directory, so a directory left by an older job with
    # the same id is never taken for this job's (JobDir.claim).
    token = secrets.token_hex(8)
    context["env"] = [*context["env"], ("HAI_SUBMIT_TOKEN", token)]
    text = render_script(context, term_is_notice=term_is_notice(slurm) if not dry_run else False)
    if dry_run:
        click.echo(text, nl=False)
        return
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        job_id = slurm.submit(text)
    except SlurmError as e:
        policy_refusal = str(e).split("sbatch: hai: ", 1)
        if len(policy_refusal) == 2:  # job_submit.lua's own words (quota, level): nothing to add
            raise Refused(policy_refusal[1]) from None
        if "Requested node configuration is not available" in str(e):
            raise Refused(f"no node of the job's group can run it ({nodes} node(s), {req.gpus_per_node} GPUs "
                          "each); `scontrol show partition` lists the groups") from None
        raise
    jobdir = JobDir.for_job(job_id, root).claim(token)
    request = {k: context[k] for k in ("name", "nodes", "gpus", "level", "partition", "time", "grace", "retries",
                                        "workdir", "command")}
    write_atomic(jobdir.path / "job.json", json.dumps({**request, "job_id": job_id, "user": getpass.getuser()}))
    jobdir.event("submit", level=context["level"], nodes=nodes)
    if as_json:
        emit_json({"job_id": job_id, "name": context["name"], "level": context["level"], "nodes": nodes,
                   "job_dir": str(jobdir.path)})
    else:
        click.echo(f"Submitted job {job_id} ({context['name']}: {nodes} node(s) at {context['level']}); "
                   f"follow it with `hai logs -f {job_id}`")
    if follow:
        from .user import follow_logs

        time.sleep(0.5)
        follow_logs(job_id, rank=0, restart=None)
