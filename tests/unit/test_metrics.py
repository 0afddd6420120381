"""The policy daemon's Prometheus metrics (controller/metrics.py) over fake queues of the
jobs' Slurm records, and `hai-admin daemon --metrics-port`."""

from __future__ import annotations

import json
import os
import pwd
import sys
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_hai.cli.admin import main as admin
from slurm_hai.controller.daemon import PolicyDaemon
from slurm_hai.controller.metrics import CAUSES, DaemonMetrics
from slurm_hai.policy.levels import DEFAULT_LADDER, Level
from slurm_hai.policy.model import load_policy
from test_policy_daemon import LOCAL, NOW, FakeSlurm, job

ME = pwd.getpwuid(os.getuid()).pw_name


def value(m: DaemonMetrics, name: str, **labels: str) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


# A LOW job preempted once, as its Slurm record shows it cycle after cycle: running, its run 0
# said suspended (notice at 110, go_suspend at 111.5: hai-suspend, written by its batch
# script before the requeue), requeued at 113 (its new submit time), running again at 116.
SAID_0 = "hai-dir=/home/a/.hai/jobs hai-suspend=0:go_suspend:preempted:110.000:111.500"
PREEMPTED = (job(1, state="RUNNING", qos="low", start_time=100, submit_time=90),
             job(1, state="RUNNING", qos="low", start_time=100, submit_time=90, comment=SAID_0),
             job(1, state="PENDING", qos="low", reason="BeginTime", restart_count=1, submit_time=113, comment=SAID_0),
             job(1, state="RUNNING", qos="low", restart_count=1, submit_time=113, start_time=116, comment=SAID_0))


def part(task: int, state: str = "RUNNING", restart_count: int = 0, left: str = "", **kw):
    """Task `task` of array 10, a part of an elastic job in place; `left`: its hai-left."""
    return job(task, state=state, qos="low", array_job_id=10, restart_count=restart_count,
               admin_comment="hai-level=LOW hai-parts=2:3", comment=f"hai-left={left}" if left else "", **kw)


def observe(m: DaemonMetrics, *records) -> None:
    for record in records:
        m.observe_cycle([record], 0.1, 0)


def test_queue_gauges_count_nodes_held_by_level_and_user_and_pending_jobs_by_reason():
    m = DaemonMetrics(DEFAULT_LADDER, since=0)
    m.observe_cycle([job(1, state="RUNNING", qos="low", num_nodes=4, user="hai-alice"),
                     job(2, state="COMPLETING", qos="low", num_nodes=1, user="hai-alice"),
                     job(3, state="RUNNING", qos="normal.u.hai-bob", num_nodes=2, user="hai-bob"),
                     job(4, qos="high", reason="Resources"), job(5, qos="high", reason="Resources"),
                     job(6, qos="normal", reason="BeginTime", restart_count=1),
                     job(7, state="COMPLETED", qos="high", num_nodes=3)], 0.2, 0)
    assert value(m, "hai_nodes_held", level="LOW", user="hai-alice") == 5
    assert value(m, "hai_nodes_held", level="NORMAL", user="hai-bob") == 2  # a quota variant is its level
    assert value(m, "hai_pending_jobs", level="HIGH", reason="Resources") == 2
    assert value(m, "hai_pending_jobs", level="NORMAL", reason="BeginTime") == 1
    m.observe_cycle([job(3, state="RUNNING", qos="normal", num_nodes=2, user="hai-bob")], 0.2, 0)
    # a level that holds nothing any more has no series (not a stale number)
    assert m.registry.get_sample_value("hai_nodes_held", {"level": "LOW", "user": "hai-alice"}) is None
    assert m.registry.get_sample_value("hai_pending_jobs", {"level": "HIGH", "reason": "Resources"}) is None


def test_a_sites_ladder_gives_the_series_and_the_level_labels():
    site = (Level(30, "GOLD"), Level(10, "SILVER"), Level(0, "BRONZE"))
    m = DaemonMetrics(site, since=0)
    levels = {s.labels["level"] for fam in m.registry.collect() if fam.name == "hai_restarts" for s in fam.samples}
    assert levels == {"GOLD", "SILVER", "BRONZE"}
    observe(m, *(replace(r, qos="silver.a.research", user=ME) for r in PREEMPTED))
    assert value(m, "hai_suspensions_total", level="SILVER", cause="preempted") == 1
    assert value(m, "hai_nodes_held", level="SILVER", user=ME) == 1


def test_the_requeue_is_placed_within_slurms_second_by_the_jobs_own_mark_and_never_outside_it():
    # notice at 110.553, go_suspend at 111.090, requeued within Slurm's second 111 (its new
    # submit time): 0.537 s, not the 0.447 s that the whole second alone gives
    for at, latency in (("111.090", 0.537), ("999.000", 1.447), ("100.000", 0.447)):
        said = f"hai-suspend=0:go_suspend:preempted:110.553:{at}"
        m = DaemonMetrics(DEFAULT_LADDER, since=0)
        observe(m, job(1, state="RUNNING", qos="low", start_time=100, submit_time=90, comment=said),
                job(1, qos="low", reason="BeginTime", restart_count=1, submit_time=111, comment=said))
        assert value(m, "hai_preemption_latency_seconds_sum", level="LOW", cause="preempted") == pytest.approx(latency)


def test_a_preemption_counts_once_with_its_latencies_from_the_jobs_own_record():
    m = DaemonMetrics(DEFAULT_LADDER, since=0)
    observe(m, *PREEMPTED, PREEMPTED[-1], PREEMPTED[-1])  # every cycle sees the record again: each counts once
    assert value(m, "hai_suspensions_total", level="LOW", cause="preempted") == 1
    assert value(m, "hai_forced_suspensions_total", level="LOW") == 0
    assert value(m, "hai_restarts_total", level="LOW") == 1
    assert value(m, "hai_suspend_checkpoint_seconds_sum", level="LOW") == 1.5  # notice -> go_suspend
    assert value(m, "hai_preemption_latency_seconds_sum", level="LOW", cause="preempted") == 3.0  # -> requeued
    assert value(m, "hai_preemption_latency_seconds_bucket", level="LOW", cause="preempted", le="3.0") == 1
    assert value(m, "hai_preemption_latency_seconds_bucket", level="LOW", cause="preempted", le="2.0") == 0
    assert value(m, "hai_restart_latency_seconds_sum", level="LOW") == 3.0  # requeued -> running again
    # a second suspend, forced this time, by the user: only what is new counts
    said_1 = SAID_0.replace("0:go_suspend:preempted:110.000:111.500", "1:forced:user:120.000:125.000")
    observe(m, replace(PREEMPTED[-1], comment=said_1),
            job(1, qos="low", reason="BeginTime", restart_count=2, submit_time=126, comment=said_1))
    assert value(m, "hai_suspensions_total", level="LOW", cause="preempted") == 1
    assert value(m, "hai_suspensions_total", level="LOW", cause="user") == 1
    assert value(m, "hai_forced_suspensions_total", level="LOW") == 1
    assert value(m, "hai_preemption_latency_seconds_sum", level="LOW", cause="user") == 6.0
    assert value(m, "hai_suspend_checkpoint_seconds_count", level="LOW") == 1  # no go_suspend that time
    # the daemon saw the job only once it ran again: the suspend and the restart still count
    seen_late = DaemonMetrics(DEFAULT_LADDER, since=0)
    observe(seen_late, PREEMPTED[-1])
    assert value(seen_late, "hai_suspensions_total", level="LOW", cause="preempted") == 1
    assert value(seen_late, "hai_restart_latency_seconds_sum", level="LOW") == 3.0


def test_a_part_of_a_job_in_place_leaves_and_rejoins_by_its_tasks_record():
    """Each part is a task of its array with its own record: its departure (hai-left, which
    its task writes) counts once by why; its start after it left is a rejoin, never the
    job's restart."""
    m = DaemonMetrics(DEFAULT_LADDER, since=0)
    for _ in range(2):
        m.observe_cycle([part(11, left="0:preempted@150.000", state="PENDING", restart_count=1),
                         part(12, left="0:failed@150.500", state="FAILED"),
                         part(13, left="0:below_min@170.000", state="PENDING", restart_count=1)], 0.1, 0)
    m.observe_cycle([part(11, left="0:preempted@150.000", restart_count=1, start_time=158, submit_time=151)], 0.1, 0)
    m.observe_cycle([part(11, left="1:time_limit@172.000", state="PENDING", restart_count=2)], 0.1, 0)
    assert value(m, "hai_part_departures_total", level="LOW", cause="preempted") == 1
    assert value(m, "hai_part_departures_total", level="LOW", cause="failed") == 1
    assert value(m, "hai_part_departures_total", level="LOW", cause="below_min") == 1
    assert value(m, "hai_part_departures_total", level="LOW", cause="time_limit") == 1
    assert value(m, "hai_part_rejoins_total", level="LOW") == 1
    assert value(m, "hai_part_rejoin_latency_seconds_sum", level="LOW") == 8.0  # left 150 -> back 158
    assert value(m, "hai_restarts_total", level="LOW") == 0
    # a task of a plain array is a job of its own: its restart is a restart
    m.observe_cycle([job(21, state="RUNNING", qos="low", array_job_id=20, restart_count=1, start_time=200)], 0.1, 0)
    assert value(m, "hai_restarts_total", level="LOW") == 1


def test_what_happened_before_the_daemon_started_is_not_counted():
    """A daemon restarted between a suspend and its restart: the suspend (go_suspend at 111.5)
    and its requeue were counted by the daemon before it; the restart (116) is new."""
    m = DaemonMetrics(DEFAULT_LADDER, since=112.0)
    observe(m, *PREEMPTED)
    assert value(m, "hai_suspensions_total", level="LOW", cause="preempted") == 0
    assert value(m, "hai_suspend_checkpoint_seconds_count", level="LOW") == 0
    assert value(m, "hai_preemption_latency_seconds_count", level="LOW", cause="preempted") == 0
    assert value(m, "hai_restarts_total", level="LOW") == 1
    assert value(m, "hai_restart_latency_seconds_sum", level="LOW") == 3.0


@pytest.mark.parametrize("said, counted_as", [
    ("0:go_suspend:rm_rf:110:111.5", "unknown"),  # a word, not a cause
    ("0:go_suspend:" + "x" * 33 + ":110:111.5", None),  # longer than a word: the tag is ignored
    ("0:go_suspend:no-such:110:111.5", None), ("0:go_suspend:user:nan:111.5", None),
    ("0:go_suspend:user:110:1e300", None), ("7:go_suspend:user:110:111.5", None),  # a run to come
])
def test_what_a_job_says_of_itself_cannot_invent_labels(said, counted_as):
    """The comment is the job owner's to write: a cause outside the vocabulary is `unknown`,
    a malformed tag (or one naming a run the job has not had) counts nothing."""
    m = DaemonMetrics(DEFAULT_LADDER, since=0)
    observe(m, *(replace(r, comment=f"hai-suspend={said}") for r in PREEMPTED[:3]))
    counted = {c: value(m, "hai_suspensions_total", level="LOW", cause=c) for c in (*CAUSES, "none")}
    assert counted == {c: float(c == counted_as) for c in counted}
    causes = {s.labels["cause"] for fam in m.registry.collect() if fam.name == "hai_suspensions" for s in fam.samples}
    assert causes == {"preempted", "user", "time_limit", "unknown", "none"}


def test_a_go_suspend_unasked_counts_as_none():
    m = DaemonMetrics(DEFAULT_LADDER, since=0)
    unasked = SAID_0.replace("preempted:110.000", "none:0")
    observe(m, *(replace(r, comment=unasked) for r in PREEMPTED[1:]))
    assert value(m, "hai_suspensions_total", level="LOW", cause="none") == 1
    assert value(m, "hai_suspend_checkpoint_seconds_count", level="LOW") == 0
    assert value(m, "hai_preemption_latency_seconds_count", level="LOW", cause="none") == 0
    assert value(m, "hai_restart_latency_seconds_sum", level="LOW") == 3.0


def test_the_daemon_feeds_its_cycle_time_and_errors():
    held = job(2, reason="JobHoldMaxRequeue", priority=0)
    slurm = FakeSlurm([held], fail_jobs=1, fail_on={("release", 2)})
    m = DaemonMetrics(DEFAULT_LADDER, since=0)
    d = PolicyDaemon(slurm, policy=load_policy(LOCAL), clock=lambda: NOW, metrics=m)
    assert value(m, "hai_daemon_errors_total", kind="slurm") == 0  # exists before the first error
    assert d.run(once=True) == 1  # Slurm did not answer
    assert d.run(once=True) == 1  # the release failed: --once says so
    assert value(m, "hai_daemon_errors_total", kind="slurm") == 1
    assert value(m, "hai_daemon_errors_total", kind="action") == 1
    assert value(m, "hai_daemon_cycle_seconds_count") == 1
    assert value(m, "hai_pending_jobs", level="NORMAL", reason="JobHoldMaxRequeue") == 1


def test_metrics_are_served_over_http_in_the_exposition_format():
    m = DaemonMetrics(DEFAULT_LADDER, since=0)
    m.observe_cycle([job(1, state="RUNNING", qos="low", num_nodes=4, user="hai-alice")], 0.05, 0)
    m.serve(0, "127.0.0.1")
    try:
        port = m._server.server_port
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        m.close()
    assert 'hai_nodes_held{level="LOW",user="hai-alice"} 4.0' in text.splitlines()
    assert 'hai_suspensions_total{cause="preempted",level="EXTREME_HIGH"} 0.0' in text.splitlines()
    assert "hai_daemon_cycle_seconds_count 1.0" in text.splitlines()


# ------------------------------------------------------------------ hai-admin daemon --metrics-port


@pytest.fixture
def no_prometheus_client(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # `import prometheus_client` fails
    monkeypatch.delitem(sys.modules, "slurm_hai.controller.metrics", raising=False)


def test_the_daemon_runs_without_prometheus_client_unless_metrics_are_asked_for(tmp_path, monkeypatch,
                                                                                no_prometheus_client):
    slurm = FakeSlurm([job(2, reason="JobHoldMaxRequeue", priority=0)])
    monkeypatch.setattr("slurm_hai.cli.admin.backend", lambda **_: slurm)
    args = ["daemon", "--policy", str(LOCAL), "--once", "--lock", str(tmp_path / "l.lock")]
    r = CliRunner().invoke(admin, args)
    assert r.exit_code == 0, r.output
    assert slurm.calls == [("release", 2)]
    r = CliRunner().invoke(admin, [*args, "--metrics-port", "9"])
    assert r.exit_code == 1
    assert r.output == ("Error: --metrics-port needs the prometheus_client library: "
                        "pip install 'slurm-hai[metrics]'\n")
    assert slurm.calls == [("release", 2)]  # nothing more was done


def test_a_taken_metrics_port_is_one_line(tmp_path, monkeypatch):
    import socket

    monkeypatch.setattr("slurm_hai.cli.admin.backend", lambda **_: FakeSlurm())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = CliRunner().invoke(admin, ["daemon", "--policy", str(LOCAL), "--once", "--lock", str(tmp_path / "l"),
                                       "--metrics-port", str(port), "--metrics-address", "127.0.0.1"])
    assert r.exit_code == 1
    assert r.output == f"Error: cannot serve metrics on 127.0.0.1:{port}: Address already in use\n"
    r = CliRunner().invoke(admin, ["daemon", "--policy", str(LOCAL), "--metrics-port", "0"])
    assert r.exit_code == 2 and "--metrics-port" in r.output


# ------------------------------------------------------------------ contrib/grafana

DASHBOARD = Path(__file__).resolve().parents[2] / "contrib" / "grafana" / "slurm-hai.json"
PROMQL_FUNCTIONS = {"sum", "rate", "increase", "histogram_quantile", "max_over_time"}
PROMQL_WORDS = {"by"}


def exported() -> tuple[set[str], set[str]]:
    """The sample names and label names of a scrape after cycles that fed every series."""
    m = DaemonMetrics(DEFAULT_LADDER, since=0)
    observe(m, *PREEMPTED, part(11, left="0:preempted@150.000", state="PENDING", restart_count=1),
            part(11, left="0:preempted@150.000", restart_count=1, start_time=158))
    m.observe_cycle([PREEMPTED[-1], job(2)], 0.1, 0)
    samples = [s for fam in m.registry.collect() for s in fam.samples if not s.name.endswith("_created")]
    return {s.name for s in samples}, {label for s in samples for label in s.labels}


def dashboard_queries() -> list[str]:
    return [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]


def test_the_grafana_dashboard_queries_only_series_the_daemon_exports():
    import re

    names, labels = exported()
    queries = dashboard_queries()
    assert len(queries) >= 10
    used = set()
    for q in queries:
        grouped = re.findall(r"\bby \(([^)]*)\)", q)
        assert {g.strip() for group in grouped for g in group.split(",")} <= labels, q
        bare = re.sub(r"\bby \([^)]*\)|\[[^\]]*\]|\{[^}]*\}", "", q)  # groupings, ranges, matchers
        for word, call in re.findall(r"\b([a-zA-Z_:][\w:]*)\s*(\(?)", bare):
            if call:
                assert word in PROMQL_FUNCTIONS | PROMQL_WORDS, (word, q)
            else:
                assert word in names, (word, q)
                used.add(word.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count"))
    # every series the daemon exports has a panel
    assert used >= {n.removesuffix("_bucket") for n in names if not n.endswith(("_sum", "_count"))}, used
