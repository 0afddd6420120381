"""`hai list` / `hai status` on a faked queue: one squeue call, other users' files unread."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from slurm_hai.cli import common, user
from slurm_hai.jobs.jobdir import JobDir
from slurm_hai.slurm.records import JobInfo


def job(job_id: int, owner: str, state: str, root: str, qos: str = "low") -> JobInfo:
    return JobInfo(job_id=job_id, name=f"j{job_id}", user=owner, state=state, reason="None", qos=qos,
                   partition="gpu", num_nodes=1, node_list="n1" if state == "RUNNING" else "",
                   restart_count=0, submit_time=1_000, start_time=2_000 if state == "RUNNING" else 0,
                   eligible_time=0, priority=1, comment=f"hai-dir={root}")


class CountingSlurm:
    name = "fake"

    def __init__(self, queue: list[JobInfo]) -> None:
        self.queue, self.calls = queue, []

    def jobs(self, job_ids=(), user=None):
        self.calls.append(("jobs", tuple(job_ids), user))
        return [j for j in self.queue if (not job_ids or j.job_id in job_ids) and (user is None or j.user == user)]

    def job(self, job_id):
        found = self.jobs([job_id])
        return found[0] if found else None


@pytest.fixture
def world(monkeypatch, tmp_path):
    me = common.current_user()
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    for root in (mine, theirs):
        root.mkdir()
    # the other user's directory says "stopped": reading it would show through
    other = JobDir.for_job(12, theirs).create()
    (other.path / "final.json").write_text(json.dumps({"state": "stopped", "exit_code": 0, "t": 5}))
    queue = [job(11, me, "RUNNING", str(mine)), job(12, "someone-else", "RUNNING", str(theirs)),
             job(13, "third-user", "PENDING", str(theirs), qos="high.u.third-user")]
    slurm = CountingSlurm(queue)
    policy_reads = []
    real = user.find_policy
    monkeypatch.setattr(user, "find_policy", lambda: policy_reads.append(1) or real())
    monkeypatch.setattr(user, "backend", lambda: slurm)
    monkeypatch.setattr(common, "backend", lambda: slurm)
    monkeypatch.setattr(user, "may_read", lambda j: j is None or j.user == me)  # as a non-root user
    monkeypatch.setenv("HAI_HOME", str(tmp_path / "home"))
    return slurm, policy_reads


def test_list_all_takes_one_squeue_call_and_one_policy_read(world):
    slurm, policy_reads = world
    r = CliRunner().invoke(user.main, ["list", "--all", "--json"])
    assert r.exit_code == 0, r.output
    rows = {row["job_id"]: row for row in json.loads(r.output)}
    assert sorted(rows) == [11, 12, 13]
    assert slurm.calls == [("jobs", (), None)] and policy_reads == [1]
    # the other user's job is what Slurm shows: running, not the "stopped" in their files
    assert rows[12]["state"] == "running" and rows[12]["private"] is True and rows[11]["private"] is False
    assert rows[13]["level"] == "HIGH" and rows[13]["state"] == "waiting"


def test_list_all_reads_no_other_users_directory_also_for_root(world, monkeypatch):
    monkeypatch.setattr(user, "may_read", lambda j: True)  # root may read every job's files
    r = CliRunner().invoke(user.main, ["list", "--all", "--json"])
    assert r.exit_code == 0, r.output
    rows = {row["job_id"]: row for row in json.loads(r.output)}
    assert rows[12]["state"] == "running" and rows[12]["private"] is True  # not the "stopped" of its directory
    r = CliRunner().invoke(user.main, ["status", "12", "--json"])  # one job's status reads its directory
    assert json.loads(r.output)["state"] == "finished-stopped", r.output


def test_status_of_another_users_job_says_whose_it_is_in_words(world):
    r = CliRunner().invoke(user.main, ["status", "12"])
    assert r.exit_code == 0, r.output
    assert "someone-else" in r.output and "running" in r.output and "LOW" in r.output
    assert "private to them" in r.output and "Errno" not in r.output


def test_logs_of_another_users_job_is_one_line_not_an_errno(world):
    r = CliRunner().invoke(user.main, ["logs", "12"])
    assert r.exit_code == 1
    assert r.output.strip() == "Error: job 12 belongs to someone-else; its logs are private to them"


def test_a_rank_the_job_does_not_have_is_no_such_rank(world):
    r = CliRunner().invoke(user.main, ["logs", "11", "--rank", "1"])
    assert r.exit_code == 1 and "has no rank 1" in r.output and "no output yet" not in r.output


def test_the_ranks_of_a_job_in_place_are_its_parts_running_or_not(world, tmp_path):
    # job 11 runs on one node now, as one of its 4 parts: parts 0-3 are its ranks
    jobdir = JobDir.for_job(11, tmp_path / "mine").create()
    (jobdir.path / "job.json").write_text(json.dumps({"nodes": 2, "node_range": "2:4", "parts": 4}))
    jobdir.rank_log(3).write_text(f"{JobDir.run_line(0, 3)}on n4 ====\nstep 1\n{JobDir.run_line(1, 3)}on n2 ====\n")
    r = CliRunner().invoke(user.main, ["logs", "11", "--rank", "3", "--json"])
    assert r.exit_code == 0, r.output
    assert [run["run"] for run in json.loads(r.output)["runs"]] == [0, 1]
    r = CliRunner().invoke(user.main, ["logs", "11", "--rank", "4"])
    assert r.exit_code == 1 and r.output.strip() == (
        "Error: job 11 has no part 4: it runs as 4 parts, 0 to 3 (--rank P shows part P)")


def test_list_state_filter_and_a_mistyped_state(world):
    r = CliRunner().invoke(user.main, ["list", "--all", "--state", "waiting", "--json"])
    assert [row["job_id"] for row in json.loads(r.output)] == [13]
    r = CliRunner().invoke(user.main, ["list", "--state", "runing"])
    assert r.exit_code == 2 and "did you mean running?" in r.output


def test_since_accepts_durations_clock_times_and_dates():
    now = 1_800_000_000.0
    assert user.parse_since("2h", now) == now - 7200
    assert user.parse_since("30m", now) == now - 1800
    assert user.parse_since("2027-01-15", now) > 0
    with pytest.raises(common.Refused):
        user.parse_since("yesterday", now)


def test_follow_prints_markers_in_time_order_once_settled(capsys):
    late_notice = {"t": 100.0, "event": "notice", "run": 0, "cause": "user", "grace": 5}
    early_suspend = {"t": 100.5, "event": "go_suspend", "run": 0}
    rest = user._show_markers([early_suspend, late_notice], None, None, settled=100.2)
    assert rest == [early_suspend] and "suspend notice: by you" in capsys.readouterr().err
    assert user._show_markers(rest, None, None, settled=None) == []
    assert "go_suspend() called" in capsys.readouterr().err


def test_logs_follow_asks_slurm_about_its_own_job_only_every_few_seconds(world, monkeypatch, tmp_path, capsys):
    slurm, _ = world
    mine = JobDir.for_job(11, tmp_path / "mine").create()
    mine.rank_log(0).write_text("hello\n")

    class Clock:  # 0.5 s per tick, no real waiting; the job ends after 30 s
        now = 1_000.0

        def monotonic(self):
            return self.now

        def time(self):
            return self.now

        def sleep(self, s):
            self.now += s
            if self.now >= 1_030 and mine.final() is None:
                mine.set_final("succeeded", 0)

    monkeypatch.setattr(user, "time", Clock())
    user.follow_logs(11, rank=0, restart=None)
    asked = [c for c in slurm.calls if c[0] == "jobs"]
    assert all(c[1] == (11,) for c in asked)  # never the whole queue
    assert 5 <= len(asked) <= 8  # the lookup, then once per 5 s over 30 s (not 60 times)
    out = capsys.readouterr()
    assert out.out == "hello\n" and out.err.strip().endswith("---- job 11 finished-succeeded")


def test_your_rows_take_their_places_among_everyone_elses_in_job_id_order():
    theirs = [["1", "4", "9"], ["a1", "a4", "a9"]]
    merged = user._merged([1, 4, 9], theirs, [0, 5, 6, 10], [["0", "5", "6", "10"], ["b0", "b5", "b6", "b10"]])
    assert merged == [["0", "1", "4", "5", "6", "9", "10"], ["b0", "a1", "a4", "b5", "b6", "a9", "b10"]]
    assert user._merged([], [[], []], [3], [["3"], ["b3"]]) == [["3"], ["b3"]]
