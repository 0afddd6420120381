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
import time
from dataclasses import dataclass

from ..jobs.jobdir import JobDir, default_root
from ..policy.limits import NOTICE_MARGIN
from ..policy.model import PolicyError, find_policy
from ..policy.placement import stamped_grace
from ..policy.tags import GRACE, LEFT, PARTS, SUBMISSION, Left, left_value, parse_parts, with_tags
from ..slurm import Backend, SlurmError, backend
from . import protocol
from .batch import run_over, slurm_record, wait_to_be_requeued
from ..policy.contract import restart_count
from .parts import (EXIT_BELOW_MIN, EXIT_LIGHTHOUSE_LOST, EXIT_TIME_LIMIT, LEAVE_AT_ENV, MIN_ENV, SERVICE_ENV,
                    TORCHFT_RUST_LOG, PartError, ask, job_and_part, min_parts)

# How often each part's task asks the lighthouse service whether the job's lighthouse lives.
LIGHTHOUSE_WATCH_EVERY = 2.0


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
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
    return args, args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd


def main(argv: list[str] | None = None) -> int:
    args, cmd = parse(argv)
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
    # this task, to requeue or signal it: its job id alone would be every task's when it is the
    # array's own (a task keeps the array's id), as seen: a part's requeue requeued them all
    task = Task(slurm, jobdir, job_id, f"{array}_{part}", array, part, run)
    lost = threading.Event()
    rc = _run_part(task, cmd, args.gpus, lost)
    if rc == 0:
        task.succeeded()
        return 0
    return task.left(rc, lost.is_set() or rc == EXIT_LIGHTHOUSE_LOST, args.retries, ending)


def _run_part(task: "Task", cmd: list[str], gpus: int, lost: threading.Event) -> int:
    """The part's step, with the lighthouse watched beside it (`lost` set when it is lost)."""
    done = threading.Event()
    service = os.environ.get(SERVICE_ENV)
    if service:
        threading.Thread(target=_watch_lighthouse, args=(service, task.array, min_parts(), task.slurm, task.name,
                                                         lost, done), daemon=True).start()
    try:
        return task.slurm.run_step(cmd, 1, gpus, os.environ.get("SLURM_JOB_NAME", "hai"))
    finally:
        done.set()


@dataclass
class Task:
    """One run of one part's task, as its script ends it."""

    slurm: Backend
    jobdir: JobDir
    job_id: int
    name: str  # ARRAY_PART: what to requeue or signal
    array: int
    part: int
    run: int

    def succeeded(self) -> None:
        """The part ended its training: the job's end, and the parts still queued cancelled."""
        if self.jobdir.final() is None:
            self.jobdir.set_final("succeeded", 0)
            self.jobdir.event(protocol.FINISHED, run=self.run, part=self.part, state="succeeded", exit_code=0)
        # Parts that left and wait for nodes would start only to find the job ended, and until
        # then hold its place in line (and could take a later job's nodes for it). Every part
        # that ends asks, before its own node is free for one of them.
        try:
            self.slurm.cancel_waiting_tasks(self.array)
        except SlurmError as e:
            print(f"slurm-hai: part {self.part}: the waiting parts of job {self.array} stay queued ({e}); "
                  "each ends at its start", flush=True)

    def say_left(self, why: str) -> None:
        """Say in the task's own Slurm record that this run left, and why (its comment's
        hai-left), for the policy daemon's metrics, which read no user's directory. Not
        said where Slurm does not answer: only a count is lost."""
        try:
            record = self.slurm.job(self.job_id)
            if record is not None:
                self.slurm.update_job(self.name, Comment=with_tags(
                    record.comment, {LEFT: left_value(Left(self.run, why, time.time()))}))
        except SlurmError as e:
            print(f"slurm-hai: part {self.part}: its departure is not in its Slurm record ({e})", flush=True)

    def left(self, rc: int, lost: bool, retries: int, ending: list[int]) -> int:
        """The part's step ended without success: journal why (runtime/protocol.py judges
        it) and requeue the task where the protocol says so; this script's exit status."""
        left_for = (lost, rc == EXIT_TIME_LIMIT, rc == EXIT_BELOW_MIN)
        # Slurm's record, read once and only where it decides: whether Slurm preempted the run, or ended it
        record = None if any(left_for) else slurm_record(self.slurm, self.job_id)
        why = protocol.part_left(*left_for, _preempted(record))
        self.jobdir.event(protocol.PART_LEFT, run=self.run, part=self.part, exit_code=rc,
                          preempted=why == "preempted", **({why: True} if why in protocol.PART_LEFT_FOR else {}))
        self.say_left(why)
        if why == "failed":
            # its own failure (not Slurm ending the task: a cancel signals this script too, and
            # Slurm's record says so first): requeued while the job has retries left, else the
            # task ends; the others go on
            if ending or run_over(record, self.run):
                return rc
            retry = self.jobdir.take_retry(retries)
            if retry is None:
                print(f"slurm-hai: part {self.part} run {self.run} failed (exit {rc}); no retry left: this part is "
                      f"over, the job's other parts go on if any still run (`hai status {self.array}`)", flush=True)
                return rc
            self.jobdir.event(protocol.RETRY, run=self.run, part=self.part, exit_code=rc, retry=retry, of=retries)
            print(f"slurm-hai: part {self.part} run {self.run} failed (exit {rc}); retry {retry} of {retries}",
                  flush=True)
        else:
            print(f"slurm-hai: part {self.part} run {self.run} ended (exit {rc}): {PART_LEFT_SAYS[why]}", flush=True)
        try:
            if why == "preempted" and self.slurm.requeued_when_batch_ends(self.job_id):
                return rc
            self.slurm.requeue(self.name)
        except SlurmError as e:  # slurmctld away: the policy daemon requeues it (requeue-failed)
            print(f"slurm-hai: part {self.part}: requeue: {e}", flush=True)
            return rc
        return wait_to_be_requeued(ending)


# What a part's log says of why it left (protocol.part_left), but for its own failure.
PART_LEFT_SAYS = {
    # every part of the job leaves so: they come back under a new lighthouse, and with no live
    # peer to heal from they resume from the job's last commit (runtime/parts.py)
    "lighthouse_lost": "the job's lighthouse was lost; its task is requeued",
    # a run of its task ends before Slurm's limit would end the task for good: it comes back
    # with a whole limit, from a live peer or, when every part left so, the commit
    "time_limit": "at its task's time limit; its task is requeued",
    # every part that is left leaves so: the job waits in the queue for MIN nodes, as a job
    # suspended whole does, and resumes from the commit the parts made as they left
    "below_min": "fewer than the job's MIN parts could train; its task is requeued",
    "preempted": "preempted; its task waits in the queue to rejoin",
}


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
