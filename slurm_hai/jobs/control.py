"""What `hai stop` and `hai suspend` do to a job: Slurm first, then the job's own record.

`writable` says whether this user may write the job's directory (its owner, where the
directory exists); Slurm checks ownership of the job itself again.
"""

from __future__ import annotations

import os

from ..slurm import Backend
from .jobdir import JobDir


def stop(slurm: Backend, job_id: int, jobdir: JobDir, writable: bool) -> None:
    """Cancel the job for good; its directory says it was stopped (so a rerun exits at once)."""
    slurm.cancel(job_id)
    if writable:
        jobdir.set_final("stopped", 0, reason="stopped by its user")
        jobdir.event("stop", by=os.getuid())


def request_suspend(slurm: Backend, job_id: int, jobdir: JobDir, writable: bool, notice_signal: str) -> None:
    """Send the suspend notice (`notice_signal`, the policy's: the signal the job's launchers
    take as the notice) to the job's steps. The request is recorded first: the launcher reads
    it to tell why the notice came."""
    if writable:
        jobdir.event("suspend_requested", by=os.getuid())
    try:
        slurm.cancel(job_id, signal=notice_signal)
    except Exception:
        if writable:
            jobdir.event("suspend_request_failed", by=os.getuid())
        raise
