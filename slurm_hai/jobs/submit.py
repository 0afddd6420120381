"""Submitting a job (the use case behind hai-submit): check the request against the files
and the node group, render the sbatch script, submit it, claim the job directory.

Every refusal is a RequestError whose message says what to do; nothing reaches Slurm
before the request is known to be sound.
"""

from __future__ import annotations

import getpass
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..policy.model import Policy
from ..slurm import Backend, SlurmError
from .clusterview import ClusterView, asked, cluster_view
from .jobdir import JobDir, write_atomic
from .request import (JobRequest, RequestError, check_files, check_group_name, did_you_mean, fit_to_group,
                      fit_to_partition, render_script, requested_nodes, parts_warning, single_process_warning, validate)


@dataclass
class Prepared:
    """A checked request: the template context, the sbatch script, warnings to show, and
    (dry run only) why Slurm could not be asked about the node group."""

    context: dict
    script: str
    token: str
    warnings: list[str]
    slurm_unreachable: str = ""


# What a job asked for, as job.json records it and `hai-submit --dry-run --json` shows it.
# `parts`: an elastic job in place runs MAX parts, one per node (null for any other job).
REQUEST_FIELDS = ("name", "nodes", "node_range", "parts", "gpus", "level", "partition", "time", "grace", "retries",
                  "workdir", "command")


@dataclass
class Submitted:
    job_id: int
    name: str
    level: str
    nodes: int  # the fewest it runs on
    node_range: str  # N, or MIN:MAX[:STEP] for an elastic job
    job_dir: Path


def group_gpus(view: ClusterView, req: JobRequest) -> tuple[str, int]:
    """The job's node group (Slurm's partition) and --gpus-per-node fitted to it: the default
    is what its nodes have; a request its nodes or its limits (MaxNodes, MinNodes, MaxTime)
    can never satisfy is refused, in our words."""
    check_group_name(req.group)
    parts = view.partitions
    name = req.group or next((p["PartitionName"] for p in parts if p.get("Default") == "YES"), None)
    if name is None:
        raise RequestError("this cluster has no default node group; pass -g GROUP")
    known = [p["PartitionName"] for p in parts]
    if name not in known:
        raise RequestError(f"-g {name}: no such node group; {did_you_mean(name, known)}groups: {', '.join(known)}")
    nodes = requested_nodes(req)
    fit_to_partition(name, parts[known.index(name)], nodes, req.time)
    return name, fit_to_group(name, view.gpus.get(name, []), nodes, req.gpus_per_node)


def prepare(req: JobRequest, slurm: Backend, policy: Policy, dry_run: bool = False, home: Path | None = None
            ) -> Prepared:
    """Check `req` (files, node group, every value, the cluster's `policy`) and render its
    sbatch script. With `home` (the user's HAI_HOME), what Slurm said of the cluster is kept
    there for the next submissions (jobs/clusterview.py); a dry run asks each time."""
    check_files(req)
    unreachable, group, view = "", req.group, None
    try:
        view = asked(slurm, notice=not dry_run) if dry_run or home is None else cluster_view(slurm, home)
        try:
            group, req.gpus_per_node = group_gpus(view, req)
        except RequestError:
            if not view.kept or home is None:
                raise
            view = cluster_view(slurm, home, fresh=True)  # never refused on a kept view: on what Slurm says now
            group, req.gpus_per_node = group_gpus(view, req)
    except SlurmError as e:
        if not dry_run:
            raise
        # a dry run assumes what was asked, else what the group must have
        unreachable = str(e)
        req.gpus_per_node = req.gpus_per_node if req.gpus_per_node is not None else policy.min_gpus_for(group)
    context = validate(req, policy)
    # HAI's 8-GPU rule; job_submit.lua refuses plain sbatch with the same words
    short = policy.min_gpus_refusal(group, req.gpus_per_node)
    if short:
        raise RequestError(short)
    warnings = [w for w in (single_process_warning(req), parts_warning(req)) if w]
    # Ties this submission to its job directory, so a directory left by an older job with
    # the same id is never taken for this job's (JobDir.claim).
    token = os.urandom(8).hex()
    context["env"] = [*context["env"], ("HAI_SUBMIT_TOKEN", token)]
    # Without send_user_signal, Slurm's preemption notice is SIGTERM.
    term_is_notice = view is not None and view.user_signal is False
    return Prepared(context, render_script(context, term_is_notice=term_is_notice), token, warnings, unreachable)


def dry_run_report(prepared: Prepared) -> dict:
    """What `hai-submit --dry-run --json` prints: the request as job.json would record it,
    the QOS it goes to Slurm with, the sbatch script, the warnings, and why Slurm could not
    be asked about the node group (null when it could)."""
    ctx = prepared.context
    return {"dry_run": True, **{k: ctx[k] for k in REQUEST_FIELDS}, "qos": ctx["qos"], "script": prepared.script,
            "warnings": prepared.warnings, "slurm_unreachable": prepared.slurm_unreachable or None}


def submit(prepared: Prepared, slurm: Backend, root: Path) -> Submitted:
    """sbatch the prepared script, claim its job directory, record the request."""
    ctx = prepared.context
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        job_id = slurm.submit(prepared.script)
    except SlurmError as e:
        policy_refusal = str(e).split("sbatch: hai: ", 1)
        if len(policy_refusal) == 2:  # job_submit.lua's own words (quota, level): nothing to add
            raise RequestError(policy_refusal[1]) from None
        if "Invalid account or account/partition combination" in str(e):
            user = getpass.getuser()
            group = f" that may use node group {ctx['partition']}" if ctx.get("partition") else ""
            raise RequestError(f"Slurm's accounting has no account for {user}{group}: "
                               f"an administrator adds one (`sacctmgr add user {user} account=ACCOUNT`, "
                               "docs/admin-guide.md, \"Adding a user\")") from None
        if "Requested node configuration is not available" in str(e):
            raise RequestError(f"no node of the job's group can run it ({ctx['node_range']} node(s), {ctx['gpus']} GPUs "
                               "each); `scontrol show partition` lists the groups") from None
        raise
    jobdir = JobDir.for_job(job_id, root).claim(prepared.token)
    request = {k: ctx[k] for k in REQUEST_FIELDS}
    # the request as asked, for `hai status`: Slurm has the job, and a reader takes a missing or
    # cut job.json as none (JobDir.request), so a power loss right after may lose it, no fsync
    write_atomic(jobdir.path / "job.json", json.dumps({**request, "job_id": job_id, "user": getpass.getuser()}),
                 durable=False)
    jobdir.event("submit", level=ctx["level"], nodes=ctx["nodes"], node_range=ctx["node_range"])
    return Submitted(job_id, ctx["name"], ctx["level"], ctx["nodes"], ctx["node_range"], jobdir.path)
