"""What the rules read of a job: Slurm's record as slurm/records.py's JobInfo provides it.

A Protocol, so that policy/ needs nothing from the Slurm boundary (and tests may pass any
object with these attributes). Times are epoch seconds, 0 when unset.
"""

from __future__ import annotations

from typing import Protocol


class Job(Protocol):
    job_id: int
    user: str
    account: str
    state: str  # Slurm's base job state: PENDING, RUNNING, FAILED, ...
    reason: str
    qos: str
    partition: str  # comma-separated when the job may run in several
    num_nodes: int
    restart_count: int
    submit_time: int
    start_time: int
    eligible_time: int
    end_time: int
    preempt_time: int
    priority: int
    admin_comment: str
