"""What the rules read of a job: Slurm's record as slurm/records.py's JobInfo provides it.

A Protocol, so that policy/ needs nothing from the Slurm boundary (and tests may pass any
object with these attributes). Times are epoch seconds, 0 when unset.
"""

from __future__ import annotations

from typing import Protocol

from .tags import PARTS, parse


class Job(Protocol):
    """Read-only members: a frozen dataclass (JobInfo) or any object with these attributes."""

    @property
    def job_id(self) -> int: ...
    @property
    def user(self) -> str: ...
    @property
    def account(self) -> str: ...
    @property
    def state(self) -> str: ...  # Slurm's base job state: PENDING, RUNNING, FAILED, ...
    @property
    def reason(self) -> str: ...
    @property
    def qos(self) -> str: ...
    @property
    def partition(self) -> str: ...  # comma-separated when the job may run in several
    @property
    def num_nodes(self) -> int: ...
    @property
    def restart_count(self) -> int: ...
    @property
    def submit_time(self) -> int: ...
    @property
    def start_time(self) -> int: ...
    @property
    def eligible_time(self) -> int: ...
    @property
    def end_time(self) -> int: ...
    @property
    def preempt_time(self) -> int: ...
    @property
    def priority(self) -> int: ...
    @property
    def comment(self) -> str: ...  # the job's comment: its owner's, a hint (policy/tags.py)
    @property
    def admin_comment(self) -> str: ...
    @property
    def array_job_id(self) -> int: ...  # its job array's id; for a job of no array its own id


def place(job: Job) -> tuple[int, int]:
    """The job's place in line (FCFS, HAI rule 3): its submission's id, the job array's for a
    task of an array (a task that starts gets an id of its own, later than jobs submitted
    after the array), then its own id."""
    return job.array_job_id, job.job_id


def in_place(job: Job) -> bool:
    """Whether the job is a part of an elastic job in place: a task of a job array with the
    `hai-parts` tag (hai-submit --in-place writes it in the comment, job_submit.lua copies it
    into the admin comment)."""
    return PARTS in parse(job.comment, job.admin_comment)


def job_of(job: Job) -> int:
    """The job a Slurm job is of, as its user sees it. An elastic job in place (`hai-parts` in
    its comment, and in its admin comment by job_submit.lua: a job array, one part per task)
    is one job, its array's, while its parts leave and rejoin: one run for the clock of its
    demotion, one job directory (named by the array's id), one job in the metrics and the
    timeline (which read accounting: the admin comment). Any other job, a task of a plain
    array too, is its own. The comment's tag is its owner's to write: it can only make the
    owner's own tasks demoted sooner, or their events read as one job's."""
    return job.array_job_id if in_place(job) else job.job_id
