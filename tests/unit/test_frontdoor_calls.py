"""Every `hai` and `hai-submit` command reads the whole queue once and the policy once at most
(`hai status` of a running or ended job reads that job alone: one small RPC);
`hai logs -f` asks Slurm about its own job only, and not while the job is printing.

A fake Backend records every call; the click commands run through CliRunner on a small
queue with job directories (running, waiting, suspended, ended, forgotten, another user's).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import slurm_hai.policy.model
from slurm_hai.cli import common, user
from slurm_hai.cli import submit as submit_cli
from slurm_hai.jobs.jobdir import JobDir
from slurm_hai.slurm.records import JobInfo
from test_frontdoor_submit import FakeSlurm  # the node group hai-submit checks requests against

POLICY = str(Path(__file__).resolve().parents[2] / "contrib" / "localcluster" / "policy.toml")
QUEUE_READS = ("jobs", "job", "accounting")  # each one squeue call (or pyslurm load)


class RecordingBackend:
    """The Backend interface over a list of jobs; every call is recorded as (t, name, *args)."""

    name = "recording"

    def __init__(self, queue: list[JobInfo], clock=lambda: 0.0) -> None:
        self.queue, self.clock, self.calls = queue, clock, []
        self.history: dict[int, JobInfo] = {}  # what slurmdbd still has of jobs slurmctld forgot

    def _record(self, name: str, *args) -> None:
        self.calls.append((self.clock(), name, *args))

    def reads(self) -> list[tuple]:
        return [c for c in self.calls if c[1] in QUEUE_READS]

    def whole_queue_reads(self) -> list[tuple]:
        return [c for c in self.calls if c[1:] == ("jobs", (), None)]

    def jobs(self, job_ids=(), user=None):
        self._record("jobs", tuple(job_ids), user)
        return [j for j in self.queue if (not job_ids or j.job_id in job_ids) and (user is None or j.user == user)]

    def job(self, job_id):
        self._record("job", job_id)
        return next((j for j in self.queue if j.job_id == job_id), None)

    def accounting(self, job_id):
        self._record("accounting", job_id)
        return self.history.get(job_id)

    def submit(self, script, args=()):
        self._record("submit")
        job_id = max(j.job_id for j in self.queue) + 1
        self.queue.append(slurm_job(job_id, common.current_user(), "PENDING", qos="high"))
        return job_id

    def cancel(self, job_id, signal=None):
        self._record("cancel", job_id, signal)

    def preempt_sends_user_signal(self):
        self._record("preempt_sends_user_signal")
        return True

    def users(self):  # sacctmgr: accounting, not the queue
        self._record("users")
        return [{"User": common.current_user(), "DefaultAccount": "hai"}]

    def associations(self):
        self._record("associations")
        return [{"Account": "hai", "User": common.current_user(), "Partition": "", "QOS": "normal"}]

    def __getattr__(self, name):
        """Any other call: recorded, and answered by hai-submit's fake cluster (its node group)."""
        answer = getattr(FakeSlurm(), name, None)
        if not callable(answer):
            raise AssertionError(f"unexpected backend call {name}: teach RecordingBackend or FakeSlurm")

        def recorded(*args, **kwargs):
            self._record(name, *args, *kwargs.values())
            return answer(*args, **kwargs)

        return recorded


def slurm_job(job_id: int, owner: str, state: str, qos: str = "low", reason: str = "None", restarts: int = 0,
              root: str = "") -> JobInfo:
    running, now = state == "RUNNING", int(time.time())
    return JobInfo(job_id=job_id, name=f"j{job_id}", user=owner, state=state, reason=reason, qos=qos,
                   partition="gpu", num_nodes=1, node_list="n1" if running else "", restart_count=restarts,
                   submit_time=now - 3600, start_time=now - 1800 if running else 0, eligible_time=0, priority=1,
                   comment=f"hai-dir={root}" if root else "", end_time=now + 3600 if running else 0)


@pytest.fixture
def world(monkeypatch, tmp_path):
    """My jobs 21 (running), 22 (waiting), 23 (suspended: preempted by 24), 25 (ended, still in
    Slurm), 27 (ended, forgotten by Slurm); 24 (running, HIGH) and 26 (waiting) of others."""
    me = common.current_user()
    home = tmp_path / "home"
    monkeypatch.setenv("HAI_HOME", str(home))
    monkeypatch.delenv("SLURM_CONF", raising=False)
    monkeypatch.setenv("HAI_POLICY", POLICY)
    for job_id in (21, 22, 23, 25, 27):
        d = JobDir.for_job(job_id).create()
        (d.path / "job.json").write_text(json.dumps({"name": f"j{job_id}", "nodes": 1, "level": "LOW", "user": me}))
        d.event("submit", level="LOW", nodes=1)
    JobDir.for_job(21).event("start", run=0, nodes="n1")
    JobDir.for_job(21).rank_log(0).write_text("step 1\n")
    for e in ({"event": "start", "run": 0}, {"event": "notice", "run": 0, "cause": "preempted", "by_job": 24},
              {"event": "suspended", "run": 0, "how": "go_suspend"}):
        JobDir.for_job(23).event(e.pop("event"), **e)
    for job_id in (25, 27):
        JobDir.for_job(job_id).set_final("succeeded", 0)
    queue = [slurm_job(21, me, "RUNNING"), slurm_job(22, me, "PENDING", reason="Priority"),
             slurm_job(23, me, "PENDING", reason="Priority", restarts=1),
             slurm_job(24, "someone-else", "RUNNING", qos="high", root=str(tmp_path / "theirs")),
             slurm_job(25, me, "COMPLETED"), slurm_job(26, "someone-else", "PENDING", reason="Priority")]
    slurm = RecordingBackend(queue)
    monkeypatch.setattr(common, "slurm_backend", lambda: slurm)
    policy_reads: list[str] = []
    real = slurm_hai.policy.model.load_policy
    monkeypatch.setattr(slurm_hai.policy.model, "load_policy", lambda p: policy_reads.append(str(p)) or real(p))
    monkeypatch.setattr(user, "may_read", lambda j: j is None or j.user == me)  # as a non-root user
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    return slurm, policy_reads, str(script)


HAI_COMMANDS = [
    ["status", "21"], ["status", "22"], ["status", "23"], ["status", "24"], ["status", "25"], ["status", "27"],
    ["status", "21", "--json"], ["status"], ["status", "--json"],
    ["list"], ["list", "--all"], ["list", "--json"], ["list", "--since", "1d"], ["list", "--state", "finished"],
    ["quota"], ["quota", "--json"],
    ["logs", "21"], ["logs", "21", "--json"], ["logs", "22"], ["logs", "24"],
    ["stop", "22"], ["suspend", "21"], ["suspend", "22"], ["suspend", "24"],
]
SUBMIT_COMMANDS = [["-p", "HIGH"], ["-p", "AUTO"], ["--dry-run", "-p", "AUTO"], ["--json", "-n", "2", "-p", "AUTO"]]


@pytest.mark.parametrize("argv", HAI_COMMANDS, ids=" ".join)
def test_every_hai_command_reads_the_queue_and_the_policy_once_at_most(world, argv):
    slurm, policy_reads, _ = world
    r = CliRunner().invoke(user.main, argv)
    assert r.exception is None or isinstance(r.exception, SystemExit), r.output
    assert len(slurm.whole_queue_reads()) <= 1 and len(slurm.reads()) <= 2, (
        f"hai {' '.join(argv)} read the queue {len(slurm.reads())} times: {slurm.calls}")
    assert len(policy_reads) <= 1, f"hai {' '.join(argv)} read the policy {len(policy_reads)} times"


@pytest.mark.parametrize("argv", SUBMIT_COMMANDS, ids=" ".join)
def test_every_submit_reads_the_queue_and_the_policy_once_at_most(world, argv):
    slurm, policy_reads, script = world
    r = CliRunner().invoke(submit_cli.main, [*argv, script])
    assert r.exit_code == 0, r.output
    assert len(slurm.reads()) <= 1 and len(policy_reads) <= 1, slurm.calls


def test_status_of_a_waiting_job_is_one_read_of_the_queue_and_one_of_the_policy(world):
    slurm, policy_reads, _ = world
    r = CliRunner().invoke(user.main, ["status", "23", "--json"])
    assert r.exit_code == 0, r.output
    st = json.loads(r.output)
    # the policy explained it from the queue, and the queue told when job 24 ends
    assert st["state"] == "suspended" and "position" in st["reason"] and "job 24 ends" in st["reason"]
    assert [c[1:] for c in slurm.reads()] == [("job", 23), ("jobs", (), None)] and policy_reads == [POLICY]


def test_status_of_a_running_job_reads_that_job_alone(world):
    slurm, policy_reads, _ = world
    r = CliRunner().invoke(user.main, ["status", "21", "--json"])
    assert r.exit_code == 0, r.output
    st = json.loads(r.output)
    assert st["state"] == "running" and st["reason"].startswith("running at LOW on 1 node for"), st
    assert [c[1:] for c in slurm.reads()] == [("job", 21)] and policy_reads == [POLICY]


def test_status_of_an_ended_job_asks_slurm_about_that_job_alone(world):
    slurm, policy_reads, _ = world
    r = CliRunner().invoke(user.main, ["status", "25", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["state"] == "finished-succeeded"
    # the policy is read once, for its daemon's address (asked while Slurm is asked for the job)
    assert [c[1:] for c in slurm.reads()] == [("job", 25)] and policy_reads == [POLICY]


def test_status_of_a_job_slurmctld_forgot_comes_from_accounting_only_then(world):
    slurm, _, _ = world
    slurm.history[31] = slurm_job(31, common.current_user(), "FAILED")
    r = CliRunner().invoke(user.main, ["status", "31", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["state"].startswith("finished"), r.output
    assert [c[1] for c in slurm.reads()] == ["job", "accounting"]  # sacct only for what squeue forgot
    r = CliRunner().invoke(user.main, ["status", "32"])
    assert r.exit_code == 1 and "no job 32" in r.output


def test_list_reads_the_whole_queue_once_however_many_jobs(world):
    slurm, policy_reads, _ = world
    r = CliRunner().invoke(user.main, ["list", "--all", "--since", "1d", "--json"])
    assert r.exit_code == 0, r.output
    assert {row["job_id"] for row in json.loads(r.output)} == {21, 22, 23, 24, 25, 26, 27}
    assert [c[1:] for c in slurm.reads()] == [("jobs", (), None)] and policy_reads == [POLICY]


def test_list_of_your_jobs_reads_the_whole_queue_only_for_one_that_waits_in_line(world):
    slurm, _, _ = world
    me = common.current_user()
    r = CliRunner().invoke(user.main, ["list", "--json"])  # 22 waits for nodes: its place in line
    assert r.exit_code == 0 and [c[1:] for c in slurm.reads()] == [("jobs", (), me), ("jobs", (), None)], r.output
    slurm.queue = [j for j in slurm.queue if j.user != me or j.state != "PENDING"]
    slurm.calls.clear()
    r = CliRunner().invoke(user.main, ["list", "--json"])
    assert r.exit_code == 0 and {row["job_id"] for row in json.loads(r.output)} == {21, 25}, r.output
    assert [c[1:] for c in slurm.reads()] == [("jobs", (), me)]


def test_suspend_of_a_job_that_does_not_run_says_its_state_from_one_read(world):
    slurm, policy_reads, _ = world
    r = CliRunner().invoke(user.main, ["suspend", "22"])
    assert r.exit_code == 1 and "job 22 is waiting, not running" in r.output
    assert [c[1:] for c in slurm.reads()] == [("job", 22)] and policy_reads == []
    assert not [c for c in slurm.calls if c[1] == "cancel"]


class Clock:
    """Fake time for `hai logs -f`: each sleep moves it on and lets `on_tick` change the world."""

    def __init__(self, on_tick) -> None:
        self.now, self.on_tick = 1_000.0, on_tick

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.on_tick(self.now - 1_000.0)


def assert_polls_own_job_only(reads: list[tuple], job_id: int, quiet_from: float, until: float) -> None:
    """One read when following starts; later reads of this job alone, none while output
    was still coming (before `quiet_from`), FOLLOW_SLURM_EVERY s apart at least."""
    assert reads and all(c[1:] in (("job", job_id), ("jobs", (job_id,), None)) for c in reads), reads
    times = [t - 1_000.0 for t, *_ in reads]
    assert not [t for t in times[1:] if t < quiet_from], f"asked Slurm while the job was printing: {times}"
    assert all(b - a >= user.FOLLOW_SLURM_EVERY for a, b in zip(times, times[1:])), times
    assert len(times) <= 2 + (until - quiet_from) / user.FOLLOW_SLURM_EVERY, times


def test_logs_follow_polls_its_own_job_throttled_and_not_while_printing(world, monkeypatch, capsys):
    slurm, policy_reads, _ = world
    log, job = JobDir.for_job(21).rank_log(0), JobDir.for_job(21)

    def on_tick(elapsed: float) -> None:
        if elapsed < 20:  # prints a line every tick for 20 s, then is quiet; ends at 40 s
            with open(log, "a") as f:
                f.write(f"step at {elapsed:.1f}\n")
        elif elapsed >= 40 and job.final() is None:
            job.set_final("succeeded", 0)

    clock = Clock(on_tick)
    monkeypatch.setattr(user, "time", clock)
    slurm.clock = clock.monotonic
    r = CliRunner().invoke(user.main, ["logs", "-f", "21"])
    assert r.exit_code == 0, r.output
    assert "step at 19.5" in r.output and "---- job 21 finished-succeeded" in r.output
    assert_polls_own_job_only(slurm.reads(), 21, quiet_from=20, until=40)
    assert policy_reads == []


def test_logs_follow_of_a_quiet_job_notices_its_end_without_final_json(world, monkeypatch):
    slurm, _, _ = world

    def on_tick(elapsed: float) -> None:  # cancelled by an administrator at 10 s: no final.json
        if elapsed >= 10:
            slurm.queue[0] = slurm_job(21, common.current_user(), "CANCELLED")

    clock = Clock(on_tick)
    monkeypatch.setattr(user, "time", clock)
    slurm.clock = clock.monotonic
    r = CliRunner().invoke(user.main, ["logs", "-f", "21"])
    assert r.exit_code == 1 and "---- job 21 finished-stopped" in r.output  # the job did not succeed
    assert clock.now - 1_000 <= 10 + user.FOLLOW_SLURM_EVERY + user.FOLLOW_TICK
    assert_polls_own_job_only(slurm.reads(), 21, quiet_from=0, until=clock.now - 1_000)


@pytest.mark.parametrize("ends, exit_code", [("succeeded", 0), ("failed", 1)])
def test_submit_follow_polls_its_own_job_after_one_read_at_most(world, monkeypatch, ends, exit_code):
    slurm, policy_reads, script = world
    first = max(j.job_id for j in slurm.queue) + 1  # the id the fake backend gives the job

    def on_tick(elapsed: float) -> None:
        if elapsed >= 12 and JobDir.for_job(first).final() is None:
            JobDir.for_job(first).set_final(ends, 0 if ends == "succeeded" else 3)

    clock = Clock(on_tick)
    monkeypatch.setattr(user, "time", clock)
    monkeypatch.setattr(submit_cli, "time", clock)
    slurm.clock = clock.monotonic
    r = CliRunner().invoke(submit_cli.main, ["-f", "-p", "AUTO", script])
    assert r.exit_code == exit_code and f"---- job {first} finished-{ends}" in r.output, r.output
    reads = slurm.reads()
    own = [c for c in reads if c[1:] in (("job", first), ("jobs", (first,), None))]
    before = reads[:len(reads) - len(own)]  # AUTO may read the queue once, before the job exists
    assert len(before) <= 1 and reads[len(before):] == own and len(policy_reads) <= 1, reads
    assert_polls_own_job_only(own, first, quiet_from=0, until=clock.now - 1_000)
