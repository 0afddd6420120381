"""The policy daemon's Prometheus metrics (`hai-admin daemon --metrics-port PORT`).

Needs prometheus_client (`pip install 'slurm-hai[metrics]'`); the daemon imports this
module only when metrics are asked for. Series (docs/admin-guide.md, "Metrics";
contrib/grafana/ draws them):

  from each cycle's snapshot of the queue (gauges):
    hai_nodes_held{level,user}                    nodes held by running jobs
    hai_pending_jobs{level,reason}                pending jobs, by Slurm's reason
  from the jobs' own Slurm records (their comment's hai-suspend and hai-left, which their
  batch scripts and parts' tasks write: policy/tags.py), of the jobs in the queue:
    hai_suspensions_total{level,cause}            runs ended by a suspend; cause of the notice
                                                  (preempted, user, time_limit, unknown; none:
                                                  the job called go_suspend() unasked)
    hai_forced_suspensions_total{level}           of those, forced off after the grace time
    hai_restarts_total{level}                     runs started again (after a suspend or a retry)
    hai_preemption_latency_seconds{level,cause}   notice -> that run requeued (nodes free)
    hai_restart_latency_seconds{level}            a suspended run's requeue -> the next run started
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

Each is counted once, by the daemon that saw it appear: the daemon remembers, per job in
the queue, the newest run it counted, and one that happened before the daemon's start is not
counted (a daemon before it counted it). The daemon reads no user's directory (issue 55): a
job's word on its runs is in its Slurm record, which its owner may write as well, and is
read as such (bounded, each field checked: a cause outside the vocabulary is `unknown`). A
part of an elastic job in place is a task of its array with a record of its own; its start
after it left counts as a rejoin, not as the job's restart.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

from ..jobs.status import level_name
from ..policy import tags
from ..policy.levels import Level
from ..slurm.records import JobInfo
from .bounded_http import BoundedHandler, BoundedServer, family_of

CAUSES = ("preempted", "user", "time_limit", "unknown")  # jobs.status.notice_cause's words
# why a part of a job in place left (its `left` event, runtime/part_task.py)
PART_CAUSES = ("preempted", "below_min", "lighthouse_lost", "time_limit", "failed")
NO_NOTICE = "none"
HOLDING_NODES = ("RUNNING", "CONFIGURING", "COMPLETING")
FORGET_AFTER = 600.0  # seconds after a job left the queue

PREEMPTION_BUCKETS = (0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60, 120, 300, 600)
RESTART_BUCKETS = (1, 2, 3, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 43200, 86400)
CHECKPOINT_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 60, 120, 300)
CYCLE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


# ------------------------------------------------------------------ following the jobs' runs


@dataclass
class _Runs:
    """What the daemon has counted of one job's runs (a part's task's runs, for a part), by
    its Slurm record."""

    suspended: tags.Suspended | None = None  # the newest suspend counted
    requeued: int = -1  # the newest suspended run whose requeue was timed
    started: int = 0  # the newest run whose start was counted
    left: tags.Left | None = None  # the newest departure counted (a part)
    last_seen: float = 0.0  # when the job was last in the queue (monotonic)


def _requeued_at(submit_time: int, said_at: float) -> float:
    """When a run's requeue happened: its new submit time is the requeue's, in whole seconds;
    the job's own word (hai-suspend's AT, marked just before it asked for the requeue) places
    it within that second, and nothing the job writes moves it out."""
    return min(max(float(submit_time), said_at), submit_time + 1.0)


def _cause(said: tags.Suspended) -> str:
    return NO_NOTICE if said.cause == NO_NOTICE else said.cause if said.cause in CAUSES else "unknown"


# ------------------------------------------------------------------ the metrics


class DaemonMetrics:
    """The daemon's metrics in their own registry; `serve` exposes them over HTTP. `ladder`:
    the policy's, whose levels' series exist from the start."""

    def __init__(self, ladder: Iterable[Level], since: float | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.since = time.time() if since is None else since
        self._runs: dict[int, _Runs] = {}
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
        """After a cycle: its time and failures, the queue's gauges, and what the jobs' records
        say of their runs that is new."""
        self.cycle_seconds.observe(seconds)
        if failed_actions:
            self.errors.labels("action").inc(failed_actions)
        self.queue.update(jobs)
        now = time.monotonic()
        for job in jobs:
            runs = self._runs.setdefault(job.job_id, _Runs())
            runs.last_seen = now
            own = tags.parse(job.comment)  # the job's own word (its owner's to write)
            if tags.PARTS in job.tags:
                self._on_part(level_name(job), job, runs, tags.parse_left(own.get(tags.LEFT)))
            else:
                self._on_job(level_name(job), job, runs, tags.parse_suspended(own.get(tags.SUSPEND)))
        # Forgotten a while after it left the queue, not at once: a job left out of one
        # snapshot (a record the backend could not read) must not be counted again.
        self._runs = {jid: r for jid, r in self._runs.items() if now - r.last_seen < FORGET_AFTER}

    def _on_job(self, level: str, job: JobInfo, runs: _Runs, said: tags.Suspended | None) -> None:
        """A job's suspend (its hai-suspend), the requeue that followed, and its restart."""
        if said is not None and said.run <= job.restart_count and (runs.suspended is None
                                                                   or said.run > runs.suspended.run):
            runs.suspended = said
            if said.at >= self.since:
                self.suspensions.labels(level, _cause(said)).inc()
                if said.how == "forced":
                    self.forced.labels(level).inc()
                elif said.notice_at:
                    self.checkpoint.labels(level).observe(max(0.0, said.at - said.notice_at))
        last = runs.suspended
        if (last is not None and job.restart_count == last.run + 1 and runs.requeued < last.run
                and job.submit_time > 0 and last.at >= self.since):
            runs.requeued = last.run
            if last.notice_at:
                self.preemption_latency.labels(level, _cause(last)).observe(
                    max(0.0, _requeued_at(job.submit_time, last.at) - last.notice_at))
        if self._started_again(job, runs):
            self.restarts.labels(level).inc()
            if last is not None and last.run == job.restart_count - 1 and job.submit_time > 0:
                self.restart_latency.labels(level).observe(max(0.0, job.start_time - job.submit_time))

    def _on_part(self, level: str, job: JobInfo, runs: _Runs, left: tags.Left | None) -> None:
        """A part's departure (its task's hai-left) and its rejoin."""
        if left is not None and left.run <= job.restart_count and (runs.left is None or left.run > runs.left.run):
            runs.left = left
            if left.at >= self.since:
                self.part_departures.labels(level, left.why if left.why in PART_CAUSES else "failed").inc()
        if self._started_again(job, runs):
            self.part_rejoins.labels(level).inc()
            if runs.left is not None and runs.left.run == job.restart_count - 1:
                self.part_rejoin_latency.labels(level).observe(max(0.0, job.start_time - runs.left.at))

    def _started_again(self, job: JobInfo, runs: _Runs) -> bool:
        """Whether the record shows a run after the first that started since the daemon did
        and was not counted yet."""
        if job.restart_count <= runs.started or job.state == "PENDING" or not job.start_time:
            return False
        runs.started = job.restart_count
        return job.start_time >= self.since


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
