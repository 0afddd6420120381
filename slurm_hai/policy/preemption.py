"""A preemption by Slurm, as the policy daemon tells it to the preempted job (pure; no I/O).

Slurm's QOS preemption is Slurm's decision: the job's record shows only its preempt time.
The daemon names the job it was most likely preempted for (`preemptor`) and the size an
elastic job runs on next beside it (`shrinks_to`) once, in the job's `hai-notice` tag
(policy/rules.py, policy/tags.py); the job's launcher reads its own record, never the queue.
"""

from __future__ import annotations

from typing import Iterable

from . import sizes, tags
from .elastic import shrink_target
from .job import Job, place
from .levels import Level, level_of_qos


def preemptor(me: Job, queue: Iterable[Job], ladder: tuple[Level, ...]) -> tuple[Job, Level] | None:
    """The job Slurm most likely preempts `me` for, and its level: a pending job of a higher
    level of `ladder` (the policy's) in an overlapping node group, the highest level first,
    then the oldest (first in line). None when `me` is of no level of the ladder."""
    mine = level_of_qos(me.qos, ladder)
    if mine is None:
        return None
    parts = set(me.partition.split(","))
    best: tuple | None = None
    for j in queue:
        lvl = level_of_qos(j.qos, ladder)
        if (j.job_id == me.job_id or j.state != "PENDING" or lvl is None or lvl.value <= mine.value
                or not parts & set(j.partition.split(","))):
            continue
        key = (-lvl.value, place(j))
        if best is None or key < best[0]:
            best = (key, j, lvl)
    return (best[1], best[2]) if best else None


def shrinks_to(me: Job, other: Job | None) -> int:
    """The size an elastic job preempted for `other` runs on next, beside it; 0 for a job
    suspended whole (a fixed one, or one that would keep fewer than its MIN)."""
    nodes = sizes.from_tag(tags.parse(me.admin_comment).get(tags.NODES))
    if nodes is None or not nodes.elastic or other is None:
        return 0
    return shrink_target(nodes, me.num_nodes, other.num_nodes)


def preempted_notice(me: Job, queue: Iterable[Job], ladder: tuple[Level, ...]) -> str:
    """The `hai-notice` value of a job Slurm preempted (at its preempt time)."""
    found = preemptor(me, queue, ladder)
    other, level = found if found else (None, None)
    return tags.notice_value("preempted", other.job_id if other else None, level.name if level else "",
                             shrinks_to(me, other), me.preempt_time)
