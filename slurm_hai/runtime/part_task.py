"""The batch script of one part of an elastic job in place (`hai-submit --in-place`;
docs/elastic-in-place.md): one task of the job's array, one node.

    python -m slurm_hai.runtime.part_task [--job-dir=ROOT/$SLURM_ARRAY_JOB_ID] -- CMD...

hai-submit's script sets everything; a plain sbatch script (docs/elastic-in-place.md) may
leave out the job directory (default: the user's job root, $HAI_HOME/jobs or ~/.hai/jobs,
and the array's id), the lighthouse service (HAI_LIGHTHOUSE_SERVICE, default the policy's
[elastic] lighthouse_service) and the job's MIN (HAI_PARTS_MIN, default the MIN of the
job's `hai-parts=MIN:MAX` comment, which it must carry: it makes the array one job).

The job directory is the array's, shared by its parts; events carry the part (the task id)
and its run (the task's restart count). The part runs as a job step, so that Slurm's
preemption signals it (not this script): it dies of the notice (runtime/parts.py,
`leave_on`), and its task is requeued: by Slurm as this script ends (24.05 and later), or
by this script (before 24.05 Slurm would end it FAILED). A part that leaves because fewer
than the job's MIN parts could train (runtime/parts.py, EXIT_BELOW_MIN) is requeued by this
script on every version, and so is one that leaves because its lighthouse cannot be reached
(EXIT_LIGHTHOUSE_LOST), as when this script finds the lighthouse lost. The part's output goes to the job's
rank log of its number (`logs/rank-<part>.log`: `hai logs JOB --rank P`). The first part that ends its
training writes the job's end (final.json) and cancels the parts that wait in the queue; a
task that starts after that runs nothing.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from ..jobs.jobdir import JobDir, default_root
from ..policy.limits import NOTICE_MARGIN
from ..policy.model import PolicyError, find_policy
from ..policy.placement import stamped_grace
from ..policy.tags import GRACE, PARTS, SUBMISSION, parse_parts
from ..slurm import SlurmError, backend
from .batch import run_over, slurm_record, wait_to_be_requeued
from ..policy.contract import restart_count
from .parts import (EXIT_BELOW_MIN, EXIT_LIGHTHOUSE_LOST, EXIT_TIME_LIMIT, LEAVE_AT_ENV, MIN_ENV, SERVICE_ENV,
                    TORCHFT_RUST_LOG, PartError, ask, job_and_part, min_parts)

# How often each part's task asks the lighthouse service whether the job's lighthouse lives.
LIGHTHOUSE_WATCH_EVERY = 2.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m slurm_hai.runtime.part_task")
    ap.add_argument("--job-dir", help="the job's directory, which its parts share (default: the user's job "
                    "root, $HAI_HOME/jobs or ~/.hai/jobs, and the array's id)")
    ap.add_argument("--gpus", type=int, default=0)
    ap.add_argument("--retries", type=int, default=0, help="how many times the job's parts may fail on their own "
                    "and be requeued, all parts together (hai-submit --retries)")
    ap.add_argument("--notice-seconds", type=int, help="with a time limit: how long before it the part is told, "
                    "commits the job's state and leaves, its task requeued (default: the job's grace, as job_submit.lua "
                    f"stamped it, else the policy's grace_seconds, + {NOTICE_MARGIN})")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    slurm = backend()
    job_id = int(os.environ.get("SLURM_JOB_ID", "0") or 0)
    try:
        array, part = job_and_part(os.environ)
        record = slurm_record(slurm, job_id)  # this task's: its MIN where not set, its time limit
        _settings(record, array)
        _set_leave_time(record, args.notice_seconds)
    except (PartError, PolicyError) as e:
        print(f"slurm-hai: {e}", file=sys.stderr, flush=True)
        return 2
    run = restart_count(os.environ)
    # this task, to requeue or signal it: its job id alone would be every task's when it is the
    # array's own (a task keeps the array's id), as seen: a part's requeue requeued them all
    task = f"{array}_{part}"
    # hai-submit's token, else (plain sbatch) job_submit.lua's mark of the submission: a
    # directory an older job with this id left (Slurm gives ids again after losing its state)
    # is moved aside, never read as this job's (its final.json would end every part at once)
    token = os.environ.get("HAI_SUBMIT_TOKEN") or (record.tags.get(SUBMISSION) if record else None)
    job_dir = args.job_dir or default_root() / str(array)
    jobdir = JobDir(job_dir).claim(token) if token else JobDir(job_dir).create()
    final = jobdir.final()
    if final:
        print(f"slurm-hai: part {part}: the job already ended ({final['state']}); not running it again", flush=True)
        jobdir.event("rerun_skipped", run=run, part=part, final=final["state"])
        return 0
    node = os.environ.get("SLURM_JOB_NODELIST", "")
    jobdir.event("start", run=run, part=part, nodes=node, size=1, host=os.uname().nodename)
    print(f"slurm-hai: part {part} run {run} on {node}; its output: {jobdir.rank_log(part)}", flush=True)
    _output_to_rank_log(jobdir, run, part)
    os.environ.setdefault("RUST_LOG", TORCHFT_RUST_LOG)  # torchft's INFO lines stay out of the part's log
    ending: list[int] = []
    signal.signal(signal.SIGTERM, lambda s, f: ending.append(s))  # Slurm ends the task: its step gets it too
    lost, done = threading.Event(), threading.Event()
    service = os.environ.get(SERVICE_ENV)
    if service:
        threading.Thread(target=_watch_lighthouse, args=(service, array, min_parts(), slurm, task, lost, done),
                         daemon=True).start()
    try:
        rc = slurm.run_step(cmd, 1, args.gpus,
                            os.environ.get("SLURM_JOB_NAME", "hai"))
    finally:
        done.set()
    if rc == 0:
        if jobdir.final() is None:
            jobdir.set_final("succeeded", 0)
            jobdir.event("finished", run=run, part=part, state="succeeded", exit_code=0)
        # Parts that left and wait for nodes would start only to find the job ended, and until
        # then hold its place in line (and could take a later job's nodes for it). Every part
        # that ends asks, before its own node is free for one of them.
        try:
            slurm.cancel_waiting_tasks(array)
        except SlurmError as e:
            print(f"slurm-hai: part {part}: the waiting parts of job {array} stay queued ({e}); "
                  "each ends at its start", flush=True)
        return 0
    if rc == EXIT_LIGHTHOUSE_LOST:  # the part found it so itself (the service may be away)
        lost.set()
    requeue = lost.is_set() or rc in (EXIT_BELOW_MIN, EXIT_TIME_LIMIT)  # not Slurm's preemption: Slurm would end it
    if lost.is_set():
        # every part of the job leaves so: they come back under a new lighthouse, and with no
        # live peer to heal from they resume from the job's last commit (runtime/parts.py)
        jobdir.event("left", run=run, part=part, exit_code=rc, preempted=False, lighthouse_lost=True)
        print(f"slurm-hai: part {part} run {run} ended (exit {rc}): the job's lighthouse was lost; "
              "its task is requeued", flush=True)
    elif rc == EXIT_TIME_LIMIT:
        # a run of its task ends before Slurm's limit would end the task for good: it comes
        # back with a whole limit, from a live peer or, when every part left so, the commit
        jobdir.event("left", run=run, part=part, exit_code=rc, preempted=False, time_limit=True)
        print(f"slurm-hai: part {part} run {run} ended at its task's time limit; its task is requeued", flush=True)
    elif rc == EXIT_BELOW_MIN:
        # every part that is left leaves so: the job waits in the queue for MIN nodes, as a job
        # suspended whole does, and resumes from the commit the parts made as they left
        jobdir.event("left", run=run, part=part, exit_code=rc, preempted=False, below_min=True)
        print(f"slurm-hai: part {part} run {run} ended: fewer than the job's MIN parts could train; "
              "its task is requeued", flush=True)
    else:
        record = slurm_record(slurm, job_id)  # read once: whether Slurm preempted the run, or ended it
        preempted = _preempted(record)
        jobdir.event("left", run=run, part=part, exit_code=rc, preempted=preempted)
        if preempted:
            print(f"slurm-hai: part {part} run {run} ended (exit {rc}, preempted): its task waits in the queue to "
                  "rejoin", flush=True)
        else:
            # its own failure (not Slurm ending the task: a cancel signals this script too, and
            # Slurm's record says so first): requeued while the job has retries left, else the
            # task ends; the others go on
            ended = ending or run_over(record, run)
            retry = None if ended else jobdir.take_retry(args.retries)
            if retry is None:
                if not ended:
                    print(f"slurm-hai: part {part} run {run} failed (exit {rc}); no retry left: this part is over, "
                          f"the job's other parts go on if any still run (`hai status {array}`)", flush=True)
                return rc
            jobdir.event("retry", run=run, part=part, exit_code=rc, retry=retry, of=args.retries)
            print(f"slurm-hai: part {part} run {run} failed (exit {rc}); retry {retry} of {args.retries}", flush=True)
            requeue = True
    try:
        if not requeue and slurm.requeued_when_batch_ends(job_id):
            return rc
        slurm.requeue(task)
    except SlurmError as e:  # slurmctld away: the policy daemon requeues it (requeue-failed)
        print(f"slurm-hai: part {part}: requeue: {e}", flush=True)
        return rc
    return wait_to_be_requeued(ending)


def _watch_lighthouse(service: str, array: int, least: int, slurm, task: str, lost: threading.Event,
                      done: threading.Event) -> None:
    """While the part runs: ask the lighthouse service for the job's lighthouse every
    LIGHTHOUSE_WATCH_EVERY s. A new address means the one the part uses died (the service
    never starts a lighthouse again at its address: a new one numbers its quorums from 1,
    ids the parts have used): end the part (SIGTERM to the task's step) and set `lost`.
    torchft alone would fail the part only when its quorum times out (60 s)."""
    first, pause = None, 0.0
    while not done.wait(pause):
        pause = LIGHTHOUSE_WATCH_EVERY
        try:
            now = ask(service, array, least)
        except PartError:
            continue  # the service is away (or the job is over): the part goes on as it is
        if first is None:
            first = now
        elif now != first:
            lost.set()
            try:
                slurm.cancel(task, signal="TERM")
            except SlurmError as e:
                print(f"slurm-hai: the job's lighthouse was lost, and the part could not be ended: {e}", flush=True)
            return


def _set_leave_time(job, lead: int | None) -> None:
    """If this task has a time limit (Slurm's record `job`: an end), tell the part when to
    leave for it (runtime/parts.py, LEAVE_AT_ENV): `lead` s before it, by default the job's
    grace and NOTICE_MARGIN. The part then commits the job's state at its first step from
    that time on and leaves (EXIT_TIME_LIMIT), and this script requeues its task. No limit
    (or no record: Slurm then ends the task at its limit, as it would): the part never
    leaves for one, whatever the submitter's environment held."""
    if job is None or not job.end_time > job.start_time > 0:
        os.environ.pop(LEAVE_AT_ENV, None)
        return
    if lead is None:
        lead = _grace(job) + NOTICE_MARGIN
    os.environ[LEAVE_AT_ENV] = str(job.end_time - lead)


def _grace(job) -> int:
    """The job's grace as the policy daemon honours it (placement.stamped_grace); 0 without a
    policy to read."""
    try:
        return stamped_grace(find_policy(), job.tags.get(GRACE))
    except PolicyError:
        return 0


def _output_to_rank_log(jobdir: JobDir, run: int, part: int) -> None:
    """From here on this script's output and its part's (the step's, through srun) go to the
    rank log of the part's number, the run opened by the launcher's run line: `hai logs JOB
    --rank P` (and -f) reads part P as it reads a node rank of any job."""
    fd = jobdir.open_run_log(run, part)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _settings(job, array: int) -> None:
    """What a plain sbatch script may leave out, found as hai-submit's script would set it
    and exported for the part's step: the lighthouse service (the policy's) and the job's
    MIN (its `hai-parts` tag, from Slurm's record `job` of this task)."""
    if not os.environ.get(SERVICE_ENV):
        service = find_policy().lighthouse_service
        if not service:
            raise PartError(f"no lighthouse service: set {SERVICE_ENV}=http://HOST:PORT, or the policy's [elastic] "
                            "lighthouse_service (hai-admin lighthouse)")
        os.environ[SERVICE_ENV] = service
    if MIN_ENV not in os.environ:
        if job is None:
            raise PartError(f"Slurm did not say what job {array} is (its `{PARTS}` comment): set {MIN_ENV}=MIN, "
                            "or run it again once slurmctld answers")
        parts = parse_parts(job.tags.get(PARTS))
        if parts is None:
            raise PartError(f"job {array} is no elastic job in place: submit it with --comment={PARTS}=MIN:MAX "
                            "(the fewest parts that train, and the array's size; docs/elastic-in-place.md)")
        os.environ[MIN_ENV] = str(parts[0])
    min_parts()  # a malformed HAI_PARTS_MIN stops the part here, in one line


def _preempted(job) -> bool:
    """Whether Slurm's record of this task (None: none) says Slurm chose its run for
    preemption (its notice)."""
    return job is not None and job.start_time > 0 and job.preempt_time >= job.start_time


if __name__ == "__main__":
    raise SystemExit(main())
