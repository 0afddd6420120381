"""What the policy daemon does, decided from a snapshot of the queue (pure; no I/O).

Slurm enforces most of the HAI rules by itself once the QOS ladder is in place (higher
level preempts lower, same level never, per-user quotas, refusal of a job larger than its
quota). `decide(jobs, policy, now)` covers what it cannot do alone and returns the actions
for slurm_hai.controller.daemon to carry out:

- force-requeue   a job preempted by Slurm that still runs after its grace time (Slurm's own
                  check runs only every 30 s, and its GraceTime is the policy's maximum);
- notice          tell a job preempted by Slurm why, once, in its record (`hai-notice`: the job
                  it was most likely preempted for and the size it runs on next,
                  policy/preemption.py), seen while it runs; the daemon's own notices
                  (yield, grow) carry the tag from the start. The job's launcher reads
                  its own record, never the queue; the tag stays while the job waits and
                  NOTICE_KEPT_INTO_RUN into its next run, whose batch script journals it for
                  a run that left before it came. Without the daemon no node can name the job
                  Slurm preempts for: `hai status` says "preempted by a job of a higher level";
- requeue-failed  a job that died of its suspend notice during its grace time (Slurm 22.05
                  marks it FAILED instead of requeueing it), or that had asked to be
                  suspended (its comment's hai-suspend, which its batch script writes
                  before it asks for the requeue) and ended FAILED: its requeue was
                  lost (a slurmctld killed before it saved its state);
- demote          mark a running ABOVE_NORMAL job that has run `after_seconds` as demoted
                  (admin comment `hai-demoted=NORMAL`); a running job's QOS cannot change;
- yield           preempt running jobs that Slurm will not preempt for the first waiting job
                  of a node group: demoted jobs, for a job of a level that Slurm will not let
                  preempt them (their QOS is still ABOVE_NORMAL); later-started jobs of other
                  users of its own level (HAI rule 3: only the same user's jobs are exempt;
                  `fcfs_preempt_levels`). Suspend notice, grace, requeue, held until that job
                  runs (admin comment `hai-yield=JOB@TIME`), then released behind it: it never
                  takes that job's nodes back (`hai-behind=JOB`, until it runs again);
- grow            ask a running elastic job below its MAX to restart on more nodes, when nodes
                  stayed idle `grow_after` seconds and no waiting job of its level or above
                  could use them (policy/elastic.py): tag `hai-grow=SIZE@TIME`, suspend
                  notice, requeue after its grace; Slurm starts it again on up to SIZE nodes;
- restore-level   give a requeued job back its submit-time level (admin comment `hai-level`);
- auto            put a pending AUTO job at the highest level where its user has quota left;
- start-now       a requeued job held back for `cred_expire` (reason BeginTime): start it now,
                  when its last run ended on every node (slurmdbd's record: not NODE_FAIL);
- release         a job held by Slurm's requeue limit (JobHoldMaxRequeue);
- fcfs            explicit priorities that keep each level's pending jobs in submission
                  (job id) order, so a requeued job keeps its place ahead of later jobs.

Every rule with a grace uses the job's own (`Snapshot.grace`: the `hai-grace` tag that
job_submit.lua stamps, what the job asked, at most max_grace_seconds; else grace_seconds).

policy/explain.py says in words why a job waits (for `hai status`), from the same snapshot.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, Sequence

from .job import Job, job_of, place
from .levels import AUTO, LEVEL_STRIDE, Level, level_base, level_of_qos, parse_qos
from .model import NodeGroup, Policy
from .placement import auto_at_submit, auto_levels, group_of, stamped_grace
from .sizes import NodeRange, from_tag
from .preemption import preempted_notice
from .tags import (BEHIND as BEHIND_TAG, DEMOTED as DEMOTED_TAG, GRACE as GRACE_TAG, GROW as GROW_TAG, LEVEL as LEVEL_TAG,
                   NODES as NODES_TAG, NOTICE as NOTICE_TAG, SUSPEND as SUSPEND_TAG, YIELD as YIELD_TAG, notice_value,
                   parse as parse_tags, parse_at, parse_notice, parse_suspended, with_tags)

ACTIVE = ("RUNNING", "SUSPENDED")
WAITING_FOR_NODES = ("Resources", "Priority", "None")
QUOTA_REASONS = ("QOSMaxNodePerUserLimit", "QOSMaxTRESPerUserLimit", "QOSMaxGRESPerUser", "QOSMaxCpuPerUserLimit")
# A requeued job whose eligible time is this close to its (reset) submit time is held back by
# Slurm's requeue delay (cred_expire, 120 s by default), not by a --begin of its owner.
REQUEUE_DELAY_MAX = 300
# How a run may have ended for its job's requeue delay to be cut short (slurmdbd's state of
# the run, `sacct --duplicates`). Not NODE_FAIL or BOOT_FAIL: the failed node gets the run's
# kill when it comes back, and a new run started there within the second ends by that kill
# (its step has the old step's id) or never gets its step (seen on 22.05 under load). Slurm's
# delay (cred_expire) is there for that cleanup.
CLEAN_RUN_ENDS = frozenset({"REQUEUED", "PREEMPTED", "FAILED", "TIMEOUT", "CANCELLED", "COMPLETED",
                            "OUT_OF_MEMORY", "DEADLINE"})
# A requeued job still waiting this long after the start the daemon gave it was overlooked.
OVERLOOKED_AFTER = 0.2
# The daemon's forced requeue is the backstop of the job's own launcher, which forces the
# suspend (and records it as one) `grace` seconds after the notice reached it. Slurm's
# preempt time is in whole seconds and the notice takes a moment to arrive, so without this
# slack the daemon could requeue first (seen on 25.11: 4.4 s after the job's notice).
FORCE_REQUEUE_SLACK = 2

# A job's `hai-notice` stays this long into its next run: that run's batch script reads it
# from the job's record at its start (runtime/batch.py), for a run that left before the
# daemon told it; dropped at once, it would race that read.
NOTICE_KEPT_INTO_RUN = 60

# How long a preempted demoted job stays held for the job it yields to, after its grace time.
YIELD_TIMEOUT = 120
# A job that FAILED this long after Slurm asked it to suspend did not die of the notice.
FAILED_IN_GRACE_SLACK = 60
MAX_PRIORITY_UPDATES = 500
# An elastic job that came back smaller than a grow asked is not asked again for this many
# grow_after periods.
GROW_RETRY_AFTER = 3


@dataclass(frozen=True)
class Action:
    """One thing to do to one job; `why` is the log line's reason."""

    kind: str  # update | requeue | release | signal | hold
    job_id: int
    rule: str
    why: str
    fields: tuple[tuple[str, str], ...] = ()

    def field_dict(self) -> dict[str, str]:
        return dict(self.fields)

    def describe(self) -> str:
        what = self.kind if not self.fields else f"{self.kind} " + " ".join(f"{k}={v}" for k, v in self.fields)
        return f"job {self.job_id}: {what} [{self.rule}] {self.why}"


# ------------------------------------------------------------------ the snapshot


class Snapshot:
    """The queue seen through the policy: levels, usage, pending lines (built once per cycle)."""

    def __init__(self, jobs: Sequence[Job], policy: Policy, now: float,
                 run_ends: Mapping[int, str] | None = None) -> None:
        self.jobs = jobs
        self.policy = policy
        self.now = now
        self.run_ends = run_ends or {}  # job id -> how its last run ended (may_start_now)
        self.by_id = {j.job_id: j for j in jobs}
        cache: dict[str, Level | None] = {}
        self.level: dict[int, Level | None] = {}
        self.tags: dict[int, dict[str, str]] = {}
        self.used: dict[tuple[str, str], int] = defaultdict(int)
        self._run_start: dict[int, int] = {}  # policy.job.job_of -> its earliest running start
        demotion = policy.demotion
        self.demoted_level = policy.level(demotion.target) if demotion else None
        for j in jobs:
            if j.qos not in cache:
                cache[j.qos] = level_of_qos(j.qos, policy.ladder)
            lvl = cache[j.qos]
            self.level[j.job_id] = lvl
            self.tags[j.job_id] = parse_tags(j.admin_comment)
            if j.state in ACTIVE:
                if lvl is not None:
                    self.used[(j.user, lvl.name)] += j.num_nodes
                if j.start_time > 0:
                    r = job_of(j)
                    self._run_start[r] = min(self._run_start.get(r, j.start_time), j.start_time)

    def submit_level(self, job: Job) -> str | None:
        """The level the job was submitted at (AUTO for AUTO), from job_submit.lua's stamp."""
        tag = self.tags[job.job_id].get(LEVEL_TAG)
        if tag:
            return tag
        lvl = self.level[job.job_id]
        return lvl.name if lvl else None

    def grace(self, job: Job) -> int:
        """The job's grace: job_submit.lua's `hai-grace` stamp (what it asked, checked against
        max_grace_seconds at submission), else the policy's grace_seconds (a job of before)."""
        return stamped_grace(self.policy, self.tags[job.job_id].get(GRACE_TAG))

    def run_time(self, job: Job) -> float:
        """How long the job has been running, 0 if it is not: for a part of an elastic job in
        place, since the first of the job's running parts started (policy.job.job_of)."""
        if job.state not in ACTIVE or job.start_time <= 0:
            return 0.0
        return self.now - self._run_start.get(job_of(job), job.start_time)

    def is_demoted(self, job: Job) -> bool:
        d = self.policy.demotion
        lvl = self.level[job.job_id]
        # run_time is 0 for a job that is not running, and after_seconds at least 1
        return d is not None and lvl is not None and lvl.name == d.source and self.run_time(job) >= d.after_seconds

    def group_of(self, job: Job) -> NodeGroup | None:
        return group_of(self.policy, job.partition)


def is_held(job: Job) -> bool:
    return job.state == "PENDING" and (job.priority == 0 or job.reason.startswith("JobHeld")
                                       or job.reason == "JobHoldMaxRequeue")


def auto_level(policy: Policy, user: str, account: str, nodes: int, used: Mapping[tuple[str, str], int],
               group: NodeGroup | None = None) -> str:
    """AUTO: the highest level where `user` still has quota for `nodes` more nodes.

    When no level has room now: the highest level whose quota can ever hold the job (it
    waits there for its quota; what job_submit.lua chose, placement.auto_at_submit), else the
    lowest level.
    """
    candidates = auto_levels(policy, group)
    for lvl in candidates:
        q = policy.quota_for(lvl.name, user, account)
        if q is None or used.get((user, lvl.name), 0) + nodes <= q:
            return lvl.name
    return auto_at_submit(policy, user, account, nodes, group) or (candidates or list(policy.levels_high_to_low))[-1].name


# ------------------------------------------------------------------ decide


class _Plan:
    """Actions collected per job; updates to one job are merged into one scontrol call."""

    def __init__(self) -> None:
        self.first: list[Action] = []
        self.updates: dict[int, tuple[dict[str, str], list[str], list[str]]] = {}
        self.after: list[Action] = []
        self.touched: set[int] = set()

    def add(self, action: Action) -> None:
        self.touched.add(action.job_id)
        self.first.append(action)

    def update(self, job_id: int, rule: str, why: str, **fields: str) -> None:
        self.touched.add(job_id)
        f, rules, whys = self.updates.setdefault(job_id, ({}, [], []))
        f.update(fields)
        rules.append(rule)
        whys.append(why)

    def then(self, action: Action) -> None:
        self.touched.add(action.job_id)
        self.after.append(action)

    def actions(self) -> list[Action]:
        merged = [Action("update", job_id, "+".join(rules), "; ".join(whys), tuple(f.items()))
                  for job_id, (f, rules, whys) in self.updates.items()]
        return self.first + merged + self.after


def needs_idle_nodes(jobs: Sequence[Job], policy: Policy, now: float) -> bool:
    """Whether `decide` may preempt for a waiting job and so needs the idle nodes (the caller
    asks Slurm only then): a demoted job runs and a job of a level between the demotion's
    target and source waits, or a job waits for nodes while a later job of another user of its
    level runs in its group (at a level of `fcfs_preempt_levels`)."""
    d = policy.demotion
    src, tgt = (policy.level(d.source), policy.level(d.target)) if d else (None, None)
    levels = {lvl.qos: lvl for lvl in policy.ladder}
    running_demoted = waiting_between = False
    first: dict[tuple[str, int], tuple[tuple[int, int], str]] = {}  # (partition, level) -> earliest waiting (place, user)
    later: dict[tuple[str, int], list[tuple[tuple[int, int], str]]] = defaultdict(list)  # running (place, user)
    for j in jobs:
        lvl = levels.get(parse_qos(j.qos)[0])
        if lvl is None:
            continue
        if j.state == "RUNNING":
            if d and lvl == src and j.start_time > 0 and now - j.start_time >= d.after_seconds:
                running_demoted = True
            elif policy.fcfs_preempts(lvl.name) and now - j.start_time >= policy.min_run_seconds:
                later[(j.partition, lvl.value)].append((place(j), j.user))
        elif j.state == "PENDING":
            if src is not None and tgt is not None and tgt.value < lvl.value <= src.value:
                waiting_between = True
            if j.reason in WAITING_FOR_NODES and not is_held(j) and policy.fcfs_preempts(lvl.name):
                for part in j.partition.split(","):
                    key = (part, lvl.value)
                    if key not in first or place(j) < first[key][0]:
                        first[key] = (place(j), j.user)
    if running_demoted and waiting_between:
        return True
    if policy.grow_after_seconds is not None and any(
            j.state == "RUNNING" and growable(j, parse_tags(j.admin_comment)) for j in jobs):
        return True
    return any(at > first[key][0] and user != first[key][1]
               for key, runs in later.items() if key in first for at, user in runs)


def growable(job: Job, tags: Mapping[str, str]) -> NodeRange | None:
    """The range of an elastic job (its hai-nodes tag) that runs below its MAX, else None."""
    nodes = from_tag(tags.get(NODES_TAG))
    return nodes if nodes is not None and job.num_nodes < nodes.max else None


def decide(jobs: Sequence[Job], policy: Policy, now: float | None = None, *,
           idle_nodes: Mapping[str, int] | None = None, steady_idle: Mapping[str, int] | None = None,
           max_priority_updates: int = MAX_PRIORITY_UPDATES, replay: bool = False,
           run_ends: Mapping[int, str] | None = None) -> list[Action]:
    """The actions one daemon cycle takes for this queue snapshot (see the module doc).
    `run_ends` (job id -> slurmdbd's state of its last run) is asked for the jobs of
    `start_now_candidates`; without it, no requeued job starts before Slurm's delay.
    `idle_nodes` (partition -> idle node count) is needed only when `needs_idle_nodes`;
    without it, nothing is preempted (yield). `steady_idle` (partition -> nodes idle for the
    policy's whole `grow_after`, policy/elastic.IdleHistory): without it, nothing grows.
    `replay`: the first cycle of a (re)started
    daemon, which sends again the notice of every yield in flight (its tag is written
    before the notice, so a daemon killed between the two has left a job that never heard
    it; the launcher ignores a second notice)."""
    now = time.time() if now is None else now
    snap = Snapshot(jobs, policy, now, run_ends)
    plan = _Plan()
    level_changes: set[int] = set()
    for job in jobs:
        state = job.state
        if state == "RUNNING":
            _running(job, snap, plan, replay)
        elif state == "PENDING":
            _pending(job, snap, plan, level_changes)
        elif state == "FAILED":
            _failed(job, snap, plan)
    _yield(snap, plan, idle_nodes, level_changes)
    _grow(snap, plan, steady_idle or {})
    _fcfs(snap, plan, level_changes, max_priority_updates)
    return plan.actions()


def _failed(job: Job, snap: Snapshot, plan: _Plan) -> None:
    """A job that died of its suspend notice (Slurm's preemption or the daemon's yield), or
    after it asked to be suspended."""
    if not job.start_time:
        return
    grace = snap.grace(job)
    notices = [job.preempt_time] if job.preempt_time >= job.start_time else []
    y = parse_at(snap.tags[job.job_id].get(YIELD_TAG, ""))
    if y and y[1] >= job.start_time:
        notices.append(y[1])
    for at in notices:
        if at and at <= job.end_time <= at + grace + FAILED_IN_GRACE_SLACK:
            plan.add(Action("requeue", job.job_id, "requeue-failed",
                            f"died {job.end_time - at} s after its suspend notice (grace {grace} s): "
                            "a preempted job is requeued, not ended"))
            return
    # no notice Slurm still knows of: the job's own word (its comment, which its owner writes)
    said = parse_suspended(parse_tags(job.comment).get(SUSPEND_TAG))
    if said is not None and said.run == job.restart_count:
        plan.add(Action("requeue", job.job_id, "requeue-failed",
                        f"run {job.restart_count} had asked to be suspended and ended FAILED: its requeue was "
                        "lost (slurmctld stopped before it saved it)"))


def _running(job: Job, snap: Snapshot, plan: _Plan, replay: bool = False) -> None:
    now, policy = snap.now, snap.policy
    grace = snap.grace(job)
    pt = job.preempt_time
    if pt and pt >= job.start_time and now - pt >= grace + FORCE_REQUEUE_SLACK:
        plan.add(Action("requeue", job.job_id, "force-requeue",
                        f"ignored its suspend notice: preempted {now - pt:.0f} s ago, grace {grace} s"))
        return
    tags = snap.tags[job.job_id]
    if _notice(job, snap, plan):
        return
    y = parse_at(tags.get(YIELD_TAG, ""))
    if y:
        waiting, at = y
        other = snap.by_id.get(waiting)
        if other is None or other.state != "PENDING":
            plan.update(job.job_id, "yield", f"job {waiting} no longer waits for its nodes: preemption called off",
                        AdminComment=with_tags(job.admin_comment, drop=[YIELD_TAG]))
        elif now - at >= grace:
            why = "demoted" if DEMOTED_TAG in tags else "later in line"
            plan.add(Action("requeue", job.job_id, "yield",
                            f"{why}, gives its nodes to job {waiting}: grace of {grace} s is over"))
            plan.then(Action("hold", job.job_id, "yield", f"held until job {waiting} runs"))
        elif replay:
            plan.add(Action("signal", job.job_id, "yield",
                            f"yields to job {waiting}: suspend notice sent again by a restarted daemon",
                            (("signal", policy.notice_signal),)))
        return
    g = parse_at(tags.get(GROW_TAG, ""))
    if g:
        size, at = g
        if job.start_time <= at:  # the grow is in flight
            if now - at >= grace:
                plan.add(Action("requeue", job.job_id, "grow",
                                f"asked to grow to {size} nodes {now - at:.0f} s ago: grace of {grace} s is over"))
            elif replay:
                plan.add(Action("signal", job.job_id, "grow",
                                f"grows to {size} nodes: suspend notice sent again by a restarted daemon",
                                (("signal", policy.notice_signal),)))
            return
        # Running again. Short of SIZE (Slurm 22.05 may offer a range job one node fewer than
        # are idle for a while after a requeue), the tag stays, and with it no new grow, for
        # GROW_RETRY_AFTER x grow_after: a restart per grow_after would gain nothing.
        if job.num_nodes >= size or now - at >= GROW_RETRY_AFTER * (policy.grow_after_seconds or 0):
            plan.update(job.job_id, "grow", f"runs on {job.num_nodes} node(s) since it was asked to grow to {size}",
                        AdminComment=with_tags(job.admin_comment, drop=[GROW_TAG]))
            return
    demoted = snap.is_demoted(job)
    if demoted and DEMOTED_TAG not in tags:
        d = policy.demotion
        assert d is not None  # is_demoted: the policy demotes
        plan.update(job.job_id, "demote",
                    f"{d.source} -> {d.target} after {snap.run_time(job):.0f} s running (limit {d.after_seconds} s)",
                    AdminComment=with_tags(job.admin_comment, {DEMOTED_TAG: d.target}, drop=[BEHIND_TAG]))
    elif not demoted and DEMOTED_TAG in tags:  # requeued and running again since it was demoted
        plan.update(job.job_id, "restore-level", "runs again after a requeue: no longer demoted",
                    AdminComment=with_tags(job.admin_comment, drop=[DEMOTED_TAG, BEHIND_TAG]))
    elif BEHIND_TAG in tags:
        plan.update(job.job_id, "yield", f"runs again: no longer behind job {tags[BEHIND_TAG]}",
                    AdminComment=with_tags(job.admin_comment, drop=[BEHIND_TAG]))


def _notice(job: Job, snap: Snapshot, plan: _Plan) -> bool:
    """The notice rule, for a running job: tell a run that Slurm preempted why, once
    (`hai-notice`, at its preempt time); drop an earlier run's tag once this run has run
    NOTICE_KEPT_INTO_RUN. Whether it updated the job. A run that leaves before the daemon's
    next cycle is never seen preempted (Slurm clears the preempt time at the requeue): it is
    not told."""
    told = snap.tags[job.job_id].get(NOTICE_TAG)
    if told is not None and parse_notice(told, job.start_time) is not None:
        return False  # this run's
    if job.preempt_time and job.preempt_time >= job.start_time:
        plan.update(job.job_id, "notice", "preempted by Slurm: the cause of its notice, in its record",
                    AdminComment=with_tags(job.admin_comment, {NOTICE_TAG: preempted_notice(job, snap.jobs,
                                                                                            snap.policy.ladder)}))
        return True
    if told is not None and snap.now - job.start_time >= NOTICE_KEPT_INTO_RUN:
        plan.update(job.job_id, "notice", f"runs again since {snap.now - job.start_time:.0f} s: its last "
                    "notice's cause was read", AdminComment=with_tags(job.admin_comment, drop=[NOTICE_TAG]))
        return True
    return False


def _pending(job: Job, snap: Snapshot, plan: _Plan, level_changes: set[int]) -> None:
    now, policy = snap.now, snap.policy
    tags = snap.tags[job.job_id]
    jid = job.job_id
    if job.reason == "JobHoldMaxRequeue":
        plan.add(Action("release", jid, "release",
                        f"held by Slurm's requeue limit after {job.restart_count} restarts; a preempted job "
                        "must never stay held"))
        return
    y = parse_at(tags.get(YIELD_TAG, ""))
    if y:
        waiting, at = y
        other = snap.by_id.get(waiting)
        still = other is not None and other.state == "PENDING" and now - at < snap.grace(job) + YIELD_TIMEOUT
        if still:
            if not is_held(job):
                plan.add(Action("hold", jid, "yield", f"requeued for job {waiting}: held until that job runs"))
            return
        behind: dict[str, str] = {}
        if other is None:
            why = f"job {waiting} is gone"
        elif other.state != "PENDING":
            # It waits behind that job from now on, even where its place in line comes first
            # (a demoted job back at its level): taking the nodes back would undo the yield.
            why = f"job {waiting} got its nodes; waits behind it"
            behind = {BEHIND_TAG: str(waiting)}
        else:
            why = f"job {waiting} still waits {YIELD_TIMEOUT} s after the grace time: stop yielding"
        # Released before the tag goes: the tag is what marks the hold as ours, so a daemon
        # killed between the two must find the tag still there (or the job already free).
        if is_held(job) and job.reason == "JobHeldAdmin":
            plan.add(Action("release", jid, "yield", f"released: it yielded to job {waiting}"))
        plan.update(jid, "yield", why, AdminComment=with_tags(job.admin_comment, behind,
                                                              drop=[YIELD_TAG, DEMOTED_TAG]))
        return
    if DEMOTED_TAG in tags:
        plan.update(jid, "restore-level", "requeued: no longer demoted",
                    AdminComment=with_tags(job.admin_comment, drop=[DEMOTED_TAG]))
    if is_held(job):
        return
    lvl = snap.level[jid]
    submit = snap.submit_level(job)
    if submit == AUTO and policy.allow_auto:
        best = auto_level(policy, job.user, job.account, job.num_nodes, snap.used, snap.group_of(job))
        if lvl is None or best != lvl.name:
            plan.update(jid, "auto", f"AUTO: {best} is the highest level where {job.user} has quota for "
                        f"{job.num_nodes} node(s) now (was {lvl.name if lvl else job.qos})",
                        QOS=policy.qos_for(best, job.user, job.account))
            level_changes.add(jid)
        snap.used[(job.user, best)] += job.num_nodes  # the next AUTO job of this user sees it taken
    elif job.restart_count > 0 and submit and lvl is not None and submit != lvl.name and _is_level(policy, submit):
        plan.update(jid, "restore-level", f"requeued: back at its submit-time level {submit} (was {lvl.name})",
                    QOS=policy.qos_for(submit, job.user, job.account))
        level_changes.add(jid)
    if may_start_now(job, now, snap.run_ends):
        plan.update(jid, "start-now", f"requeued {now - job.submit_time:.0f} s ago (its run ended "
                    f"{snap.run_ends[jid]}), Slurm holds it back until +{job.eligible_time - now:.0f} s: "
                    "eligible from the second after its requeue",
                    StartTime=f"uts{start_now_at(job)}")
    elif overlooked_after_requeue(job, now):
        plan.update(jid, "start-now", f"eligible {now - job.eligible_time:.1f} s ago, not yet looked at by Slurm's "
                    "scheduler: an update asks for its next pass", StartTime=f"uts{start_now_at(job)}")


def held_back_after_requeue(job: Job, now: float) -> bool:
    """A requeued job that Slurm holds back for its requeue delay (reason BeginTime, an
    eligible time within REQUEUE_DELAY_MAX of the requeue), not for a --begin of its owner."""
    return (job.restart_count > 0 and job.reason == "BeginTime" and job.eligible_time > now
            and 0 <= job.eligible_time - job.submit_time <= REQUEUE_DELAY_MAX)


def held_past_start_now(job: Job, now: float) -> bool:
    """A requeued job that Slurm holds back longer than start_now_at."""
    return held_back_after_requeue(job, now) and job.eligible_time > start_now_at(job)


def start_now_candidates(jobs: Sequence[Job], now: float) -> list[Job]:
    """The jobs whose last run's end the daemon asks slurmdbd (`run_ends` of decide)."""
    return [j for j in jobs if held_past_start_now(j, now)]


def may_start_now(job: Job, now: float, run_ends: Mapping[int, str]) -> bool:
    """A job held past start_now_at whose last run ended on every node (CLEAN_RUN_ENDS): it
    may start the second after its requeue."""
    return held_past_start_now(job, now) and run_ends.get(job.job_id) in CLEAN_RUN_ENDS


def overlooked_after_requeue(job: Job, now: float) -> bool:
    """A requeued job whose start-now took effect (eligible from start_now_at) but that no
    scheduling pass has looked at since (still reason BeginTime, OVERLOOKED_AFTER seconds on):
    seen on 25.11, where the pass that the update queued can come before that second and the
    next one only with backfill, seconds later. Any update queues a pass."""
    return start_given(job) and now >= job.eligible_time + OVERLOOKED_AFTER


def start_given(job: Job) -> bool:
    """A requeued job still waiting (reason BeginTime) for the start the daemon gave it."""
    return job.restart_count > 0 and job.reason == "BeginTime" and job.eligible_time == start_now_at(job)


def restart_look_at(jobs: Sequence[Job], now: float, run_ends: Mapping[int, str]) -> float | None:
    """When to look at the queue again for a requeued job given its start: OVERLOOKED_AFTER
    past its start second, the moment overlooked_after_requeue would tell that no scheduling
    pass took it (then one update asks for a pass). None when no such job waits for a start
    still to come; the daemon's own pace does the rest."""
    due = [start_now_at(j) + OVERLOOKED_AFTER for j in jobs
           if j.state == "PENDING" and (may_start_now(j, now, run_ends) or start_given(j))]
    return min((t for t in due if t > now), default=None)


def start_now_at(job: Job) -> int:
    """When a requeued job may start again: the second after its requeue, by slurmctld's clock.
    slurmd refuses a launch credential stamped in the second of the job's revocation or before
    (whole seconds: `cred->ctime <= j->revoked`, src/slurmd/slurmd/cred_context.c), and the job
    then ends FAILED for good ("Job credential revoked", seen on 22.05). slurmctld stamps the
    revocation when it requeues the job, and the job's new submit time after it
    (batch_requeue_fini). Given as that moment (`StartTime=uts...`), not as "now", it is
    slurmctld's clock that decides, whatever the daemon's clock says; slurmctld's scheduler
    wakes on whole seconds, so the job starts at that very second (docs/figures.md)."""
    return int(job.submit_time) + 1


def _is_level(policy: Policy, name: str) -> bool:
    return any(lvl.name == name for lvl in policy.ladder)


def _yield(snap: Snapshot, plan: _Plan, idle_nodes: Mapping[str, int] | None, level_changes: set[int]) -> None:
    """Preempt running jobs that Slurm will not preempt for the first waiting job of each
    group, one preemption in flight per group. HAI orders a level's jobs by job id, running or
    not; Slurm's QOS ladder preempts only lower levels. Which jobs may be taken:
    _yield_victims. Idle nodes and those of lower levels (Slurm preempts them itself) count
    first; then just enough victims, the most recently started first (they lose the least
    work); none that has run less than `min_run_seconds`."""
    if idle_nodes is None:  # needs_idle_nodes said no: there is nothing to preempt for
        return
    candidates = _yield_candidates(snap, plan)
    if not candidates:
        return
    busy = _yields_in_flight(snap)
    for part, (head, hl) in sorted(_line_heads(snap, level_changes).items()):
        if part in busy or head.reason not in WAITING_FOR_NODES or _over_quota(snap, head, hl):
            continue
        victims = _yield_victims(snap, part, head, hl, candidates)
        need = head.num_nodes - _nodes_slurm_frees(snap, idle_nodes.get(part, 0), part, hl)
        if not victims or need <= 0 or sum(j.num_nodes for _, j, _ in victims) < need:
            continue
        _preempt(snap, plan, head, hl, victims, need)
        busy.add(part)


def _yield_candidates(snap: Snapshot, plan: _Plan) -> list[Job]:
    """The running jobs that a yield may take: of a level, not yielding already, untouched
    by this cycle's other rules, run at least `min_run_seconds`, not being preempted by Slurm."""
    now, min_run = snap.now, snap.policy.min_run_seconds
    return [j for j in snap.jobs if j.state == "RUNNING" and snap.level[j.job_id] is not None
            and YIELD_TAG not in snap.tags[j.job_id] and j.job_id not in plan.touched
            and now - j.start_time >= min_run
            and not (j.preempt_time and j.preempt_time >= j.start_time)]  # Slurm preempts it already


def _yields_in_flight(snap: Snapshot) -> set[str]:
    """The partitions with a preemption in flight (a job tagged by a yield that has not ended):
    one at a time."""
    busy: set[str] = set()
    for j in snap.jobs:
        if YIELD_TAG in snap.tags[j.job_id] and j.state in ("RUNNING", "PENDING", "COMPLETING"):
            busy.update(j.partition.split(","))
    return busy


def _waits_in_line(snap: Snapshot, job: Job, level_changes: set[int]) -> bool:
    """A pending job that keeps a place in its level's line: not held, its level not changed
    by this cycle, not a job that yielded (held until the job it yielded to runs)."""
    return (job.state == "PENDING" and not is_held(job) and job.job_id not in level_changes
            and YIELD_TAG not in snap.tags[job.job_id])


def _line_heads(snap: Snapshot, level_changes: set[int]) -> dict[str, tuple[Job, Level]]:
    """The first waiting job of each partition (the highest level, then the earliest place)
    and its level; a job waiting in several partitions may head each."""
    heads: dict[str, tuple[Job, Level]] = {}
    for j in snap.jobs:
        lvl = snap.level[j.job_id]
        if lvl is None or not _waits_in_line(snap, j, level_changes):
            continue
        for part in j.partition.split(","):
            h = heads.get(part)
            if h is None or (-lvl.value, place(j)) < (-h[1].value, place(h[0])):
                heads[part] = (j, lvl)
    return heads


def _over_quota(snap: Snapshot, head: Job, hl: Level) -> bool:
    """Whether `head` would be over its user's quota at its level with its nodes: more nodes
    would not start it (Slurm's reason may lag)."""
    q = snap.policy.quota_for(hl.name, head.user, head.account)
    return q is not None and head.num_nodes + sum(
        j.num_nodes for j in snap.jobs if j.state in ACTIVE and j.user == head.user
        and (jl := snap.level[j.job_id]) is not None and jl.value == hl.value) > q


def _nodes_slurm_frees(snap: Snapshot, idle: int, part: str, hl: Level) -> int:
    """The nodes of `part` that Slurm can give a job of level `hl` by itself: the `idle` ones,
    and those of lower levels, which it preempts."""
    return idle + sum(j.num_nodes for j in snap.jobs if j.state in ACTIVE and j.partition == part
                      and (jl := snap.level[j.job_id]) is not None and jl.value < hl.value)


def _yield_victims(snap: Snapshot, part: str, head: Job, hl: Level,
                   candidates: list[Job]) -> list[tuple[int, Job, str]]:
    """The `candidates` of partition `part` that may yield to `head` (of level `hl`), with
    why, in the order they are taken:
    - demoted jobs, for a job of a level above the demotion target, up to the demotion source;
    - later jobs (higher id) of other users of the waiting job's own level, at a level of
      `fcfs_preempt_levels` (HAI rule 3 exempts only the same user's jobs);
    each kind the most recently started first. Never the job that `head` yielded to."""
    policy = snap.policy
    d = policy.demotion
    src, tgt = (policy.level(d.source), policy.level(d.target)) if d else (None, None)
    for_demoted = src is not None and tgt is not None and tgt.value < hl.value <= src.value
    in_line = policy.fcfs_preempts(hl.name)
    if not (for_demoted or in_line):
        return []
    behind = snap.tags[head.job_id].get(BEHIND_TAG)
    victims: list[tuple[int, Job, str]] = []  # (order: 0 demoted, 1 later in line; job; why)
    for j in candidates:
        lvl = snap.level[j.job_id]
        assert lvl is not None  # candidates all have a level
        if j.partition != part or str(j.job_id) == behind:  # never the job it yielded to
            continue
        if snap.is_demoted(j):
            if for_demoted and lvl.value >= hl.value:
                assert tgt is not None  # for_demoted: the policy demotes
                victims.append((0, j, f"demoted to {tgt.name} after {snap.run_time(j):.0f} s; job "
                                      f"{head.job_id} ({hl.name}) needs its nodes"))
        elif in_line and lvl.value == hl.value and place(j) > place(head) and j.user != head.user:
            victims.append((1, j, f"job {head.job_id} of {head.user}, earlier in line at {hl.name}, "
                                  f"needs its nodes"))
    victims.sort(key=lambda v: (v[0], -v[1].start_time))  # the most recent run loses the least work
    return victims


def _preempt(snap: Snapshot, plan: _Plan, head: Job, hl: Level, victims: list[tuple[int, Job, str]],
             need: int) -> None:
    """Tag and notify `victims` (_yield_victims), in order, until they free `need` nodes for
    `head`, of level `hl`."""
    for order, v, why in victims:
        if need <= 0:
            break
        need -= v.num_nodes
        # the tags first: the job's launcher reads the cause from its record when the notice comes
        cause = notice_value("demoted" if order == 0 else "earlier_in_line", head.job_id, hl.name, 0, int(snap.now))
        plan.update(v.job_id, "yield", f"yields to job {head.job_id}",
                    AdminComment=with_tags(v.admin_comment, {YIELD_TAG: f"{head.job_id}@{int(snap.now)}",
                                                             NOTICE_TAG: cause}))
        plan.then(Action("signal", v.job_id, "yield",
                         f"{why}: suspend notice, forced off after {snap.grace(v)} s",
                         (("signal", snap.policy.notice_signal),)))


def _grow(snap: Snapshot, plan: _Plan, steady_idle: Mapping[str, int]) -> None:
    """Offer nodes that stayed idle to running elastic jobs below their MAX: the highest
    level first, then the earliest job; one grow in flight per partition. Not when a waiting
    job of the job's level or above could use them (it waits for nodes, or was just requeued),
    not beyond the user's quota, not before the job has run `grow_after` seconds at its size."""
    after = snap.policy.grow_after_seconds
    if after is None or not steady_idle:
        return
    now, policy = snap.now, snap.policy
    busy: set[str] = set()  # a yield or a grow in flight
    waiting: dict[str, int] = {}  # partition -> highest level of a job that could take idle nodes
    for j in snap.jobs:
        tags, lvl = snap.tags[j.job_id], snap.level[j.job_id]
        g = parse_at(tags.get(GROW_TAG, ""))
        if (YIELD_TAG in tags and j.state in ("RUNNING", "PENDING", "COMPLETING")) or (
                g and (j.state in ("PENDING", "COMPLETING") or (j.state == "RUNNING" and g[1] >= j.start_time))):
            busy.update(j.partition.split(","))
        if (j.state == "PENDING" and lvl is not None and not is_held(j)
                and (j.reason in WAITING_FOR_NODES or held_back_after_requeue(j, now))):
            for part in j.partition.split(","):
                waiting[part] = max(waiting.get(part, lvl.value), lvl.value)
    candidates: list[tuple[int, tuple[int, int], Job, NodeRange, Level]] = []
    for j in snap.jobs:
        lvl, tags = snap.level[j.job_id], snap.tags[j.job_id]
        nodes = growable(j, tags)
        if (j.state != "RUNNING" or lvl is None or nodes is None
                or j.job_id in plan.touched or YIELD_TAG in tags or GROW_TAG in tags
                or now - j.start_time < after or (j.preempt_time and j.preempt_time >= j.start_time)
                or steady_idle.get(j.partition, 0) <= 0
                or waiting.get(j.partition, -1) >= lvl.value):
            continue
        candidates.append((-lvl.value, place(j), j, nodes, lvl))
    for _, _, j, nodes, lvl in sorted(candidates, key=lambda c: c[:2]):
        if j.partition in busy:
            continue
        most = j.num_nodes + steady_idle[j.partition]
        q = policy.quota_for(lvl.name, j.user, j.account)
        if q is not None:
            most = min(most, q - (snap.used[(j.user, lvl.name)] - j.num_nodes))
        size = nodes.largest_at_most(most)
        if size is None or size <= j.num_nodes:
            continue
        # the tags first: the job's launcher reads the cause from its record when the notice comes
        plan.update(j.job_id, "grow", f"{steady_idle[j.partition]} node(s) idle for {after} s",
                    AdminComment=with_tags(j.admin_comment, {GROW_TAG: f"{size}@{int(now)}",
                                                             NOTICE_TAG: notice_value("grow", None, "", size,
                                                                                      int(now))}))
        plan.then(Action("signal", j.job_id, "grow",
                         f"grows from {j.num_nodes} to {size} nodes: suspend notice, requeued after "
                         f"{snap.grace(j)} s at the latest", (("signal", policy.notice_signal),)))
        busy.add(j.partition)


def _fcfs(snap: Snapshot, plan: _Plan, level_changes: set[int], cap: int) -> None:
    """Explicit priorities so that each level's pending jobs (per partition) run in job id order.

    Slurm orders by priority, then submit time, then job id, and a requeue resets the submit
    time. Going from the last job to the first, a job keeps its priority when it already sorts
    before the next one, else it gets the next one's priority + 1 (within its level's band).
    """
    groups: dict[tuple[str, str], list[Job]] = defaultdict(list)
    for j in snap.jobs:
        lvl = snap.level[j.job_id]
        if lvl is not None and _waits_in_line(snap, j, level_changes):
            groups[(j.partition, lvl.name)].append(j)
    updates: list[tuple[int, int, int]] = []  # (priority, job id, old)
    for (_part, name), members in groups.items():
        base = level_base(snap.policy.level(name))
        members.sort(key=place)
        for j, p in zip(members, fcfs_priorities(members, base)):
            if p != j.priority:
                updates.append((p, j.job_id, j.priority))
    updates.sort(key=lambda u: (-u[0], u[1]))  # the head of the line first
    for p, jid, old in updates[:cap]:
        plan.update(jid, "fcfs", f"keeps its place in line (priority {old} -> {p})", Priority=str(p))


def fcfs_priorities(members: Sequence[Job], base: int) -> list[int]:
    """Priorities for `members` (sorted by job id) that make Slurm run them in that order."""
    lo, hi = base - 1, base + LEVEL_STRIDE - 2  # Slurm's own rounding may give base - 1
    out = [0] * len(members)
    nxt: tuple[int, int, int] | None = None
    for i in range(len(members) - 1, -1, -1):
        j = members[i]
        p = j.priority
        if not (lo <= p <= hi and (nxt is None or (-p, j.submit_time, j.job_id) < nxt)):
            p = base if nxt is None else max(base, -nxt[0] + 1)
            if p > hi:  # more jobs than the band holds: number them from the top, the rest share base
                return [max(base, hi - k) for k in range(len(members))]
        out[i] = p
        nxt = (-p, j.submit_time, j.job_id)
    return out
