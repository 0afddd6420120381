"""The HAI view of a job (pure): Slurm's record + the job directory -> one state in words.

States (HAI's lifecycle): waiting (never started yet), running, suspended (requeued after a
suspend or preemption, waiting to run again), finished-succeeded, finished-failed,
finished-stopped.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Sequence

from ..policy import sizes, tags
from ..policy.job import in_place
from ..policy.levels import parse_qos
from ..policy.tags import GRACE as GRACE_TAG
from ..slurm.records import ENDED_STATES, JobInfo
from .jobdir import open_request, run_notices, run_sizes, untold_notice

SLURM_REASONS = {
    "None": "",
    "Priority": "higher-priority jobs are ahead in line",
    "Resources": "waiting for free nodes",
    "BeginTime": "held back briefly after a requeue",
    "QOSMaxNodePerUserLimit": "over the per-user node quota of its level",
    "QOSMaxTRESPerUser": "over the per-user quota of its level",
    "JobHoldMaxRequeue": "held by Slurm after too many requeues",
    "JobHeldUser": "held by its user",
    "JobHeldAdmin": "held by an administrator",
    "PartitionDown": "its node group is down",
    "ReqNodeNotAvail": "the nodes it needs are not available",
    "PartitionNodeLimit": "asks for more nodes than its node group has (or allows per job)",
    "PartitionTimeLimit": "its --time is longer than its node group allows",
    "BadConstraints": "no node of its group can ever satisfy it (too many GPUs per node?)",
    "QOSMaxWallDurationPerJobLimit": "its --time is longer than its level allows",
    "InvalidQOS": "its level is not open to its account",
    "Dependency": "waiting for its dependency",
    "NodeDown": "a node it needs is down",
    "JobLaunchFailure": "Slurm could not start it on its node (its batch log or slurmd's log says why)",
}

# How a job ended, as Slurm tells it (for jobs whose directory we cannot or did not read).
ENDED_IN_WORDS = {
    "COMPLETED": "exited 0",
    "FAILED": "exit code {code}",
    "CANCELLED": "cancelled",
    "TIMEOUT": "ran past its time limit",
    "NODE_FAIL": "a node failed",
    "OUT_OF_MEMORY": "ran out of memory",
    "PREEMPTED": "preempted",
    "BOOT_FAIL": "its nodes failed to boot",
    "DEADLINE": "missed its deadline",
}


@dataclass(slots=True)  # 10,000 made per `hai list --all`: 5 ms, a frozen one's 35
class HaiStatus:
    job_id: int
    name: str
    user: str
    state: str
    reason: str
    level: str
    nodes: int
    node_list: str
    restarts: int
    exit_code: int | None
    suspends: int = 0  # runs ended by a suspend (go_suspend or forced)
    forced_suspends: int = 0  # of those, forced after the grace time
    retries: int = 0  # runs started again after a failure (--retries)
    last_suspend: str = ""  # "suspended at 03:25:37: preempted by job 133 (HIGH)"
    submitted: int = 0  # epoch seconds; 0 when unknown
    started: int = 0  # when the current (or last) run started
    ended: int = 0  # when the job ended for good
    private: bool = False  # another user's job: told from what Slurm shows only
    grace: int | None = None  # seconds between its suspend notice and a forced stop; None: unknown
    node_range: str = ""  # an elastic job's MIN:MAX[:STEP]; "" for a fixed one
    sizes: list[int] = field(default_factory=list)  # the nodes of each run so far, oldest first

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def nodes_text(self) -> str:
        """2, or 2/2:4 for an elastic job on 2 nodes of 2 to 4."""
        return f"{self.nodes}/{self.node_range}" if self.node_range else str(self.nodes)


def _min_parts(job: JobInfo) -> int:
    """The MIN of a job in place's `hai-parts=MIN:MAX`: what it needs to train."""
    parts = tags.parse_parts(tags.parse(job.comment, job.admin_comment).get(tags.PARTS))
    return parts[0] if parts else 1


def as_one_job(records: Sequence[JobInfo]) -> list[JobInfo]:
    """The records with each elastic job in place (the tasks of a job array with the
    `hai-parts` tag, one per part) as one record under the array's id: running while a part
    runs, on the nodes of its running parts (while none runs: its MIN, the nodes it waits
    for), restarted as often as its parts were; every other record as it is."""
    out: list[JobInfo] = []
    arrays: dict[int, list[JobInfo]] = {}
    for j in records:
        if in_place(j):
            arrays.setdefault(j.array_job_id, []).append(j)
        else:
            out.append(j)
    for array, tasks in arrays.items():
        running = [t for t in tasks if t.state in ("RUNNING", "CONFIGURING")]
        waiting = [t for t in tasks if t.state not in ENDED_STATES]
        own = next((t for t in tasks if t.job_id == array), tasks[0])
        first = (running or waiting or [own])[0]
        out.append(replace(own, job_id=array, state=first.state, reason=first.reason,
                           num_nodes=len(running) or _min_parts(own),
                           node_list=",".join(t.node_list for t in running),
                           restart_count=sum(t.restart_count for t in tasks),
                           submit_time=min(t.submit_time for t in tasks),
                           start_time=min((t.start_time for t in running), default=first.start_time)))
    return out


def hai_state(job: JobInfo | None, final: dict | None, suspended_runs: int) -> str:
    if final:
        return f"finished-{final['state']}"
    if job is None:
        return "unknown"
    if job.state in ("RUNNING", "CONFIGURING"):
        return "running"
    if job.state == "COMPLETING":  # not final (no final.json): the run is ending for a requeue
        return "suspended"
    if job.state in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED", "PREEMPTED"):
        return "suspended" if (job.restart_count > 0 or suspended_runs > 0) else "waiting"
    if job.state == "COMPLETED":
        return "finished-succeeded"
    if job.state == "CANCELLED":
        return "finished-stopped"
    return "finished-failed"


def reason_in_words(job: JobInfo | None, final: dict | None) -> str:
    if final:
        return final.get("reason") or {"succeeded": "exited 0", "stopped": "stopped by its user"}.get(final["state"], "")
    if job is None:
        return "Slurm no longer knows this job"
    ended = ENDED_IN_WORDS.get(job.state)
    if ended is not None and job.reason in ("None", "", "NonZeroExitCode", "RaisedSignal"):  # Slurm's own words for it
        return ended.format(code=job.exit_code)
    return SLURM_REASONS.get(job.reason, job.reason)


def level_name(job: JobInfo) -> str:
    """The job's level as users name it: `NORMAL` for `normal.u.bob` too. Needs no ladder: a
    level's QOS is its name in lower case (policy/levels.py), whichever ladder it is of."""
    return parse_qos(job.qos)[0].upper()


def level_of(job: JobInfo | None, request: dict) -> str:
    if job is not None and job.qos:
        return level_name(job)
    return request.get("level", "?")


def grace_of(job: JobInfo | None, request: dict) -> int | None:
    """The job's grace: job_submit.lua's stamp (the admin comment wins over the job's own
    comment in JobInfo.tags), else what hai-submit recorded."""
    value = str(job.tags.get(GRACE_TAG, "")) if job is not None else ""
    if not value.isdigit():
        value = str(request.get("grace", ""))
    return int(value) if value.isdigit() else None


def node_range_of(job: JobInfo | None, request: dict) -> str:
    """An elastic job's range as people read it (2:4), "" for a fixed one: job_submit.lua's
    stamp in the admin comment (never the job's own comment), else what hai-submit recorded."""
    found = sizes.from_tag(tags.parse(job.admin_comment).get(tags.NODES)) if job is not None else None
    if found is None:
        found = sizes.from_tag(str(request.get("node_range", "")))
    return str(found) if found is not None and found.elastic else ""


LIVE = ("PENDING", "RUNNING")  # the states the policy explains


def as_others_see(job: JobInfo, why: Callable[[JobInfo], str] | None = None) -> HaiStatus:
    """The status of a job as any user may see it (`hai list --all`): from its Slurm record
    alone, its files private; with `why` (the policy's words) a waiting or running job is
    explained."""
    explained = why(job) if why is not None and job.state in LIVE else None
    return status(job.job_id, job, None, {}, 0, explained, private=True)


def status(job_id: int, job: JobInfo | None, final: dict | None, request: dict, suspended_runs: int,
           explained: str | None = None, last_run: int = 0, events: Sequence[dict] = (),
           private: bool = False, owner_uid: int | None = None) -> HaiStatus:
    """`explained`: the policy's account of a live job (policy.explain.Explainer), if there is one;
    `last_run`: the newest run the job directory saw start (Slurm forgets ended jobs);
    `events`: the job directory's events (none for another user's job: `private`)."""
    hist = history(events, owner_uid)
    state = hai_state(job, final, suspended_runs)
    if explained and job is not None and job.reason in SLURM_REASONS and explained.endswith(f": {job.reason}"):
        explained = f"{explained[:-len(job.reason)]}{SLURM_REASONS[job.reason]}"  # words, not Slurm's code
    reason = explained if (explained and not final) else reason_in_words(job, final)
    if state == "suspended" and hist.notice_pending:  # the run is ending; its `suspended` event comes next
        reason = _join(hist.notice_pending.replace("suspend notice at ", "suspended at ", 1), reason)
    elif state == "suspended" and hist.last_suspend:
        reason = _join(hist.last_suspend, reason)
    elif state == "running" and hist.notice_pending:
        reason = _join(hist.notice_pending, reason)
    ended = int(final.get("t", 0)) if final else (
        job.end_time if job and job.state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING",
                                                  "SUSPENDED") else 0)
    return HaiStatus(
        job_id=job_id,
        name=job.name if job else request.get("name", "?"),
        user=job.user if job else request.get("user", "?"),
        state=state,
        reason=reason,
        level=level_of(job, request),
        nodes=job.num_nodes if job else int(request.get("nodes", 0)),
        node_list=job.node_list if job else "",
        restarts=job.restart_count if job else last_run,
        exit_code=final.get("exit_code") if final else (
            job.exit_code if job and job.state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING") else None),
        suspends=hist.suspends,
        forced_suspends=hist.forced,
        retries=hist.retries,
        last_suspend=hist.last_suspend,
        submitted=int(hist.submitted) or (job.submit_time if job else 0),  # Slurm resets it at a requeue
        started=int(hist.started) or (job.start_time if job and job.state != "PENDING" else 0),
        ended=ended,
        private=private,
        grace=grace_of(job, request),
        node_range=node_range_of(job, request),
        sizes=run_sizes(events),
    )


# ------------------------------------------------------------------ why a notice came

NOTICE_SLACK = 70  # Slurm may send --signal up to 60 s early (its timer resolution)
# An event counts for a run that started at most this long after it (the batch script writes
# `start` a moment after Slurm records the run's start).
START_SLACK = 5.0


def notice_cause(me: JobInfo | None, events: list[dict], run: int, now: float, notice_seconds: float) -> dict:
    """Why run `run`'s suspend notice came, as the job's own record `me` and its events tell
    it, as event fields: the daemon's word in the record (`hai-notice` of this run: preempted
    with by_job, by_level, demoted or earlier_in_line; grow), else cause = preempted (Slurm's
    preempt time of this run: the daemon's word comes later, as a `notice_cause` event, and
    with it the target size), user (by_uid: the run's open `hai suspend`, jobdir.open_request),
    time_limit (limit_at) or unknown.
    `notice_seconds`: how long before the time limit the job asked for the notice (grace + 30)."""
    if me is not None:
        told = told_cause(me, me.start_time)
        if told is not None:
            return told
        if me.preempt_time and me.preempt_time >= me.start_time:
            return {"cause": "preempted"}
    asked = open_request(events, run)
    if asked is not None:
        return {"cause": "user", "by_uid": asked.get("by"), "target_size": 0}
    if me is not None and me.end_time and me.start_time and 0 < me.end_time - now <= notice_seconds + NOTICE_SLACK:
        return {"cause": "time_limit", "limit_at": me.end_time, "target_size": 0}
    return {"cause": "unknown", "target_size": 0}


def told_cause(me: JobInfo, since: int) -> dict | None:
    """The daemon's word on the notice of the job's run that started at `since` (`hai-notice`
    in its admin comment, which only root, the SlurmUser and job_submit.lua write), as event
    fields; None when the record has none of that run."""
    return tags.parse_notice(tags.parse(me.admin_comment).get(tags.NOTICE), since)


def kept_cause(me: JobInfo | None, events: Sequence[dict], run: int) -> dict | None:
    """The daemon's word on run `run`'s notice, as `notice_cause` event fields, when the run
    ended before its launcher heard it (a job that suspends before the daemon's next cycle):
    the daemon keeps the run's `hai-notice` in the job's record `me` until the job has run
    again a while (policy.rules.NOTICE_KEPT_INTO_RUN). None when the run's notice carries its
    size already (the tag was in the record at the notice, or came while the launcher
    looked), or the record has no tag of that run: not older than the run's start (its
    batch script's `start`, less START_SLACK), not of a run that started since."""
    start = next((float(e.get("t", 0)) for e in events if e.get("event") == "start" and e.get("run") == run), None)
    if me is None or start is None or not untold_notice(events, run):
        return None
    if me.state == "RUNNING" and me.restart_count > run and told_cause(me, me.start_time) is not None:
        return None  # the tag is a later run's
    return told_cause(me, int(start - START_SLACK))


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


UNLIMITED_SECONDS = 365 * 86400  # a running job's end_time this far out means "no time limit"


def back_estimate(events: Sequence[dict], find: Callable[[int], JobInfo | None], now: float | None = None) -> str:
    """When a job suspended for another may run again: when that job (its record: `find`)
    ends, which its time limit bounds; or why there is no estimate. '' when the job was not
    preempted by a job that still runs."""
    notices = run_notices(events)
    last = notices[max(notices)] if notices else {}
    if last.get("cause") != "preempted" or not last.get("by_job"):
        return ""
    try:
        other = find(int(last["by_job"]))
    except (TypeError, ValueError):  # not a job id: an events file written by hand
        return ""
    if other is None or other.state not in ("RUNNING", "PENDING", "CONFIGURING"):
        return ""
    if other.state != "RUNNING":
        return f"job {other.job_id} is starting on its nodes; once it runs, its time limit bounds the wait"
    if other.end_time and other.end_time - other.start_time < UNLIMITED_SECONDS:
        return f"runs again when job {other.job_id} ends, by {clock(other.end_time, now)} at the latest (its time limit)"
    return f"runs again when job {other.job_id} ends, which has no time limit: no time can be told"


def clock(t: float, now: float | None = None) -> str:
    """HH:MM:SS today, else the date too (local time)."""
    now = time.time() if now is None else now
    lt, ln = time.localtime(t), time.localtime(now)
    return time.strftime("%H:%M:%S" if lt[:3] == ln[:3] else "%Y-%m-%d %H:%M:%S", lt)


def why_notice(ev: dict, owner_uid: int | None = None) -> str:
    """A notice event's cause in words."""
    cause = ev.get("cause")
    if cause == "preempted":
        if ev.get("by_job") and ev.get("earlier_in_line"):  # the policy daemon's place-in-line rule
            return f"for job {ev['by_job']}, earlier in line at {ev.get('by_level') or 'its level'}"
        if ev.get("by_job"):
            lvl = f" ({ev['by_level']})" if ev.get("by_level") else ""
            extra = ", which needed the nodes of its demoted level" if ev.get("demoted") else ""
            return f"preempted by job {ev['by_job']}{lvl}{extra}{_shrinks(ev)}"
        return f"preempted by a job of a higher level{_shrinks(ev)}"
    if cause == "grow":
        return f"to grow to {ev.get('target_size')} nodes, idle long enough"
    if cause == "user":
        by = ev.get("by_uid")
        return "by you (hai suspend)" if by is None or owner_uid is None or by == owner_uid else (
            "by an administrator (hai suspend)")
    if cause == "time_limit":
        return "time limit (continues in a new run)"
    if ev.get("source") == "simulated":
        return "simulated notice (hai run-local)"
    return "suspend notice"


def _shrinks(ev: dict) -> str:
    n = ev.get("target_size")
    return f"; runs on {n} node(s) beside it" if n else ""


@dataclass
class History:
    """What the job directory's events say about a job's runs (pure)."""

    suspends: int = 0
    forced: int = 0
    retries: int = 0
    last_suspend: str = ""  # the newest run that ended by a suspend, with its cause
    notice_pending: str = ""  # a notice in the newest run that has not ended it yet
    submitted: float = 0
    started: float = 0
    runs: dict = field(default_factory=dict)


def history(events: Sequence[dict], owner_uid: int | None = None, now: float | None = None) -> History:
    h = History()
    notices = run_notices(events)
    forced: dict[int, dict] = {}
    ended: dict[int, dict] = {}
    newest = -1
    for e in events:
        kind, run = e.get("event"), int(e.get("run", 0) or 0)
        if kind == "submit" and not h.submitted:
            h.submitted = float(e.get("t", 0))
        elif kind == "start":
            h.started, newest = float(e.get("t", 0)), max(newest, run)
        elif kind == "forced_suspend":
            forced[run] = e
        elif kind == "suspended":
            ended[run] = e
        elif kind == "retry":
            h.retries += 1
    h.suspends, h.forced = len(ended), len(forced)
    if ended:
        run = max(ended)
        why = why_notice(notices[run], owner_uid) if run in notices else "go_suspend() called by the job"
        text = f"suspended at {clock(float(ended[run]['t']), now)}: {why}"
        if run in forced:
            text += f"; forced off after {forced[run].get('after', '?')} s (no go_suspend() in time)"
        h.last_suspend = text
    if newest in notices and newest not in ended:
        h.notice_pending = (f"suspend notice at {clock(float(notices[newest]['t']), now)}: "
                            f"{why_notice(notices[newest], owner_uid)}")
    return h


def marker(e: dict, owner_uid: int | None = None, now: float | None = None) -> str | None:
    """The line `hai logs -f` prints for an event worth seeing between output lines."""
    kind, run, at = e.get("event"), e.get("run", 0), clock(float(e.get("t", 0)), now)
    head = f"---- slurm-hai {at} run {run}:"
    if kind == "start":
        return f"{head} started on {e.get('nodes') or e.get('host', '?')}" + (f" (restart {run})" if run else "")
    if kind == "notice":
        return f"{head} suspend notice: {why_notice(e, owner_uid)}; grace {e.get('grace', '?')} s"
    if kind == "notice_cause":
        return f"{head} suspend notice: {why_notice(e, owner_uid)}; told by the policy daemon"
    if kind == "go_suspend":
        return f"{head} go_suspend() called; the step ends, the batch script requeues the job"
    if kind == "forced_suspend":
        return f"{head} suspended by force: no go_suspend() within {e.get('after', '?')} s"
    if kind == "suspended":
        return f"{head} suspended ({e.get('how', '?')}); waits to run again"
    if kind == "retry":
        return f"{head} failed with exit code {e.get('exit_code')}; retry {e.get('retry')} of {e.get('of')}"
    if kind == "killed":
        return f"{head} ended by Slurm (exit {e.get('exit_code')})"
    if kind == "finished":
        return f"{head} finished: {e.get('state')} (exit code {e.get('exit_code')})"
    if kind in ("shrink", "grow"):
        return f"{head} {'shrank' if kind == 'shrink' else 'grew'} from {e.get('from')} to {e.get('to')} nodes"
    if kind == "stop":
        return f"{head} stopped by hai stop"
    return None
