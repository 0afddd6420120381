"""The policy daemon's Prometheus metrics (`hai-admin daemon --metrics-port PORT`).

Needs prometheus_client (`pip install 'slurm-hai[metrics]'`); the daemon imports this
module only when metrics are asked for. Series (docs/admin-guide.md, "Metrics";
contrib/grafana/ draws them):

  from each cycle's snapshot of the queue (gauges):
    hai_nodes_held{level,user}                    nodes held by running jobs
    hai_pending_jobs{level,reason}                pending jobs, by Slurm's reason
  from the job directories' events.jsonl (docs/design.md), of the jobs in the queue:
    hai_suspensions_total{level,cause}            runs ended by a suspend; cause of the notice
                                                  (preempted, user, time_limit, unknown; none:
                                                  the job called go_suspend() unasked)
    hai_forced_suspensions_total{level}           of those, forced off after the grace time
    hai_restarts_total{level}                     runs started again (after a suspend or a retry)
    hai_preemption_latency_seconds{level,cause}   notice -> that run ended, requeued (nodes free)
    hai_restart_latency_seconds{level}            run ended by a suspend -> the next run started
    hai_suspend_checkpoint_seconds{level}         notice -> go_suspend(): the job's checkpoint commit
    hai_part_departures_total{level,cause}        parts of elastic jobs in place that left while
                                                  their job went on; cause: preempted, below_min
                                                  (the job waits whole for MIN nodes),
                                                  lighthouse_lost, time_limit (its task's limit:
                                                  requeued with a whole one), failed (the part's
                                                  own failure)
    hai_part_rejoins_total{level}                 parts that started again after they left
    hai_part_rejoin_latency_seconds{level}        a part left -> that part started again
  from the daemon itself:
    hai_daemon_cycle_seconds                      one cycle: read the queue, decide, act
    hai_daemon_errors_total{kind}                 slurm: a cycle that could not read the queue;
                                                  action: a Slurm action that failed

Each event is counted once, by the daemon that saw it appear: the daemon remembers how far
it read each job's file, and events older than the daemon's start are read (to pair a
notice with the end of its run) but not counted (a daemon before it counted them). An
elastic job in place is one job (policy.job.job_of): its parts, each a task of its array,
share its directory, read once a cycle; a part's runs are its own (its events say which
part), and its start after it left counts as a rejoin, not as the job's restart.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

from ..jobs.jobdir import JobDir, open_owned, owned, parse_event, user_uid
from ..jobs.status import level_name
from ..policy import tags
from ..policy.job import job_of
from ..policy.levels import Level
from ..slurm.records import JobInfo
from .bounded_http import BoundedHandler, BoundedServer, family_of

CAUSES = ("preempted", "user", "time_limit", "unknown")  # jobs.status.notice_cause's words
# why a part of a job in place left (its `left` event, runtime/part_task.py)
PART_CAUSES = ("preempted", "below_min", "lighthouse_lost", "time_limit", "failed")
NO_NOTICE = "none"
HOLDING_NODES = ("RUNNING", "CONFIGURING", "COMPLETING")
# A job's file is read at most this much per cycle (the file is the user's: never trusted),
# and all the jobs' files at most MAX_CYCLE_READ together: the files least lately read go
# first, so that one user's busy files never keep another's from being read (nor the cycle long).
MAX_READ = 1 << 20
MAX_CYCLE_READ = 8 << 20
# The runs (or parts' runs) whose times a job's events pair that are kept (the newest): a
# file that names a new run on every line cannot grow the daemon's memory.
MAX_RUNS_KEPT = 64
FORGET_AFTER = 600.0  # seconds after a job left the queue

PREEMPTION_BUCKETS = (0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60, 120, 300, 600)
RESTART_BUCKETS = (1, 2, 3, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 43200, 86400)
CHECKPOINT_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 60, 120, 300)
CYCLE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


# ------------------------------------------------------------------ following the job events


@dataclass
class _Followed:
    """How far the daemon has read one job's events.jsonl, and the times that pair events."""

    path: Path
    inode: int = 0
    offset: int = 0
    notices: dict[int, tuple[float, str]] = field(default_factory=dict)  # run -> (t, cause)
    suspended: dict[int, float] = field(default_factory=dict)  # run -> when it ended by a suspend
    left: dict[tuple[int, int], float] = field(default_factory=dict)  # (part, run) -> when it left
    last_seen: float = 0.0  # when the job was last in the queue
    turn: int = 0  # the cycle whose read reached this file last (MAX_CYCLE_READ)


class EventFollower:
    """Reads what is new in the events.jsonl of the jobs in the queue, whole lines only.

    The file is found through the job's `hai-dir` comment, which its user may edit: it is
    read only when it is a regular file owned by the job's user, without blocking, and at
    most MAX_READ bytes a cycle (MAX_CYCLE_READ for all); a line that is not one flat JSON
    event is skipped. Jobs that never ran are skipped (their file only says `submit`); a job is
    forgotten FORGET_AFTER seconds after it left the queue."""

    def __init__(self) -> None:
        self._jobs: dict[int, _Followed] = {}
        self._cycle = 0

    def new_events(self, jobs: Sequence[JobInfo], now: float) -> list[tuple[JobInfo, _Followed, dict]]:
        """(job, what is known of its runs, event) for each whole new line of the jobs' files."""
        due: dict[int, tuple[JobInfo, _Followed]] = {}
        for job in jobs:
            root = job.tags.get(tags.DIR)
            key = job_of(job)  # the parts of a job in place: one directory, read once
            if not root or (job.state == "PENDING" and job.restart_count == 0) or key in due:
                continue
            f = self._jobs.get(key)
            if f is None:
                f = self._jobs[key] = _Followed(JobDir.for_job(key, root).path / "events.jsonl")
            f.last_seen = now
            due[key] = (job, f)
        self._cycle += 1
        budget = MAX_CYCLE_READ
        out = []
        for job, f in sorted(due.values(), key=lambda d: d[1].turn):  # the least lately read first
            if budget <= 0:
                break
            f.turn = self._cycle
            events, size = self._read(f, user_uid(job.user), min(MAX_READ, budget))
            budget -= size
            out += [(job, f, event) for event in events]
        # Forgotten a while after it left the queue, not at once: a job left out of one
        # snapshot (a record the backend could not read) must not be read, and counted, again.
        self._jobs = {jid: f for jid, f in self._jobs.items() if now - f.last_seen < FORGET_AFTER}
        return out

    @staticmethod
    def _read(f: _Followed, uid: int | None, most: int) -> tuple[list[dict], int]:
        """The whole new events of `f`'s file, of at most `most` bytes read, and the bytes read."""
        try:
            st = os.lstat(f.path)
        except (OSError, ValueError):  # not written yet, not readable (a root-squashed share), a bad path
            return [], 0
        if st.st_ino == f.inode and st.st_size == f.offset:
            return [], 0  # the common case: nothing new, one lstat
        if not owned(st, uid):
            return [], 0
        try:
            with open_owned(f.path, uid) as fh:
                st = os.fstat(fh.fileno())
                if st.st_ino != f.inode or st.st_size < f.offset:  # a new file (the job id reused)
                    f.inode, f.offset = st.st_ino, 0
                    f.notices.clear()
                    f.suspended.clear()
                    f.left.clear()
                fh.seek(f.offset)
                data = fh.read(min(st.st_size - f.offset, most))
        except OSError:  # replaced meanwhile, not the user's, a stale NFS handle, ...: tried again next cycle
            return [], 0
        whole = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next cycle
        if not whole and len(data) >= MAX_READ:
            whole = data  # a line longer than MAX_READ is no event: passed over, not waited for
        f.offset += len(whole)
        events = [e for e in map(parse_event, whole.splitlines()) if e is not None]
        return events, len(data)


def _keep_newest(times: dict) -> None:
    """Drop the oldest of a job's paired times beyond MAX_RUNS_KEPT."""
    while len(times) > MAX_RUNS_KEPT:
        del times[next(iter(times))]


# ------------------------------------------------------------------ the metrics


class DaemonMetrics:
    """The daemon's metrics in their own registry; `serve` exposes them over HTTP. `ladder`:
    the policy's, whose levels' series exist from the start."""

    def __init__(self, ladder: Iterable[Level], since: float | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.since = time.time() if since is None else since
        self.events = EventFollower()
        self._server: Any = None  # the HTTP server once serve() ran
        r = self.registry
        self.suspensions = Counter("hai_suspensions", "Runs ended by a suspend (go_suspend or forced), "
                                   "by the cause of their notice", ["level", "cause"], registry=r)
        self.forced = Counter("hai_forced_suspensions", "Runs forced off after their grace time "
                              "(no go_suspend in time)", ["level"], registry=r)
        self.restarts = Counter("hai_restarts", "Runs started again (after a suspend or a retry)", ["level"],
                                registry=r)
        self.preemption_latency = Histogram(
            "hai_preemption_latency_seconds", "Suspend notice -> that run ended and the job was requeued "
            "(its nodes free)", ["level", "cause"], buckets=PREEMPTION_BUCKETS, registry=r)
        self.restart_latency = Histogram(
            "hai_restart_latency_seconds", "Run ended by a suspend -> the next run started", ["level"],
            buckets=RESTART_BUCKETS, registry=r)
        self.checkpoint = Histogram(
            "hai_suspend_checkpoint_seconds", "Suspend notice -> go_suspend(): the job's checkpoint commit",
            ["level"], buckets=CHECKPOINT_BUCKETS, registry=r)
        self.part_departures = Counter("hai_part_departures", "Parts of elastic jobs in place that left "
                                       "while their job went on, by cause", ["level", "cause"], registry=r)
        self.part_rejoins = Counter("hai_part_rejoins", "Parts of elastic jobs in place that started again "
                                    "after they left", ["level"], registry=r)
        self.part_rejoin_latency = Histogram(
            "hai_part_rejoin_latency_seconds", "A part of a job in place left -> that part started again",
            ["level"], buckets=RESTART_BUCKETS, registry=r)
        self.cycle_seconds = Histogram("hai_daemon_cycle_seconds", "Policy daemon cycle: read the queue, "
                                       "decide, act", buckets=CYCLE_BUCKETS, registry=r)
        self.errors = Counter("hai_daemon_errors", "Policy daemon errors: slurm (a cycle could not read the "
                              "queue), action (a Slurm action failed)", ["kind"], registry=r)
        # Series that exist from the start, so that increase() sees their first increment.
        for lvl in ladder:
            for cause in (*CAUSES, NO_NOTICE):
                self.suspensions.labels(lvl.name, cause)
            self.forced.labels(lvl.name)
            self.restarts.labels(lvl.name)
            for cause in PART_CAUSES:
                self.part_departures.labels(lvl.name, cause)
            self.part_rejoins.labels(lvl.name)
        for kind in ("slurm", "action"):
            self.errors.labels(kind)
        self.queue = _QueueCollector()
        r.register(self.queue)

    # -- serving -------------------------------------------------------------------
    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        """Serve /metrics on address:port in a thread (OSError when the port is taken), as
        prometheus_client's own server does (any path; text or OpenMetrics as the scraper
        accepts), each request bounded in size and time (controller/bounded_http.py)."""
        registry = self.registry

        class Handler(BoundedHandler, BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                body = encoder(registry)
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        class Server(BoundedServer, HTTPServer):
            address_family = family_of(address)

        self._server = Server((address, port), Handler)
        threading.Thread(target=self._server.serve_forever, args=(0.1,), name="metrics", daemon=True).start()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # -- the daemon's hooks ----------------------------------------------------------
    def cycle_failed(self) -> None:
        self.errors.labels("slurm").inc()

    def observe_cycle(self, jobs: Sequence[JobInfo], seconds: float, failed_actions: int) -> None:
        """After a cycle: its time and failures, the queue's gauges, and the new job events."""
        self.cycle_seconds.observe(seconds)
        if failed_actions:
            self.errors.labels("action").inc(failed_actions)
        self.queue.update(jobs)
        for job, followed, event in self.events.new_events(jobs, time.monotonic()):
            self._on_event(level_name(job), followed, event)

    def _on_event(self, level: str, f: _Followed, e: dict) -> None:
        kind, run, t = e.get("event"), e["run"], e["t"]
        new = t >= self.since
        if "part" in e:
            self._on_part_event(level, f, e, kind, run, t, new)
        elif kind == "notice":
            cause = e["cause"] if e.get("cause") in CAUSES else "unknown"
            f.notices.setdefault(run, (t, cause))  # the first notice of a run is the one that counts
            _keep_newest(f.notices)
        elif kind == "go_suspend" and run in f.notices and new:
            self.checkpoint.labels(level).observe(max(0.0, t - f.notices[run][0]))
        elif kind == "suspended":
            f.suspended[run] = t
            _keep_newest(f.suspended)
            notice, cause = f.notices.get(run, (None, NO_NOTICE))
            if new:
                self.suspensions.labels(level, cause).inc()
                if e.get("how") == "forced":
                    self.forced.labels(level).inc()
                if notice is not None:
                    self.preemption_latency.labels(level, cause).observe(max(0.0, t - notice))
        elif kind == "start" and run > 0 and new:
            self.restarts.labels(level).inc()
            if run - 1 in f.suspended:
                self.restart_latency.labels(level).observe(max(0.0, t - f.suspended[run - 1]))

    def _on_part_event(self, level: str, f: _Followed, e: dict, kind: object, run: int, t: float,
                       new: bool) -> None:
        """An event of one part of a job in place: its runs are the task's own."""
        part = e.get("part", 0)
        if kind == "left":
            f.left[(part, run)] = t
            _keep_newest(f.left)
            cause = next((c for c in ("below_min", "lighthouse_lost", "time_limit") if e.get(c) is True),
                         "preempted" if e.get("preempted") is True else "failed")
            if new:
                self.part_departures.labels(level, cause).inc()
        elif kind == "start" and run > 0 and new:
            self.part_rejoins.labels(level).inc()
            if (part, run - 1) in f.left:
                self.part_rejoin_latency.labels(level).observe(max(0.0, t - f.left[(part, run - 1)]))


class _QueueCollector:
    """The gauges of the latest snapshot, replaced whole each cycle: a scrape sees one cycle."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], int] = {}
        self._pending: dict[tuple[str, str], int] = {}

    def update(self, jobs: Sequence[JobInfo]) -> None:
        held: dict[tuple[str, str], int] = {}
        pending: dict[tuple[str, str], int] = {}
        for j in jobs:
            if j.state in HOLDING_NODES:
                key = (level_name(j), j.user)
                held[key] = held.get(key, 0) + j.num_nodes
            elif j.state == "PENDING":
                key = (level_name(j), j.reason or "None")
                pending[key] = pending.get(key, 0) + 1
        self._held, self._pending = held, pending

    def collect(self) -> Iterator[GaugeMetricFamily]:
        held, pending = self._held, self._pending
        g = GaugeMetricFamily("hai_nodes_held", "Nodes held by running jobs", labels=["level", "user"])
        for labels, n in sorted(held.items()):
            g.add_metric(labels, n)
        yield g
        g = GaugeMetricFamily("hai_pending_jobs", "Pending jobs, by Slurm's reason", labels=["level", "reason"])
        for labels, n in sorted(pending.items()):
            g.add_metric(labels, n)
        yield g
