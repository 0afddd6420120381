"""The batch script of one part of an elastic job in place (`hai-submit --in-place`;
docs/elastic-in-place.md): one task of the job's array, one node.

    python -m slurm_hai.runtime.part_task --job-dir=ROOT/$SLURM_ARRAY_JOB_ID -- CMD...

The job directory is the array's, shared by its parts; events carry the part (the task id)
and its run (the task's restart count). The part runs as a job step, so that Slurm's
preemption signals it (not this script): it dies of the notice (runtime/parts.py,
`leave_on`), and its task is requeued: by Slurm as this script ends (24.05 and later), or
by this script (before 24.05 Slurm would end it FAILED). The first part that ends its
training writes the job's end (final.json); a task that starts after that runs nothing.
"""

from __future__ import annotations

import argparse
import os
import signal

from ..jobs.jobdir import JobDir
from ..slurm import SlurmError, backend
from .batch import wait_to_be_requeued
from .contract import restart_count
from .parts import job_and_part


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m slurm_hai.runtime.part_task")
    ap.add_argument("--job-dir", required=True)
    ap.add_argument("--gpus", type=int, default=0)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    _, part = job_and_part(os.environ)
    run = restart_count(os.environ)
    token = os.environ.get("HAI_SUBMIT_TOKEN")
    jobdir = JobDir(args.job_dir).claim(token) if token else JobDir(args.job_dir).create()
    final = jobdir.final()
    if final:
        print(f"slurm-hai: part {part}: the job already ended ({final['state']}); not running it again", flush=True)
        jobdir.event("rerun_skipped", run=run, part=part, final=final["state"])
        return 0
    node = os.environ.get("SLURM_JOB_NODELIST", "")
    jobdir.event("start", run=run, part=part, nodes=node, size=1, host=os.uname().nodename)
    print(f"slurm-hai: part {part} run {run} on {node}", flush=True)
    ending: list[int] = []
    signal.signal(signal.SIGTERM, lambda s, f: ending.append(s))  # Slurm ends the task: its step gets it too
    slurm = backend()
    rc = slurm.run_step(cmd, 1, args.gpus, os.environ.get("SLURM_JOB_NAME", "hai"))
    if rc == 0:
        if jobdir.final() is None:
            jobdir.set_final("succeeded", 0)
            jobdir.event("finished", run=run, part=part, state="succeeded", exit_code=0)
        return 0
    job_id = int(os.environ["SLURM_JOB_ID"])
    preempted = _preempted(slurm, job_id)
    jobdir.event("left", run=run, part=part, exit_code=rc, preempted=preempted)
    print(f"slurm-hai: part {part} run {run} ended (exit {rc}{', preempted' if preempted else ''}); "
          "the other parts train on", flush=True)
    if not preempted:
        return rc  # its own failure: the task ends, the other parts go on
    try:
        if slurm.requeued_when_batch_ends(job_id):
            return rc
        slurm.requeue(job_id)
    except SlurmError as e:  # slurmctld away: the policy daemon requeues it (requeue-failed)
        print(f"slurm-hai: part {part}: requeue: {e}", flush=True)
        return rc
    return wait_to_be_requeued(ending)


def _preempted(slurm, job_id: int) -> bool:
    """Whether Slurm chose this task's run for preemption (its notice)."""
    try:
        job = slurm.job(job_id)
    except SlurmError:
        return False
    return job is not None and job.start_time > 0 and job.preempt_time >= job.start_time


if __name__ == "__main__":
    raise SystemExit(main())
