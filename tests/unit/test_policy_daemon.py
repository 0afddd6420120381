"""The policy daemon's I/O loop with a fake Slurm, its leader lock, and the hai-admin CLI."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_hai.cli.admin import main as admin
from slurm_hai.controller.daemon import MAX_BACKOFF, LockBusy, PolicyDaemon, leader_lock
from slurm_hai.policy.model import load_policy
from slurm_hai.policy.rules import OVERLOOKED_AFTER
from slurm_hai.slurm import SlurmError
from slurm_hai.slurm.records import JobInfo

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "contrib" / "localcluster" / "policy.toml"
NOW = 1_800_000_000


def job(job_id: int, **kw) -> JobInfo:
    d = dict(job_id=job_id, name="j", user="hai-alice", state="PENDING", reason="Priority", qos="normal",
             partition="gpu", num_nodes=1, node_list="", restart_count=0, submit_time=NOW - 100 + job_id,
             start_time=0, eligible_time=NOW - 100, priority=11_000_000, admin_comment="hai-level=NORMAL")
    d.update(kw)
    return JobInfo(**d)


class FakeSlurm:
    name = "fake"

    def __init__(self, jobs=(), fail_jobs: int = 0, fail_on: set[tuple[str, int]] = frozenset()):
        self.queue = list(jobs)
        self.calls: list[tuple] = []
        self.fail_jobs = fail_jobs
        self.fail_on = set(fail_on)
        self.run_ends: dict[int, str] = {}  # slurmdbd: how each job's last run ended; default REQUEUED
        self.run_end_asks: list[list[int]] = []

    def last_run_ends(self, job_ids):
        self.run_end_asks.append(list(job_ids))
        if self.run_ends is None:
            raise SlurmError("sacct: error: Problem talking to the database: Connection refused")
        return {jid: self.run_ends.get(jid, "REQUEUED") for jid in job_ids if self.run_ends.get(jid, "REQUEUED")}

    def jobs(self, job_ids=(), user=None):
        if self.fail_jobs:
            self.fail_jobs -= 1
            raise SlurmError("squeue: slurm_load_jobs error: Unable to contact slurm controller")
        return list(self.queue)

    def _call(self, kind, job_id, *rest):
        self.calls.append((kind, job_id, *rest))
        if (kind, job_id) in self.fail_on:
            raise SlurmError(f"scontrol: {kind} {job_id} refused")

    def update_job(self, job_id, **fields):
        self._call("update", job_id, fields)

    def requeue(self, job_id):
        self._call("requeue", job_id)

    def release(self, job_id):
        self._call("release", job_id)

    def cancel(self, job_id, signal=None):
        self._call("signal", job_id, signal)

    def idle_nodes(self):
        return {"gpu": 0}

    def array_task(self, job_id):
        self.calls.append(("array_task", job_id))
        return f"{job_id}_2"


def test_the_daemon_grows_an_elastic_job_once_nodes_stayed_idle_for_grow_after():
    policy = load_policy(LOCAL)
    clock = [NOW]
    slurm = FakeSlurm([job(1, state="RUNNING", qos="low", reason="None", num_nodes=2, start_time=NOW - 999,
                           admin_comment="hai-level=LOW hai-nodes=2:4:1")])
    slurm.idle_nodes = lambda: {"gpu": 2}
    d = PolicyDaemon(slurm, policy=policy, clock=lambda: clock[0])
    while clock[0] < NOW + policy.grow_after_seconds:
        d.cycle()
        clock[0] += 2
    assert slurm.calls == []  # idle, but not yet for grow_after
    d.cycle()
    assert [c[0] for c in slurm.calls] == ["update", "signal"]
    assert f"hai-grow=4@{clock[0]}" in slurm.calls[0][2]["AdminComment"]
    # a cycle that did not look at idle nodes (nothing could grow) starts the watch again
    slurm.calls.clear()
    slurm.queue = [job(1, state="RUNNING", qos="low", reason="None", num_nodes=4, start_time=NOW - 999,
                       admin_comment="hai-level=LOW hai-nodes=2:4:1")]
    d.cycle()
    slurm.queue[0] = replace(slurm.queue[0], num_nodes=2)
    clock[0] += 2
    d.cycle()
    assert slurm.calls == []


def test_cycle_carries_out_and_logs_each_action(caplog):
    slurm = FakeSlurm([job(1, state="RUNNING", qos="low", start_time=NOW - 60, preempt_time=NOW - 10,
                           reason="None"),
                       job(2, reason="JobHoldMaxRequeue", priority=0)])
    d = PolicyDaemon(slurm, policy=load_policy(LOCAL), clock=lambda: NOW)
    with caplog.at_level(logging.INFO, logger="hai-policyd"):
        result = d.cycle()
    assert slurm.calls == [("requeue", 1), ("release", 2)]
    assert result.jobs == 2 and result.failed == 0
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("job 1: requeue [force-requeue] ignored its suspend notice") for line in lines)
    assert any(line.startswith("job 2: release [release] held by Slurm's requeue limit") for line in lines)


def test_a_job_holding_its_arrays_id_is_named_as_its_task_while_other_tasks_are_known():
    """Slurm acts on every task of an array named by the array's id, which the task started
    last (or the pending rest) holds as its own: that one is named ARRAY_TASK, asked of Slurm.
    A task with an id of its own, and a job whose array has no other task known, by its id."""
    held = dict(reason="JobHoldMaxRequeue", priority=0)
    slurm = FakeSlurm([job(10, array_job_id=10, **held), job(11, array_job_id=10, **held),
                       job(12, state="RUNNING", reason="None", start_time=NOW - 60, array_job_id=10),
                       job(20, array_job_id=20, **held)])
    PolicyDaemon(slurm, policy=load_policy(LOCAL), clock=lambda: NOW).cycle()
    assert slurm.calls == [("array_task", 10), ("release", "10_2"), ("release", 11), ("release", 20)]


def test_failed_action_is_logged_and_not_retried_at_once(caplog):
    held = job(2, reason="JobHoldMaxRequeue", priority=0)
    slurm = FakeSlurm([held, job(3, reason="JobHoldMaxRequeue", priority=0)], fail_on={("release", 2)})
    clock = [NOW]
    d = PolicyDaemon(slurm, policy=load_policy(LOCAL), clock=lambda: clock[0])
    with caplog.at_level(logging.INFO, logger="hai-policyd"):
        assert d.cycle().failed == 1
    assert slurm.calls == [("release", 2), ("release", 3)]  # the failure does not stop the cycle
    assert any("job 2: release failed [release]: scontrol: release 2 refused" in r.getMessage()
               for r in caplog.records)
    d.cycle()
    assert slurm.calls.count(("release", 2)) == 1
    clock[0] += 31
    d.cycle()
    assert slurm.calls.count(("release", 2)) == 2


def test_a_failed_action_holds_back_the_same_action_for_that_run_only():
    """A release that failed waits RETRY_AFTER; the job requeued since (a new run) is released
    at once: the wait is for the run whose action failed."""
    slurm = FakeSlurm([job(2, reason="JobHoldMaxRequeue", priority=0)], fail_on={("release", 2)})
    d = PolicyDaemon(slurm, policy=load_policy(LOCAL), clock=lambda: NOW)
    d.cycle()
    d.cycle()
    assert slurm.calls.count(("release", 2)) == 1
    slurm.queue = [job(2, reason="JobHoldMaxRequeue", priority=0, restart_count=1)]
    d.cycle()
    assert slurm.calls.count(("release", 2)) == 2


def test_dry_run_changes_nothing(caplog):
    slurm = FakeSlurm([job(2, reason="JobHoldMaxRequeue", priority=0)])
    d = PolicyDaemon(slurm, policy=load_policy(LOCAL), dry_run=True, clock=lambda: NOW)
    with caplog.at_level(logging.INFO, logger="hai-policyd"):
        d.cycle()
    assert slurm.calls == []
    assert any(r.getMessage().startswith("would: job 2: release") for r in caplog.records)


def test_slurm_down_is_retried_with_backoff(caplog, monkeypatch):
    slurm = FakeSlurm([job(2, reason="JobHoldMaxRequeue", priority=0)], fail_jobs=2)
    d = PolicyDaemon(slurm, policy=load_policy(LOCAL), interval=0.01, clock=lambda: NOW)
    stop = threading.Event()
    waits: list[float] = []

    def fake_wait(timeout):
        waits.append(timeout)
        if slurm.calls:
            return True  # stop once it acted
        return False

    monkeypatch.setattr(stop, "wait", fake_wait)
    with caplog.at_level(logging.INFO, logger="hai-policyd"):
        assert d.run(stop=stop) == 0
    assert waits[:2] == [0.02, 0.04]  # doubled each time
    assert slurm.calls == [("release", 2)]
    msgs = [r.getMessage() for r in caplog.records]
    assert any("Slurm did not answer (squeue: slurm_load_jobs error" in m for m in msgs)
    assert "Slurm answers again" in msgs


def test_the_back_off_stops_at_ten_seconds_so_the_daemon_looks_soon_after_slurm_is_back(monkeypatch):
    slurm = FakeSlurm([job(2, reason="JobHoldMaxRequeue", priority=0)], fail_jobs=8)
    d = PolicyDaemon(slurm, policy=load_policy(LOCAL), interval=0.5, clock=lambda: NOW)
    stop = threading.Event()
    waits: list[float] = []
    monkeypatch.setattr(stop, "wait", lambda timeout: waits.append(timeout) or bool(slurm.calls))
    assert d.run(stop=stop) == 0
    assert waits[:8] == [1, 2, 4, 8, 10, 10, 10, 10] and MAX_BACKOFF == 10


def test_once_reports_a_failed_cycle():
    d = PolicyDaemon(FakeSlurm(fail_jobs=1), policy=load_policy(LOCAL))
    assert d.run(once=True) == 1


def test_policy_is_reloaded_when_the_file_changes(tmp_path, caplog):
    path = tmp_path / "policy.toml"
    path.write_text("grace_seconds = 5\n")
    d = PolicyDaemon(FakeSlurm(), policy_path=path)
    path.write_text("grace_seconds = 9\n")
    future = time.time() + 10
    import os

    os.utime(path, (future, future))
    with caplog.at_level(logging.INFO, logger="hai-policyd"):
        d.cycle()
    assert d.policy.grace_seconds == 9
    path.write_text("grace_seconds = 'x'\n")
    os.utime(path, (future + 10, future + 10))
    with caplog.at_level(logging.INFO, logger="hai-policyd"):
        d.cycle()
    assert d.policy.grace_seconds == 9  # a broken edit keeps the previous policy
    assert any("policy not reloaded" in r.getMessage() for r in caplog.records)


def test_only_one_leader(tmp_path):
    path = tmp_path / "run" / "policyd.lock"
    first = leader_lock(path)
    try:
        with pytest.raises(LockBusy, match="another hai-admin daemon holds"):
            leader_lock(path)
        got = []
        stop = threading.Event()
        t = threading.Thread(target=lambda: got.append(leader_lock(path, wait=True, stop=stop)))
        t.start()
        time.sleep(0.3)
        assert got == []  # standing by
    finally:
        first.release()
    t.join(5)
    assert len(got) == 1 and got[0].is_locked
    got[0].release()


# ------------------------------------------------------------------ hai-admin CLI (no cluster needed)


def test_admin_help_reads_like_a_man_page():
    r = CliRunner().invoke(admin, ["--help"])
    assert r.exit_code == 0
    for word in ("render", "plan", "apply", "daemon", "check", "Exit status"):
        assert word in r.output
    r = CliRunner().invoke(admin, ["daemon", "--help"])
    assert "JobHoldMaxRequeue" in r.output and "--once" in r.output and "--interval" in r.output


def test_admin_check_and_bad_policy_is_one_line(tmp_path):
    r = CliRunner().invoke(admin, ["check", "--policy", str(LOCAL)])
    assert r.exit_code == 0 and "override for user hai-bob" in r.output
    bad = tmp_path / "policy.toml"
    bad.write_text('[quota.users.alice]\nHIGH = "x"\n')
    r = CliRunner().invoke(admin, ["check", "--policy", str(bad)])
    assert r.exit_code == 1
    assert r.output == f"Error: {bad}: [quota.users.alice] HIGH: expected a non-negative integer, got 'x'\n"
    r = CliRunner().invoke(admin, ["plan", "--policy", str(tmp_path / "missing.toml")])
    assert r.exit_code == 1 and r.output.count("\n") == 1 and "no such policy file" in r.output


def test_admin_without_policy_is_a_usage_error(tmp_path, monkeypatch):
    monkeypatch.delenv("HAI_POLICY", raising=False)
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    monkeypatch.setattr("slurm_hai.policy.model.SYSTEM_POLICY", tmp_path / "none.toml")
    r = CliRunner().invoke(admin, ["plan"])
    assert r.exit_code == 2 and "no policy file: pass --policy FILE" in r.output
    # the example a wheel ships, not one in a source tree the admin may not have
    assert 'cp "$(hai-admin files docs)/policy.example.toml" policy.toml' in r.output and "contrib/" not in r.output


def test_admin_render_writes_every_file(tmp_path):
    r = CliRunner().invoke(admin, ["render", "--policy", str(LOCAL), "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["hai-policy.conf", "job_submit.lua", "partitions.conf", "plugstack.conf", "qos-ladder.sh"]
    assert "PartitionName=gpu" in (tmp_path / "out" / "partitions.conf").read_text()
    assert "levels=EXTREME_HIGH:50," in (tmp_path / "out" / "plugstack.conf").read_text()


def test_admin_daemon_exits_4_when_another_leads(tmp_path):
    lock = leader_lock(tmp_path / "l.lock")
    try:
        r = CliRunner().invoke(admin, ["daemon", "--policy", str(LOCAL), "--once", "--lock", str(tmp_path / "l.lock")])
    finally:
        lock.release()
    assert r.exit_code == 4 and "another hai-admin daemon holds" in r.output


def test_plan_exit_status_says_whether_changes_are_due(monkeypatch):
    import json

    from slurm_hai.policy.ladder import Change, ClusterState

    monkeypatch.setattr("slurm_hai.cli.admin._site_warnings", lambda changes, state, record: [])
    monkeypatch.setattr("slurm_hai.cli.admin._plan", lambda policy, partitions: ([], ClusterState()))
    r = CliRunner().invoke(admin, ["plan", "--policy", str(LOCAL)])
    assert r.exit_code == 0 and "no change" in r.output
    change = Change("modify", "qos", where={"name": "high"}, settings={"GraceTime": "5"}, why="high: GraceTime")
    monkeypatch.setattr("slurm_hai.cli.admin._plan", lambda policy, partitions: ([change], ClusterState()))
    r = CliRunner().invoke(admin, ["plan", "--policy", str(LOCAL)])
    assert r.exit_code == 3
    assert r.output.splitlines()[:2] == ["sacctmgr -i modify qos where name=high set GraceTime=5",
                                         "    # high: GraceTime"]
    assert r.output.splitlines()[-1] == "1 change(s); run `hai-admin apply` to make them"
    monkeypatch.setattr("slurm_hai.cli.admin._site_warnings", lambda changes, state, record: ["high", "normal"])
    r = CliRunner().invoke(admin, ["plan", "--policy", str(LOCAL)])  # the site's own QOS: apply needs --adopt
    assert r.exit_code == 3 and r.output.splitlines()[-1] == "1 change(s); run `hai-admin apply --adopt high,normal` to make them"
    r = CliRunner().invoke(admin, ["plan", "--policy", str(LOCAL), "--json"])
    assert r.exit_code == 3 and json.loads(r.output) == [
        {"argv": ["sacctmgr", "-i", "modify", "qos", "where", "name=high", "set", "GraceTime=5"], "why": "high: GraceTime"}]


def test_replace_keeps_jobinfo_frozen():
    j = job(1)
    assert replace(j, priority=5).priority == 5 and j.priority == 11_000_000


def test_a_record_it_cannot_read_is_logged_and_the_cycle_goes_on(tmp_path, monkeypatch, caplog):
    """The real CLI backend under the daemon, over what Slurm 26.05 printed (a recorded
    fixture) with one record in a shape no Slurm prints: that job is logged and left out,
    the others are still acted on."""
    import json

    from slurm_hai.slurm.cli import CliBackend
    from squeue_text import fake_squeue, recorded_rows

    rows = recorded_rows("26.05.3")
    ids = json.loads((REPO / "tests" / "fixtures" / "slurm" / "26.05.3" / "expected.json").read_text())["jobs"]
    held = next(r for r in rows if r["JobId"] == str(ids["held"]))
    held["Reason"] = "JobHoldMaxRequeue"  # the daemon releases such a job
    broken = next(r for r in rows if r["JobId"] == str(ids["running"]))
    broken["NumNodes"] = "two"
    fake_squeue(tmp_path, rows)
    for name, body in {"scontrol": f"echo \"$@\" >> {tmp_path / 'calls'}",
                       "sinfo": "echo 'gpu idle 0'"}.items():
        (tmp_path / name).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    d = PolicyDaemon(CliBackend(), policy=load_policy(LOCAL), clock=lambda: NOW)
    with caplog.at_level(logging.INFO):
        result = d.cycle()
    assert result.jobs == len(rows) - 1
    assert f"release {ids['held']}" in (tmp_path / "calls").read_text()
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"squeue: job {ids['running']} field NumNodes is 'two', expected a number" in warning


def test_output_that_is_not_the_queue_asked_for_is_a_slurm_error(tmp_path, monkeypatch):
    from slurm_hai.slurm.cli import CliBackend

    (tmp_path / "squeue").write_text("#!/bin/sh\necho 'slurm_load_jobs error: Socket timed out'\n")
    (tmp_path / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    d = PolicyDaemon(CliBackend(), policy=load_policy(LOCAL), clock=lambda: NOW)
    with pytest.raises(SlurmError, match="squeue printed something that is not the queue it was asked for: "
                                         "slurm_load_jobs"):
        d.cycle()


# ------------------------------------------------------------------ the start-now (issues 19, 32)


def test_a_requeue_of_this_second_is_given_the_next_second_at_once_and_only_once():
    held = job(1, reason="BeginTime", restart_count=1, submit_time=NOW, eligible_time=NOW + 6)
    slurm = FakeSlurm([held])
    PolicyDaemon(slurm, policy=load_policy(LOCAL), clock=lambda: NOW + 0.1).cycle()
    assert slurm.calls == [("update", 1, {"StartTime": f"uts{NOW + 1}"})]  # slurmctld's second, not "now"
    slurm.queue = [replace(held, eligible_time=NOW + 1)]  # what Slurm shows once it took it
    PolicyDaemon(slurm, policy=load_policy(LOCAL), clock=lambda: NOW + 0.3).cycle()
    user_begin = job(2, reason="BeginTime", restart_count=1, submit_time=NOW, eligible_time=NOW + 3600)
    slurm.queue = [user_begin]  # its owner's --begin: not Slurm's requeue delay
    PolicyDaemon(slurm, policy=load_policy(LOCAL), clock=lambda: NOW + 0.3).cycle()
    assert len(slurm.calls) == 1


def test_the_daemon_looks_often_at_a_small_queue_and_at_its_interval_at_a_big_one():
    d = PolicyDaemon(FakeSlurm(), policy=load_policy(LOCAL), interval=2.0)
    assert d.pause(0.005) == 0.5  # twice a second: a requeued job is given its start soon
    assert d.pause(0.1) == pytest.approx(0.9)  # cycles take at most a tenth of the time
    assert d.pause(0.62) == 2.0  # 10,000 jobs: never less often than the interval
    assert PolicyDaemon(FakeSlurm(), policy=load_policy(LOCAL), interval=0.1).pause(0.005) == 0.1


def test_the_daemon_looks_again_just_after_a_requeued_jobs_start_second():
    """Given its start, a requeued job may be overlooked by Slurm's scheduler (25.11, 26.05):
    the daemon's next look is OVERLOOKED_AFTER past that second, not its whole pace later."""
    held = job(1, reason="BeginTime", restart_count=1, submit_time=NOW, eligible_time=NOW + 6)
    slurm = FakeSlurm([held])
    d = PolicyDaemon(slurm, policy=load_policy(LOCAL), clock=lambda: NOW + 0.1)
    result = d.cycle()
    assert result.look_at == NOW + 1 + OVERLOOKED_AFTER
    assert d.pause(0.62, result.look_at) == pytest.approx(0.9 + OVERLOOKED_AFTER)  # sooner than a big queue's pace
    assert d.pause(0.005, result.look_at) == 0.5  # never later than its own
    slurm.queue = [replace(held, eligible_time=NOW + 1)]  # Slurm took the start: still due
    d.clock = lambda: NOW + 0.6
    assert d.cycle().look_at == NOW + 1 + OVERLOOKED_AFTER
    d.clock = lambda: NOW + 1 + OVERLOOKED_AFTER  # the look: the job still waits, updated again
    assert d.cycle().look_at is None and slurm.calls[-1] == ("update", 1, {"StartTime": f"uts{NOW + 1}"})
    assert d.pause(0.005, None) == 0.5  # and then the daemon's own pace
    slurm.queue = [job(2, reason="BeginTime", restart_count=1, submit_time=NOW, eligible_time=NOW + 3600)]
    assert d.cycle().look_at is None  # its owner's --begin: nothing to look at


def test_a_job_requeued_by_a_node_failure_waits_for_slurms_delay():
    """The failed node gets the old run's kill when it comes back: a run started there at
    once would end by it (seen on 22.05). Slurm's delay is left as it is."""
    held = job(1, reason="BeginTime", restart_count=1, submit_time=NOW, eligible_time=NOW + 6)
    slurm = FakeSlurm([held])
    slurm.run_ends = {1: "NODE_FAIL"}
    d = PolicyDaemon(slurm, policy=load_policy(LOCAL), clock=lambda: NOW + 0.1)
    assert d.cycle().look_at is None and slurm.calls == []
    d.cycle()
    assert slurm.run_end_asks == [[1]]  # asked once per run
    slurm.queue = [replace(held, restart_count=2, submit_time=NOW + 10, eligible_time=NOW + 16)]  # requeued again
    slurm.run_ends = {1: "PREEMPTED"}
    d.clock = lambda: NOW + 10.1
    d.cycle()
    assert slurm.run_end_asks == [[1], [1]] and slurm.calls == [("update", 1, {"StartTime": f"uts{NOW + 11}"})]


def test_a_run_whose_end_slurmdbd_has_not_recorded_is_asked_again_and_waits_meanwhile():
    held = job(1, reason="BeginTime", restart_count=1, submit_time=NOW, eligible_time=NOW + 6)
    slurm = FakeSlurm([held])
    slurm.run_ends = {1: ""}  # its run still RUNNING in slurmdbd: left out
    d = PolicyDaemon(slurm, policy=load_policy(LOCAL), clock=lambda: NOW + 0.1)
    d.cycle()
    slurm.run_ends = None  # slurmdbd down
    d.cycle()
    assert slurm.calls == []
    slurm.run_ends = {}
    d.cycle()
    assert slurm.run_end_asks == [[1], [1], [1]] and slurm.calls == [("update", 1, {"StartTime": f"uts{NOW + 1}"})]


def test_a_failed_job_whose_run_had_asked_to_be_suspended_is_requeued_once_by_its_own_record():
    """A requeue that slurmctld acknowledged and lost (killed before it saved it: a backup
    took over) leaves the run FAILED; its comment's hai-suspend, which its batch script wrote
    before it asked for the requeue, says it asked to go."""
    failed = dict(state="FAILED", qos="low", start_time=NOW - 60, end_time=NOW - 5, reason="None",
                  admin_comment="hai-level=LOW")
    lost = job(1, comment="hai-dir=/home/a/.hai/jobs hai-suspend=0:go_suspend:preempted:110:111.5", **failed)
    failure = job(2, comment="hai-dir=/home/a/.hai/jobs", **failed)
    slurm = FakeSlurm([lost, failure])
    d = PolicyDaemon(slurm, policy=load_policy(LOCAL), clock=lambda: NOW)
    d.cycle()
    assert slurm.calls == [("requeue", 1)]
    # the word of an earlier run says nothing of this one
    slurm.queue = [replace(lost, restart_count=1)]
    slurm.calls.clear()
    d.cycle()
    assert slurm.calls == []


def test_a_yield_is_decided_on_a_queue_read_after_the_idle_nodes():
    """bob's array task 8 waits for a node and root's later job 12 runs; Slurm starts the task
    on the last idle node between the daemon's queue read and its idle-node read. The first
    read alone would have root's job give way for nothing; the read after the idle nodes
    sees the task running, and nobody yields. With the task still waiting there, root's job does."""
    task = job(8, user="hai-bob", qos="normal.u.hai-bob", reason="Resources", array_job_id=8)
    later = job(12, user="root", state="RUNNING", reason="None", start_time=NOW - 100)

    class Racing(FakeSlurm):
        def __init__(self, started):
            super().__init__([task, later])
            self.started = started

        def idle_nodes(self):  # read after the queue: the task took the node meanwhile
            if self.started:
                self.queue = [replace(task, state="RUNNING", reason="None", start_time=NOW), later]
            return {"gpu": 0}

    for started in (True, False):
        slurm = Racing(started)
        PolicyDaemon(slurm, policy=load_policy(LOCAL), clock=lambda: NOW).cycle()
        assert bool([c for c in slurm.calls if c[:2] == ("signal", 12)]) is not started, slurm.calls
