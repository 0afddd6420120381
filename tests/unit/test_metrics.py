"""The policy daemon's Prometheus metrics (controller/metrics.py) over fake queues and real
job directories, and `hai-admin daemon --metrics-port`."""

from __future__ import annotations

import json
import os
import pwd
import sys
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_hai.cli.admin import main as admin
from slurm_hai.controller.daemon import PolicyDaemon
from slurm_hai.controller.metrics import DaemonMetrics
from slurm_hai.policy.levels import DEFAULT_LADDER, Level
from slurm_hai.policy.model import load_policy
from test_policy_daemon import LOCAL, NOW, FakeSlurm, job

ME = pwd.getpwuid(os.getuid()).pw_name


def hai_job(job_id: int, root: Path, more_tags: str = "", **kw):
    """A job submitted by hai-submit: its comment names its directory's root."""
    return job(job_id, user=ME, comment=f"hai-dir={root} {more_tags}".strip(), **kw)


def write_events(root: Path, job_id: int, *events: dict, partial: str = "") -> Path:
    path = root / str(job_id) / "events.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write("".join(json.dumps(e) + "\n" for e in events) + partial)
    return path


def value(m: DaemonMetrics, name: str, **labels: str) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


# A LOW job preempted once (notice, checkpoint and go_suspend, requeued) and started again.
PREEMPTED = ({"t": 100.0, "event": "start", "run": 0},
             {"t": 110.0, "event": "notice", "run": 0, "cause": "preempted", "by_job": 9},
             {"t": 111.5, "event": "go_suspend", "run": 0},
             {"t": 113.0, "event": "suspended", "run": 0, "how": "go_suspend"},
             {"t": 116.0, "event": "start", "run": 1})


# An elastic job in place (array 10, parts 0-2): part 1 preempted and back, part 2 failed,
# then the two left below MIN.
IN_PLACE = (*({"t": 100.0 + p, "event": "start", "run": 0, "part": p} for p in range(3)),
            {"t": 150.0, "event": "left", "run": 0, "part": 1, "exit_code": 143, "preempted": True},
            {"t": 150.5, "event": "left", "run": 0, "part": 2, "exit_code": 1, "preempted": False},
            {"t": 158.0, "event": "start", "run": 1, "part": 1},
            {"t": 170.0, "event": "left", "run": 0, "part": 0, "exit_code": 75, "preempted": False,
             "below_min": True},
            {"t": 171.0, "event": "left", "run": 1, "part": 1, "exit_code": 75, "preempted": False,
             "below_min": True},
            {"t": 172.0, "event": "left", "run": 1, "part": 0, "exit_code": 76, "preempted": False,
             "time_limit": True})


def in_place(task_id: int, root: Path, array: int = 10):
    """A running part (a task of array `array`) of an elastic job in place of hai-submit."""
    return hai_job(task_id, root, "hai-parts=2:3", state="RUNNING", qos="low", array_job_id=array, restart_count=1)


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


def test_a_sites_ladder_gives_the_series_and_the_level_labels(tmp_path):
    site = (Level(30, "GOLD"), Level(10, "SILVER"), Level(0, "BRONZE"))
    write_events(tmp_path, 1, *PREEMPTED)
    m = DaemonMetrics(site, since=0)
    levels = {s.labels["level"] for fam in m.registry.collect() if fam.name == "hai_restarts" for s in fam.samples}
    assert levels == {"GOLD", "SILVER", "BRONZE"}
    m.observe_cycle([hai_job(1, tmp_path, state="RUNNING", qos="silver.a.research", restart_count=1)], 0.1, 0)
    assert value(m, "hai_suspensions_total", level="SILVER", cause="preempted") == 1
    assert value(m, "hai_nodes_held", level="SILVER", user=ME) == 1


def test_a_preemption_counts_once_with_its_latencies_from_the_job_events(tmp_path):
    write_events(tmp_path, 1, *PREEMPTED)
    m = DaemonMetrics(DEFAULT_LADDER, since=0)
    for _ in range(3):  # every cycle sees the same file: each event counts once
        m.observe_cycle([hai_job(1, tmp_path, state="RUNNING", qos="low", restart_count=1)], 0.1, 0)
    assert value(m, "hai_suspensions_total", level="LOW", cause="preempted") == 1
    assert value(m, "hai_forced_suspensions_total", level="LOW") == 0
    assert value(m, "hai_restarts_total", level="LOW") == 1
    assert value(m, "hai_suspend_checkpoint_seconds_sum", level="LOW") == 1.5  # notice -> go_suspend
    assert value(m, "hai_preemption_latency_seconds_sum", level="LOW", cause="preempted") == 3.0
    assert value(m, "hai_preemption_latency_seconds_bucket", level="LOW", cause="preempted", le="3.0") == 1
    assert value(m, "hai_preemption_latency_seconds_bucket", level="LOW", cause="preempted", le="2.0") == 0
    assert value(m, "hai_restart_latency_seconds_sum", level="LOW") == 3.0  # requeued -> running again
    # a second suspend, forced this time, by the user: only the new lines count
    write_events(tmp_path, 1, {"t": 120.0, "event": "notice", "run": 1, "cause": "user"},
                 {"t": 125.0, "event": "forced_suspend", "run": 1, "after": 5.0},
                 {"t": 126.0, "event": "suspended", "run": 1, "how": "forced"})
    m.observe_cycle([hai_job(1, tmp_path, qos="low", restart_count=2, reason="BeginTime")], 0.1, 0)
    assert value(m, "hai_suspensions_total", level="LOW", cause="preempted") == 1
    assert value(m, "hai_suspensions_total", level="LOW", cause="user") == 1
    assert value(m, "hai_forced_suspensions_total", level="LOW") == 1
    assert value(m, "hai_preemption_latency_seconds_sum", level="LOW", cause="user") == 6.0
    assert value(m, "hai_suspend_checkpoint_seconds_count", level="LOW") == 1  # no go_suspend that time


def test_a_job_in_place_is_one_job_its_parts_leave_and_rejoin(tmp_path):
    """Three parts (tasks 11-13 of array 10) share the array's directory: each event counts
    once however many parts are in the queue; a part's start after it left is a rejoin (its
    run is the task's own), never the job's restart."""
    write_events(tmp_path, 10, *IN_PLACE)
    parts = [in_place(10 + p, tmp_path) for p in (1, 2, 3)]
    m = DaemonMetrics(DEFAULT_LADDER, since=0)
    for _ in range(2):
        m.observe_cycle(parts, 0.1, 0)
    assert value(m, "hai_part_departures_total", level="LOW", cause="preempted") == 1
    assert value(m, "hai_part_departures_total", level="LOW", cause="failed") == 1
    assert value(m, "hai_part_departures_total", level="LOW", cause="below_min") == 2
    assert value(m, "hai_part_departures_total", level="LOW", cause="time_limit") == 1
    assert value(m, "hai_part_rejoins_total", level="LOW") == 1
    assert value(m, "hai_part_rejoin_latency_seconds_sum", level="LOW") == 8.0  # left 150 -> back 158
    assert value(m, "hai_restarts_total", level="LOW") == 0
    assert value(m, "hai_suspensions_total", level="LOW", cause="none") == 0
    # a task of a plain array is a job of its own: its own directory, not the array's
    write_events(tmp_path, 21, {"t": 200.0, "event": "start", "run": 1})
    m.observe_cycle([hai_job(21, tmp_path, state="RUNNING", qos="low", array_job_id=20, restart_count=1)], 0.1, 0)
    assert value(m, "hai_restarts_total", level="LOW") == 1


def test_events_from_before_the_daemon_started_pair_but_do_not_count(tmp_path):
    """A daemon restarted mid-preemption: the notice is old, the end of the run is new."""
    write_events(tmp_path, 1, *PREEMPTED)
    m = DaemonMetrics(DEFAULT_LADDER, since=112.0)
    m.observe_cycle([hai_job(1, tmp_path, state="RUNNING", qos="low", restart_count=1)], 0.1, 0)
    assert value(m, "hai_suspend_checkpoint_seconds_count", level="LOW") == 0  # go_suspend at 111.5: before
    assert value(m, "hai_suspensions_total", level="LOW", cause="preempted") == 1
    assert value(m, "hai_preemption_latency_seconds_sum", level="LOW", cause="preempted") == 3.0
    assert value(m, "hai_restart_latency_seconds_sum", level="LOW") == 3.0


def test_a_line_still_being_written_waits_for_its_end(tmp_path):
    path = write_events(tmp_path, 1, *PREEMPTED[:3], partial=json.dumps(PREEMPTED[3])[:20])
    m = DaemonMetrics(DEFAULT_LADDER, since=0)
    m.observe_cycle([hai_job(1, tmp_path, state="COMPLETING", qos="low")], 0.1, 0)
    assert value(m, "hai_suspensions_total", level="LOW", cause="preempted") == 0
    with path.open("a") as f:
        f.write(json.dumps(PREEMPTED[3])[20:] + "\n")
    m.observe_cycle([hai_job(1, tmp_path, qos="low", restart_count=1)], 0.1, 0)
    assert value(m, "hai_suspensions_total", level="LOW", cause="preempted") == 1
    assert value(m, "hai_preemption_latency_seconds_sum", level="LOW", cause="preempted") == 3.0


def test_what_a_user_writes_cannot_invent_labels_nor_hang_the_daemon(tmp_path):
    """The hai-dir comment and the file are the user's: a cause outside the vocabulary is
    `unknown`; a file of another owner, a FIFO (it does not block) or a path no file can
    have is not read."""
    write_events(tmp_path / "a", 1, {"t": 1.0, "event": "notice", "run": 0, "cause": "x" * 100},
                 {"t": 2.0, "event": "suspended", "run": 0, "how": "go_suspend"}, {"t": "nan", "event": "start"})
    foreign = write_events(tmp_path / "b", 2, *PREEMPTED)
    os.chown(foreign, 65534, 65534)
    (tmp_path / "c" / "3").mkdir(parents=True)
    os.mkfifo(tmp_path / "c" / "3" / "events.jsonl")
    m = DaemonMetrics(DEFAULT_LADDER, since=0)
    m.observe_cycle([hai_job(1, tmp_path / "a", state="RUNNING", qos="low"),
                     hai_job(2, tmp_path / "b", state="RUNNING", qos="high"),
                     hai_job(3, tmp_path / "c", state="RUNNING", qos="high"),
                     hai_job(4, Path("/tmp/a\0b"), state="RUNNING", qos="high")], 0.1, 0)
    assert value(m, "hai_suspensions_total", level="LOW", cause="unknown") == 1
    assert value(m, "hai_suspensions_total", level="HIGH", cause="preempted") == 0
    causes = {s.labels["cause"] for fam in m.registry.collect() if fam.name == "hai_suspensions" for s in fam.samples}
    assert causes == {"preempted", "user", "time_limit", "unknown", "none"}


def test_a_new_directory_for_a_reused_job_id_is_read_from_its_start(tmp_path):
    path = write_events(tmp_path, 1, *PREEMPTED[:4])
    m = DaemonMetrics(DEFAULT_LADDER, since=0)
    m.observe_cycle([hai_job(1, tmp_path, state="RUNNING", qos="low")], 0.1, 0)
    path.parent.rename(tmp_path / ".stale-1")  # JobDir.claim moves an older job's directory aside
    write_events(tmp_path, 1, {"t": 200.0, "event": "start", "run": 0},
                 {"t": 210.0, "event": "suspended", "run": 0, "how": "go_suspend"})
    m.observe_cycle([hai_job(1, tmp_path, state="RUNNING", qos="low")], 0.1, 0)
    assert value(m, "hai_suspensions_total", level="LOW", cause="preempted") == 1
    assert value(m, "hai_suspensions_total", level="LOW", cause="none") == 1  # go_suspend() unasked


def test_jobs_that_never_ran_are_not_read(tmp_path, monkeypatch):
    write_events(tmp_path, 1, {"t": 1.0, "event": "submit"})
    m = DaemonMetrics(DEFAULT_LADDER, since=0)
    opened = []
    monkeypatch.setattr(os, "lstat", lambda p, *a, **kw: opened.append(p) or os.stat(p, follow_symlinks=False))
    m.observe_cycle([hai_job(1, tmp_path, reason="Priority"), job(2, state="RUNNING")], 0.1, 0)
    assert opened == []  # neither the pending job nor a job without a directory (plain sbatch)


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


def exported(tmp_path: Path) -> tuple[set[str], set[str]]:
    """The sample names and label names of a scrape after a cycle that fed every series."""
    write_events(tmp_path, 1, *PREEMPTED)
    write_events(tmp_path, 10, *IN_PLACE)
    m = DaemonMetrics(DEFAULT_LADDER, since=0)
    m.observe_cycle([hai_job(1, tmp_path, state="RUNNING", qos="low", restart_count=1), job(2),
                     in_place(11, tmp_path)], 0.1, 0)
    samples = [s for fam in m.registry.collect() for s in fam.samples if not s.name.endswith("_created")]
    return {s.name for s in samples}, {label for s in samples for label in s.labels}


def dashboard_queries() -> list[str]:
    return [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]


def test_the_grafana_dashboard_queries_only_series_the_daemon_exports(tmp_path):
    import re

    names, labels = exported(tmp_path)
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
