"""Why a job is where it is, in words, for `hai status` and `hai-admin why` (pure).

Reads the same snapshot of the queue as the daemon's rules (policy/rules.py), so the words
and the daemon's actions never disagree.
"""

from __future__ import annotations

import bisect
import time
from typing import Sequence

from .levels import AUTO, Level
from .model import Policy
from .job import Job, place
from .rules import QUOTA_REASONS, WAITING_FOR_NODES, Snapshot, is_held
from .sizes import from_tag
from .tags import BEHIND as BEHIND_TAG, DEMOTED as DEMOTED_TAG, NODES as NODES_TAG, YIELD as YIELD_TAG, parse_at


def _ago(seconds: float) -> str:
    s = int(max(0, seconds))
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    return f"{s // 3600} h {s % 3600 // 60} min"


def _nodes(n: int) -> str:
    return f"{n} node" if n == 1 else f"{n} nodes"


def explain(job: Job, jobs: Sequence[Job], policy: Policy, now: float | None = None) -> str:
    """Why `job` is where it is, in words (for `hai status`); `jobs` is the whole queue."""
    return Explainer(jobs if any(j.job_id == job.job_id for j in jobs) else [*jobs, job], policy, now)(job)


class Explainer:
    """Explains any number of the jobs of one queue: the snapshot and each group's line are
    built once (`hai list` and `hai-admin explain` over 10,000 jobs stay linear)."""

    def __init__(self, jobs: Sequence[Job], policy: Policy, now: float | None = None) -> None:
        self.snap = Snapshot(jobs, policy, time.time() if now is None else now)
        self._lines: dict[str, list[tuple[tuple[int, tuple[int, int]], int, Job, Level]]] | None = None

    def __call__(self, job: Job, now: float | None = None) -> str:
        """Why `job` is where it is; `now`: the time the words are for, if not the queue's
        (a queue read a moment ago, explained later: the policy daemon's answers)."""
        at = self.snap.now if now is None else now
        if job.job_id not in self.snap.by_id:  # not in the queue it was built on
            return explain(job, self.snap.jobs, self.snap.policy, at)
        return _why(job, self.snap, self, at)

    def line(self, partition: str) -> list[tuple[tuple[int, tuple[int, int]], int, Job, Level]]:
        """The pending jobs (not held) that may run in `partition`, in the order Slurm starts
        them: (key, index in the queue, job, level), key = (-level value, place in line)."""
        if self._lines is None:
            self._lines = {}
            for i, j in enumerate(self.snap.jobs):
                lvl = self.snap.level[j.job_id]
                if j.state == "PENDING" and lvl is not None and not is_held(j):
                    for part in j.partition.split(","):
                        self._lines.setdefault(part, []).append(((-lvl.value, place(j)), i, j, lvl))
            for entries in self._lines.values():
                entries.sort(key=lambda e: e[0])
        return self._lines.get(partition, [])


def _why(job: Job, snap: Snapshot, lines: Explainer, now: float) -> str:
    policy = snap.policy
    lvl = snap.level.get(job.job_id)
    name = lvl.name if lvl else (job.qos or "?")
    tags = snap.tags[job.job_id]
    if job.state == "RUNNING":
        if job.preempt_time and job.preempt_time >= job.start_time:
            return (f"running at {name}, asked to suspend {_ago(now - job.preempt_time)} ago "
                    f"(forced off after {snap.grace(job)} s)")
        y = parse_at(tags.get(YIELD_TAG, ""))
        if y:
            if DEMOTED_TAG in tags:
                return (f"running, demoted; asked to give its nodes to job {y[0]} {_ago(now - y[1])} ago "
                        f"(forced off after {snap.grace(job)} s)")
            return (f"running at {name}; asked to give its nodes to job {y[0]}, earlier in line at {name}, "
                    f"{_ago(now - y[1])} ago (forced off after {snap.grace(job)} s)")
        if snap.is_demoted(job):
            d = policy.demotion
            assert d is not None  # is_demoted: the policy demotes
            return (f"running at {d.source} for {_ago(snap.run_time(job))}: counts as {d.target} "
                    f"(demoted after {_ago(d.after_seconds)}), so a {d.source} job may take its nodes")
        return f"running at {name} on {_nodes(job.num_nodes)} for {_ago(now - job.start_time)}{_grows(job, tags, policy)}"
    if job.state != "PENDING":
        return job.state.lower().replace("_", " ")
    auto = "AUTO, now " if snap.submit_level(job) == AUTO else ""
    reason = job.reason
    y = parse_at(tags.get(YIELD_TAG, ""))
    if y:
        if DEMOTED_TAG in tags:
            return f"gave its nodes to job {y[0]} (it had been demoted); waits until that job runs"
        return f"suspended for job {y[0]}, earlier in line at {name}; waits until that job runs"
    if lvl is not None and reason in QUOTA_REASONS + WAITING_FOR_NODES:
        q = policy.quota_for(lvl.name, job.user, job.account)
        used = snap.used.get((job.user, lvl.name), 0)
        # Slurm's reason may lag (it is set by the next scheduling pass): the policy knows
        if reason in QUOTA_REASONS or (q is not None and used + job.num_nodes > q):
            return f"{auto}over quota at {lvl.name}: {used}/{q if q is not None else '-'} nodes in use"
    if reason == "JobHoldMaxRequeue":
        return (f"held by Slurm's requeue limit after {job.restart_count} restarts "
                "(the policy daemon releases it)")
    if reason == "BeginTime":
        wait = job.eligible_time - now
        if job.restart_count > 0:
            return ("held back after requeue: may start again at Slurm's next scheduling pass" if wait < 1 else
                    f"held back after requeue: may start again in ~{round(wait)} s")
        return f"starts no earlier than in {_ago(wait)} (--begin)"
    if reason == "JobHeldUser":
        return f"held by its owner (scontrol release {job.job_id})"
    if reason == "JobHeldAdmin" or job.priority == 0:
        return "held by an administrator"
    if reason in ("Dependency", "DependencyNeverSatisfied"):
        return "waiting for its dependency" if reason == "Dependency" else "its dependency can never be satisfied"
    if reason in WAITING_FOR_NODES and lvl is not None:
        if BEHIND_TAG in tags:
            return (f"waiting for {_nodes(job.num_nodes)} at {lvl.name}: gave its nodes to job {tags[BEHIND_TAG]} "
                    f"and waits behind it ({_position(job, lvl, snap, lines)})")
        return f"{auto}waiting for {_nodes(job.num_nodes)} at {lvl.name} ({_position(job, lvl, snap, lines)})"
    return f"{auto}pending at {name}: {reason}"


def _grows(job: Job, tags: dict[str, str], policy: Policy) -> str:
    """For an elastic job running below its MAX: who grows it back, and when (a job on the
    local cluster, where no policy daemon runs, never grows: issue 54, finding 3)."""
    nodes = from_tag(tags.get(NODES_TAG))
    if nodes is None or not nodes.elastic or job.num_nodes >= nodes.max:
        return ""
    if policy.grow_after_seconds is None:
        return f"; it never grows back to {nodes.max}: this policy grows no job (grow = false)"
    return (f"; the policy daemon grows it to up to {_nodes(nodes.max)} once nodes stay idle "
            f"{_ago(policy.grow_after_seconds)} (where none runs, it stays on {job.num_nodes})")


def _position(job: Job, mine: Level, snap: Snapshot, lines: Explainer) -> str:
    """Where `job` stands in line, and behind whom: the pending jobs (not held) of an
    overlapping group that Slurm starts before it, those of higher levels and the earlier
    ones of its own level; e.g. "position 2 in line, behind job 133 at HIGH"."""
    me, top = (-mine.value, place(job)), (-mine.value, (0, 0))

    def before(entries: list, key: tuple[int, tuple[int, int]]) -> int:
        return bisect.bisect_left(entries, key, key=lambda e: e[0])

    parts = job.partition.split(",")
    if len(parts) == 1:  # the usual case: counted by bisection, no job looked at
        entries = lines.line(parts[0])
        count, higher = before(entries, me), before(entries, top)
        first = entries[:min(count, 3)]
    else:  # a job for several groups: the union of their lines
        ahead = {e[2].job_id: e for part in parts for e in lines.line(part)[:before(lines.line(part), me)]}
        count, higher = len(ahead), sum(1 for e in ahead.values() if e[0] < top)
        first = sorted(ahead.values(), key=lambda e: e[0])[:3]
    where = f"position {count + 1} in line"
    if not count:
        return where
    if count <= 3:
        shown = sorted(first, key=lambda e: e[1])  # in queue order
        return f"{where}, behind " + " and ".join(f"job {j.job_id} at {lvl.name}" for _, _, j, lvl in shown)
    same = count - higher
    return f"{where}, behind " + " and ".join(
        text for n, text in ((higher, f"{higher} job{'s' if higher != 1 else ''} at higher levels"),
                             (same, f"{same} earlier at {mine.name}")) if n)
