"""What `hai stop` and `hai suspend` do to a job: Slurm first, then the job's own record.

Each says only what happened: a job on which the command can have no effect (it has
ended, or does not run) raises NoEffect before Slurm is asked anything, and so does a job
that ended on its own between the command's read and Slurm's answer (Slurm cancels an
ended job without a word: `scancel` of a job that has completed exits 0).

`writable` says whether this user may write (and read) the job's directory (its owner,
where the directory exists); Slurm checks ownership of the job itself again.
"""

from __future__ import annotations

import os

from ..slurm import Backend, SlurmError
from ..slurm.records import JobInfo
from .jobdir import JobDir, last_request
from .status import clock, hai_state

# The HAI states in which a job is over: nothing is left to stop or suspend.
OVER = ("finished-succeeded", "finished-failed", "finished-stopped", "unknown")


class NoEffect(ValueError):
    """The command did nothing to the job, or would do nothing: one line that says why
    (the front ends print it as an error, exit 1)."""


def state_of(job: JobInfo | None, jobdir: JobDir, readable: bool) -> str:
    """The job's HAI state from Slurm's record and, where this user may read it, the end
    its directory records (final.json wins: a job that has ended may still be RUNNING in
    Slurm while its batch script exits)."""
    return hai_state(job, jobdir.final() if readable else None, 0)


def stop(slurm: Backend, job_id: int, job: JobInfo | None, jobdir: JobDir, writable: bool) -> None:
    """Cancel the job for good; its directory says it was stopped (so a rerun exits at once).
    `job`: its Slurm record as the command read it (None: Slurm no longer knows it)."""
    state = state_of(job, jobdir, writable)
    if state in OVER:
        raise NoEffect(f"job {job_id} has already ended ({state}): nothing to stop"
                       if state != "unknown" else f"Slurm no longer knows job {job_id}: nothing to stop")
    try:
        slurm.cancel(job_id)
    except SlurmError:
        if _state_now(slurm, job_id, jobdir, writable) in OVER:
            raise NoEffect(f"job {job_id} ended before the stop reached it: nothing stopped") from None
        raise
    ended = _ended_on_its_own(slurm, job_id, jobdir, writable)
    if ended:
        raise NoEffect(f"job {job_id} ended on its own ({ended}) before the stop reached it: nothing stopped")
    if writable:
        jobdir.set_final("stopped", 0, reason="stopped by its user")
        jobdir.event("stop", by=os.getuid())


def _ended_on_its_own(slurm: Backend, job_id: int, jobdir: JobDir, readable: bool) -> str:
    """After a cancel that Slurm took without a word: how the job ended if not by it (its
    directory's end, else Slurm's end other than CANCELLED), '' if the cancel stopped it."""
    final = jobdir.final() if readable else None
    if final is not None:
        return "" if final["state"] == "stopped" else f"finished-{final['state']}"
    state = _state_now(slurm, job_id, jobdir, False)  # '': Slurm does not answer, its cancel stands
    if state == "unknown":  # gone at once: it had ended before (a cancelled job stays MinJobAge)
        return "Slurm no longer knows it"
    return state if state in OVER and state != "finished-stopped" else ""


def _state_now(slurm: Backend, job_id: int, jobdir: JobDir, readable: bool) -> str:
    """The job's HAI state read again after Slurm refused an action; '' when Slurm does not
    answer that either (its first refusal then stands)."""
    try:
        return state_of(slurm.job(job_id), jobdir, readable)
    except SlurmError:
        return ""


def check_running(job_id: int, job: JobInfo | None, jobdir: JobDir, readable: bool) -> None:
    """NoEffect unless the job runs: only a running job can be suspended (asked before the
    command reads anything else)."""
    state = state_of(job, jobdir, readable)
    if job is None or job.state != "RUNNING" or state != "running":
        what = "starting (its nodes are being set up)" if state == "running" else state
        raise NoEffect(f"job {job_id} is {what}, not running; only a running job can be suspended")


def check_no_notice_yet(job_id: int, run: int, events: list[dict]) -> None:
    """NoEffect when run `run` of the job has had its suspend notice (the launcher's `notice`
    event of the run, or a request not known to have failed): it is suspending already, and a
    second notice would change nothing."""
    last = last_request(events, run)
    if last is not None and last["event"] != "suspend_request_failed":
        raise NoEffect(f"job {job_id} has had its suspend notice since {clock(last['t'])}: it commits and is "
                       f"requeued within its grace; no second notice sent (`hai status {job_id}` follows it)")


def request_suspend(slurm: Backend, job_id: int, run: int, jobdir: JobDir, writable: bool,
                    notice_signal: str) -> None:
    """Send the suspend notice (`notice_signal`, the policy's: the signal the job's launchers
    take as the notice) to the steps of run `run` of a job check_running() passed. The
    request is recorded first: the launcher reads it to tell why the notice came."""
    if writable:
        jobdir.event("suspend_requested", by=os.getuid(), run=run)
    try:
        slurm.cancel(job_id, signal=notice_signal)
    except Exception as e:
        if writable:
            jobdir.event("suspend_request_failed", by=os.getuid(), run=run)
        now = _state_now(slurm, job_id, jobdir, writable) if isinstance(e, SlurmError) else ""
        if now not in ("", "running"):  # it ended, or was suspended, since the command read it
            raise NoEffect(f"job {job_id} is {now} now, not running: no suspend notice sent") from None
        raise
