"""Which job held each node when: the timeline page of `hai-admin timeline` and `hai timeline`.

`build` is pure: Slurm's accounting records (one per run of a job: `sacct --duplicates`
keeps a requeued run as its own record, with its nodes, start and end) and the jobs'
events.jsonl -> one `Interval` per node and run, and `Mark`s where a run was suspended
(by go_suspend() or by force), restarted, shrunk or grown. An elastic job in place is one
job (policy.job.job_of: its array's id, its parts the array's tasks, one node each): each
part's runs are its intervals, and a part that left or rejoined has its mark on its node.
`collect` is the use case: one accounting read, then each job's events (`read_events`; the
files belong to the jobs' users and are read with care). `page` renders templates/timeline/timeline.html.j2: one
self-contained HTML file (inline SVG, CSS and JS; it loads nothing) drawn by the browser.
"""

from __future__ import annotations

import dataclasses
import pwd
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from ..policy import tags
from ..policy.job import in_place, job_of
from ..policy.levels import Level, level_of_qos
from ..render import render
from ..slurm.base import Backend
from ..policy.hostlist import expand
from ..slurm.records import JobInfo
from .jobdir import JobDir, default_root, events_in, run_notices, user_uid
from .status import START_SLACK, clock, why_notice

MARK_KINDS = ("suspend", "forced-suspend", "restart", "shrink", "grow", "part-left", "part-rejoin")
OTHER_LEVEL = "other"  # a QOS outside the ladder (e.g. `auto` before the job is placed)


@dataclass(frozen=True)
class Interval:
    """One node held by one run of a job, from `start` to `end` (epoch seconds)."""

    node: str
    job_id: int  # an elastic job in place's: its array's (its part's own Slurm id is in `text`)
    user: str
    name: str
    level: str
    run: int | None  # the run's number (SLURM_RESTART_COUNT) when its start event says it
    part: int | None  # the part of an elastic job in place when its start event says it
    start: float
    end: float
    state: str  # Slurm's state of that run: REQUEUED, PREEMPTED, COMPLETED, RUNNING, ...
    running: bool  # still running when the timeline was made (`end` is then its time)
    text: str  # the hover text


@dataclass(frozen=True)
class Mark:
    kind: str  # one of MARK_KINDS
    job_id: int
    t: float
    nodes: tuple[str, ...]
    text: str


@dataclass(frozen=True)
class Timeline:
    since: float
    until: float
    nodes: tuple[str, ...]  # the rows, top to bottom
    levels: tuple[tuple[str, str], ...]  # (level, colour), highest first; OTHER_LEVEL last
    intervals: tuple[Interval, ...]
    marks: tuple[Mark, ...]

    @property
    def job_ids(self) -> list[int]:
        return sorted({i.job_id for i in self.intervals})

    def as_dict(self) -> dict:
        return {"since": self.since, "until": self.until, "nodes": list(self.nodes),
                "levels": [list(lv) for lv in self.levels],
                "intervals": [dataclasses.asdict(i) for i in self.intervals],
                "marks": [dataclasses.asdict(m) | {"nodes": list(m.nodes)} for m in self.marks]}


def node_order(name: str) -> tuple:
    """n2 before n10: digits compare as numbers."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


# Level colours, highest first: crimson, red, orange, amber, green, teal, blue, violet.
PALETTE = ("#a61e4d", "#e03131", "#f76707", "#f59f00", "#2f9e44", "#0c8599", "#1971c2", "#5f3dc4")
OTHER_COLOUR = "#868e96"


def level_colours(ladder: Sequence[Level]) -> tuple[tuple[str, str], ...]:
    """One colour per level, spread over PALETTE from the highest level (crimson) to the
    lowest (violet); grey for a QOS outside the ladder."""
    levels = sorted(ladder, key=lambda lvl: -lvl.value)
    span = max(len(levels) - 1, 1)
    return tuple((lvl.name, PALETTE[round(i * (len(PALETTE) - 1) / span)]) for i, lvl in enumerate(levels)) + (
        (OTHER_LEVEL, OTHER_COLOUR),)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _start_of(events: Sequence[dict], start: float, end: float, part_on: str | None = None) -> dict | None:
    """The `start` event written during [start - slack, end + slack], if any; for a part of
    a job in place, that of the part on node `part_on` (the parts start together)."""
    return next((e for e in events if e.get("event") == "start" and start - START_SLACK <= e["t"] <= end + START_SLACK
                 and (part_on is None or ("part" in e and e.get("nodes") == part_on))), None)


def _started_before(events: Sequence[dict], end: float) -> float:
    """When a run began that accounting keeps without a start (Slurm records none for a run
    requeued within a second or so of starting: seen on 22.05): the job's last `start`
    event before the run's end (accounting's end is whole seconds). 0 when there is none."""
    if not end:
        return 0.0
    starts = [float(e.get("t", 0)) for e in events if e.get("event") == "start"]
    return max((t for t in starts if t <= end + 1), default=0.0)


def build(records: Iterable[JobInfo], events: Mapping[int, Sequence[dict]], since: float, until: float,
          ladder: Sequence[Level], nodes: Iterable[str] = ()) -> Timeline:
    """The timeline of [since, until] from accounting records (one per run of a job) and each
    job's events (job id -> events.jsonl), its levels and colours those of `ladder` (the
    policy's). `nodes`: rows to show even when no job held them."""
    intervals: list[Interval] = []
    runs_of: dict[int, list[tuple[float, float, tuple[str, ...], str]]] = {}  # job -> (start, end, nodes, level)
    for rec in sorted(records, key=lambda r: (r.job_id, r.start_time)):
        job = job_of(rec)
        job_events = events.get(job, ())
        start = float(rec.start_time or _started_before(job_events, rec.end_time))
        if not start or not rec.node_list or rec.node_list == "None assigned":
            continue  # never started (pending, or cancelled while waiting)
        running = not rec.end_time or rec.state in ("RUNNING", "SUSPENDED")
        end = until if running else float(rec.end_time)
        if end < since or start > until:
            continue
        lvl = level_of_qos(rec.qos, tuple(ladder))
        level = lvl.name if lvl else OTHER_LEVEL
        held = tuple(expand(rec.node_list))
        is_part = in_place(rec)  # the array's own task too, whose id is the job's
        begun = _start_of(job_events, start, end, held[0] if is_part and len(held) == 1 else None)
        run = begun.get("run", 0) if begun else None
        part = begun.get("part") if begun else None
        runs_of.setdefault(job, []).append((start, end, held, level))
        text = (f"job {job} {rec.name} ({rec.user}), {level}"
                + (f", part {part if part is not None else '?'} (Slurm job {rec.job_id})" if is_part else "")
                + (f", run {run}" if run is not None else "")
                + f"\n{clock(start, until)} to {'now' if running else clock(end, until)}"
                + f" ({_duration(end - start)}), {rec.state.lower()}"
                + f"\nnodes {rec.node_list}")
        intervals += [Interval(node, job, rec.user, rec.name, level, run, part, start, end,
                               rec.state, running, text) for node in held]
    marks = [m for job_id, job_events in sorted(events.items())
             for m in job_marks(job_id, job_events, runs_of.get(job_id, [])) if since <= m.t <= until]
    rows = {i.node for i in intervals} | set(nodes)
    return Timeline(since, until, tuple(sorted(rows, key=node_order)), level_colours(ladder),
                    tuple(intervals), tuple(sorted(marks, key=lambda m: (m.t, m.job_id))))


def job_marks(job_id: int, events: Sequence[dict], runs: Sequence[tuple[float, float, tuple[str, ...], str]]
              ) -> list[Mark]:
    """The marks of one job: each run ended by a suspend (go_suspend() or forced), each
    restart, shrink and grow, on the nodes the job held then (the run that started last
    before the event: a suspend is written just after its run ended); for an elastic job in
    place, each part that left and rejoined, on the part's node (its last start's)."""
    notices = run_notices(events)
    part_nodes: dict[int, tuple[str, ...]] = {}
    marks = []
    for e in events:
        kind, run, t = e.get("event"), int(e.get("run", 0) or 0), float(e.get("t", 0))
        held = [r for r in runs if r[0] - START_SLACK <= t]
        if not held:
            continue
        _, _, nodes, level = held[-1]
        if "part" in e:
            marks += _part_mark(job_id, level, e, part_nodes)
            continue
        head = f"job {job_id} ({level}) run {run}"
        if kind == "suspended":
            forced = e.get("how") == "forced"
            why = why_notice(notices[run]) if run in notices else "go_suspend() called by the job"
            text = f"{head} suspended at {clock(t)}: {why}" + ("; forced off (no go_suspend() within the grace)"
                                                              if forced else "")
            marks.append(Mark("forced-suspend" if forced else "suspend", job_id, t, nodes, text))
        elif kind == "start" and run > 0:
            marks.append(Mark("restart", job_id, t, nodes,
                              f"{head} restarted at {clock(t)} on {e.get('nodes') or ', '.join(nodes)}"))
        elif kind in ("shrink", "grow"):
            detail = ", ".join(f"{k} {v}" for k, v in sorted(e.items()) if k not in ("t", "event", "run"))
            marks.append(Mark(kind, job_id, t, nodes,
                              f"{head} {'shrank' if kind == 'shrink' else 'grew'} at {clock(t)}"
                              + (f": {detail}" if detail else "")))
    return marks


def _part_mark(job_id: int, level: str, e: dict, part_nodes: dict[int, tuple[str, ...]]) -> list[Mark]:
    """The mark of an event of one part of a job in place (runtime/part_task.py writes them):
    it rejoined (a start after its first), or it left, and why."""
    kind, part, run, t = e["event"], e["part"], e["run"], e["t"]
    head = f"job {job_id} ({level}) part {part} run {run}"
    if kind == "start":
        node = e.get("nodes")  # a part's one node (its file is its user's: a name or anything)
        part_nodes[part] = (node,) if isinstance(node, str) and node else ()
        return [Mark("part-rejoin", job_id, t, part_nodes[part], f"{head} rejoined at {clock(t)} on "
                     f"{', '.join(part_nodes[part]) or 'a node'}")] if run > 0 else []
    if kind != "left":
        return []
    why = ("preempted: the other parts trained on" if e.get("preempted") is True
           else "fewer than the job's MIN parts could train: the job waits whole" if e.get("below_min") is True
           else "the job's lighthouse was lost: every part left" if e.get("lighthouse_lost") is True
           else "its task reached its time limit: it was requeued" if e.get("time_limit") is True
           else f"it failed (exit {e.get('exit_code')})")
    return [Mark("part-left", job_id, t, part_nodes.get(part, ()), f"{head} left at {clock(t)}: {why}")]


def read_events(records: Iterable[JobInfo], me: str) -> dict[int, list[dict]]:
    """Each job's events, from its directory (`job_root`), owned by the job's user; an
    elastic job in place's once, under its array's id (policy.job.job_of)."""
    found: dict[int, list[dict]] = {}
    for rec in records:
        job = job_of(rec)
        if job in found:
            continue
        root = job_root(rec, me)
        uid = user_uid(rec.user)
        found[job] = [] if root is None or uid is None else events_in(JobDir.for_job(job, root).path / "events.jsonl", uid)
    return found


def page(timeline: Timeline, title: str) -> str:
    """The timeline as one self-contained HTML page."""
    local = time.localtime(timeline.until)  # the page tells times as the host does, wherever it is opened
    return render("timeline/timeline.html.j2", title=title, data=timeline.as_dict(), utc_offset=local.tm_gmtoff,
                  zone=time.strftime("%Z", local))


def job_root(rec: JobInfo, me: str) -> Path | None:
    """Where the job's directory lives: its comment's hai-dir, else the caller's own root
    for their jobs, else ~USER/.hai/jobs of the job's user (None for an unknown user)."""
    tagged = rec.tags.get(tags.DIR)
    if tagged:
        return Path(tagged)
    if rec.user == me:
        return default_root()
    try:
        return Path(pwd.getpwnam(rec.user).pw_dir) / ".hai" / "jobs"
    except KeyError:
        return None


def collect(slurm: Backend, since: float, until: float, me: str, ladder: Sequence[Level],
            only_mine: bool = False) -> Timeline:
    """The timeline use case: one accounting read (the caller's jobs, or everyone's with
    every node as a row) and each job's events."""
    records = [r for r in slurm.accounting_since(since, me if only_mine else None) if r.start_time <= until]
    nodes = () if only_mine else [n.name for n in slurm.nodes()]
    return build(records, read_events(records, me), since, until, ladder, nodes)
