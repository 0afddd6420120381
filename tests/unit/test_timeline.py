"""The timeline: accounting records (one per run) + events.jsonl -> intervals and marks
(slurm_hai/jobs/timeline.py, pure), the page it renders, the sacct read behind it and the
two commands (`hai timeline`, `hai-admin timeline`) over a fake Slurm."""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import re
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_hai.cli import admin, common, user
from slurm_hai.jobs.jobdir import JobDir
from slurm_hai.jobs.timeline import (OTHER_COLOUR, OTHER_LEVEL, build, job_root, level_colours, page,
                                     read_events)
from slurm_hai.policy.levels import DEFAULT_LADDER, Level
from slurm_hai.slurm.base import NodeInfo
from slurm_hai.slurm.cli import CliBackend
from slurm_hai.slurm.records import JobInfo
from test_slurm_commands import fake_commands

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"


def run_record(job_id: int, start: int, end: int, nodes: str, state: str = "COMPLETED", qos: str = "low",
               name: str = "", owner: str = "alice", comment: str = "") -> JobInfo:
    """One accounting record: one run of a job (sacct --duplicates)."""
    return JobInfo(job_id=job_id, name=name or f"j{job_id}", user=owner, state=state, reason="None", qos=qos,
                   partition="gpu", num_nodes=len(nodes.split(",")), node_list=nodes, restart_count=0,
                   submit_time=start - 5, start_time=start, eligible_time=start - 5, priority=1, comment=comment,
                   end_time=end)


def ev(event: str, t: float, **fields) -> dict:
    return {"t": t, "event": event, **fields}


# Job 10 (LOW) runs on n1,n2, gets the notice from job 11 (HIGH), suspends itself and is
# requeued; job 11 runs on n1,n2; job 10 runs again on n3,n4 and finishes.
PREEMPTED = [run_record(10, 100, 200, "n[1-2]", state="REQUEUED"), run_record(10, 260, 400, "n[3-4]"),
             run_record(11, 203, 300, "n[1-2]", qos="high")]
PREEMPTED_EVENTS = {
    10: [ev("submit", 99, level="LOW", nodes=2), ev("start", 101, run=0, nodes="n[1-2]"),
         ev("notice", 190, run=0, cause="preempted", by_job=11, by_level="HIGH", source="signal", grace=5),
         ev("go_suspend", 195, run=0), ev("suspended", 201, run=0, how="go_suspend"),
         ev("start", 261, run=1, nodes="n[3-4]"), ev("finished", 400, run=1, state="succeeded", exit_code=0)],
    11: [ev("submit", 189, level="HIGH", nodes=2), ev("start", 204, run=0, nodes="n[1-2]")],
}


def test_a_requeued_job_is_one_interval_per_run_and_node_coloured_by_its_level():
    tl = build(PREEMPTED, PREEMPTED_EVENTS, since=0, until=1000, ladder=DEFAULT_LADDER)
    got = sorted((i.node, i.job_id, i.run, i.level, i.start, i.end, i.state) for i in tl.intervals)
    assert got == [("n1", 10, 0, "LOW", 100, 200, "REQUEUED"), ("n1", 11, 0, "HIGH", 203, 300, "COMPLETED"),
                   ("n2", 10, 0, "LOW", 100, 200, "REQUEUED"), ("n2", 11, 0, "HIGH", 203, 300, "COMPLETED"),
                   ("n3", 10, 1, "LOW", 260, 400, "COMPLETED"), ("n4", 10, 1, "LOW", 260, 400, "COMPLETED")]
    assert tl.nodes == ("n1", "n2", "n3", "n4") and tl.job_ids == [10, 11]
    assert not any(i.running for i in tl.intervals)
    first = next(i for i in tl.intervals if i.job_id == 10 and i.node == "n1")
    assert "job 10 j10 (alice), LOW, run 0" in first.text and "requeued" in first.text and "n[1-2]" in first.text


def test_a_suspend_is_marked_where_the_job_was_with_the_notice_cause_and_a_restart_where_it_ran_again():
    tl = build(PREEMPTED, PREEMPTED_EVENTS, since=0, until=1000, ladder=DEFAULT_LADDER)
    assert [(m.kind, m.job_id, m.t, m.nodes) for m in tl.marks] == [
        ("suspend", 10, 201, ("n1", "n2")), ("restart", 10, 261, ("n3", "n4"))]
    suspend, restart = tl.marks
    assert "job 10 (LOW) run 0 suspended" in suspend.text and "preempted by job 11 (HIGH)" in suspend.text
    assert "forced" not in suspend.text
    assert "job 10 (LOW) run 1 restarted" in restart.text and "n[3-4]" in restart.text


def part_record(task: int, start: int, end: int, node: str, state: str = "COMPLETED") -> JobInfo:
    """One run of a part of the elastic job in place 30 (array 30, tasks 30-33): accounting
    keeps the admin comment's parts tag (job_submit.lua), not the job's comment."""
    return dataclasses.replace(run_record(task, start, end, node, state=state, name="train"), array_job_id=30,
                               admin_comment="hai-level=LOW hai-grace=5 hai-parts=2:4")


# Parts 0-3 of job 30 on n1-n4 (part 0's task has the array's id, as in Slurm: the last task
# split off the array keeps it); parts 2 and 3 preempted at 150 (job 40 takes n3, n4), back at
# 252 when it ended; they all end at 400. Parts start in any order.
IN_PLACE = [part_record(30 + p, 100, 400, f"n{p + 1}") for p in (0, 1)] + [
    part_record(30 + p, 100, 150, f"n{p + 1}", state="REQUEUED") for p in (2, 3)] + [
    part_record(30 + p, 251, 400, f"n{p + 1}") for p in (2, 3)] + [run_record(40, 151, 250, "n[3-4]", qos="high")]
IN_PLACE_EVENTS = {
    30: [*(ev("start", 101, run=0, part=p, nodes=f"n{p + 1}") for p in (3, 1, 2, 0)),
         ev("left", 150.5, run=0, part=2, exit_code=143, preempted=True),
         ev("left", 150.6, run=0, part=3, exit_code=143, preempted=True),
         ev("start", 252, run=1, part=2, nodes="n3"), ev("start", 252.2, run=1, part=3, nodes="n4"),
         ev("finished", 400, run=0, part=0, state="succeeded", exit_code=0)],
}


def test_a_job_in_place_is_one_job_its_parts_runs_on_their_nodes_and_marks_where_parts_left_and_rejoined():
    tl = build(IN_PLACE, IN_PLACE_EVENTS, since=0, until=1000, ladder=DEFAULT_LADDER)
    assert tl.job_ids == [30, 40]
    got = sorted((i.node, i.job_id, i.part, i.run, i.start, i.end) for i in tl.intervals if i.job_id == 30)
    assert got == [("n1", 30, 0, 0, 100, 400), ("n2", 30, 1, 0, 100, 400),
                   ("n3", 30, 2, 0, 100, 150), ("n3", 30, 2, 1, 251, 400),
                   ("n4", 30, 3, 0, 100, 150), ("n4", 30, 3, 1, 251, 400)]
    third = next(i for i in tl.intervals if i.node == "n3" and i.run == 1)
    assert "job 30 train (alice), LOW, part 2 (Slurm job 32), run 1" in third.text
    assert [(m.kind, m.job_id, m.t, m.nodes) for m in tl.marks] == [
        ("part-left", 30, 150.5, ("n3",)), ("part-left", 30, 150.6, ("n4",)),
        ("part-rejoin", 30, 252, ("n3",)), ("part-rejoin", 30, 252.2, ("n4",))]
    assert "job 30 (LOW) part 2 run 0 left at" in tl.marks[0].text and "preempted" in tl.marks[0].text
    assert "part 3 run 1 rejoined at" in tl.marks[3].text and tl.marks[3].text.endswith("on n4")
    # without the tag (a plain job array), each task is a job of its own, with its own events
    plain = [dataclasses.replace(r, admin_comment="hai-level=LOW") for r in IN_PLACE]
    assert build(plain, IN_PLACE_EVENTS, since=0, until=1000, ladder=DEFAULT_LADDER).job_ids == [30, 31, 32, 33, 40]


def test_why_a_part_left_is_in_its_marks_text():
    events = {30: [ev("start", 101, run=0, part=0, nodes="n1"),
                   ev("left", 110, run=0, part=0, exit_code=75, preempted=False, below_min=True),
                   ev("start", 120, run=1, part=0, nodes="n1"),
                   ev("left", 130, run=1, part=0, exit_code=1, preempted=False, lighthouse_lost=True),
                   ev("start", 140, run=2, part=0, nodes="n1"), ev("left", 150, run=2, part=0, exit_code=3,
                                                                    preempted=False)]}
    tl = build([part_record(30, 100, 160, "n1")], events, since=0, until=1000, ladder=DEFAULT_LADDER)
    left = [m.text for m in tl.marks if m.kind == "part-left"]
    assert ["MIN parts" in left[0], "lighthouse was lost" in left[1], left[2].endswith("it failed (exit 3)")] == [
        True, True, True]


def test_a_run_that_accounting_keeps_without_a_start_is_drawn_from_the_jobs_start_event():
    # Seen on 22.05: a run requeued a second after it started has Start=None in sacct.
    records = [run_record(10, 0, 200, "n[1-2]", state="REQUEUED"), run_record(10, 260, 400, "n[3-4]")]
    events = {10: [ev("start", 199.4, run=0, nodes="n[1-2]"), ev("suspended", 200.6, run=0, how="go_suspend"),
                   ev("start", 261, run=1, nodes="n[3-4]")]}
    tl = build(records, events, since=0, until=1000, ladder=DEFAULT_LADDER)
    assert sorted((i.node, i.run, i.start, i.end) for i in tl.intervals if i.run == 0) == [
        ("n1", 0, 199.4, 200), ("n2", 0, 199.4, 200)]
    assert [(m.kind, m.nodes) for m in tl.marks] == [("suspend", ("n1", "n2")), ("restart", ("n3", "n4"))]
    # a record without a start and without a start event never ran: not drawn
    assert not build([run_record(12, 0, 200, "n1", state="CANCELLED")], {}, since=0, until=1000,
                     ladder=DEFAULT_LADDER).intervals


def test_a_forced_suspend_has_its_own_mark():
    events = {10: [ev("start", 101, run=0), ev("notice", 190, run=0, cause="user", by_uid=0),
                   ev("forced_suspend", 196, run=0, after=5.0), ev("suspended", 197, run=0, how="forced")]}
    tl = build([run_record(10, 100, 196, "n1", state="REQUEUED")], events, since=0, until=1000, ladder=DEFAULT_LADDER)
    (mark,) = tl.marks
    assert (mark.kind, mark.t, mark.nodes) == ("forced-suspend", 197, ("n1",))
    assert "forced off" in mark.text and "hai suspend" in mark.text


def test_shrink_and_grow_events_are_marked_on_the_jobs_nodes_with_their_fields_in_the_hover_text():
    events = {20: [ev("start", 100, run=0), ev("shrink", 150, run=0, nodes="n1", released="n[2-3]"),
                   ev("grow", 250, run=0, nodes="n[1-3]"), ev("grow", 300, run=0)]}
    tl = build([run_record(20, 100, 400, "n[1-3]", qos="normal")], events, since=0, until=1000, ladder=DEFAULT_LADDER)
    assert [(m.kind, m.t, m.nodes) for m in tl.marks] == [
        ("shrink", 150, ("n1", "n2", "n3")), ("grow", 250, ("n1", "n2", "n3")), ("grow", 300, ("n1", "n2", "n3"))]
    assert tl.marks[0].text.startswith("job 20 (NORMAL) run 0 shrank at ")
    assert tl.marks[0].text.endswith(": nodes n1, released n[2-3]")
    assert tl.marks[1].text.endswith(": nodes n[1-3]") and "grew" in tl.marks[2].text


def test_a_running_job_reaches_the_end_of_the_window():
    tl = build([run_record(30, 100, 0, "n2", state="RUNNING")], {}, since=0, until=500, ladder=DEFAULT_LADDER)
    (iv,) = tl.intervals
    assert (iv.start, iv.end, iv.running) == (100, 500, True) and "to now" in iv.text


def test_only_what_falls_in_the_window_is_drawn():
    records = [run_record(40, 10, 50, "n1"), run_record(41, 80, 150, "n1"), run_record(42, 600, 700, "n1"),
               run_record(43, 90, 120, "None assigned"), run_record(44, 0, 0, "")]
    events = {41: [ev("start", 81, run=0), ev("shrink", 95, run=0), ev("grow", 140, run=0)]}
    tl = build(records, events, since=100, until=500, ladder=DEFAULT_LADDER)
    assert tl.job_ids == [41]  # 40 ended before, 42 started after, 43 and 44 never held a node
    assert [(m.kind, m.t) for m in tl.marks] == [("grow", 140)]


def test_rows_are_every_node_asked_for_in_natural_order():
    tl = build([run_record(50, 100, 200, "n10")], {}, since=0, until=300, ladder=DEFAULT_LADDER,
               nodes=["n2", "n1", "n10", "n9"])
    assert tl.nodes == ("n1", "n2", "n9", "n10")


def test_levels_come_from_the_qos_and_a_qos_outside_the_ladder_is_other():
    records = [run_record(60, 100, 200, "n1", qos="very_high"), run_record(61, 100, 200, "n2", qos="auto")]
    levels = {i.job_id: i.level for i in build(records, {}, 0, 300, DEFAULT_LADDER).intervals}
    assert levels == {60: "VERY_HIGH", 61: OTHER_LEVEL}


SITE_LADDER = (Level(30, "GOLD"), Level(10, "SILVER"), Level(0, "BRONZE"))


def test_a_sites_ladder_names_and_colours_the_levels_and_hais_own_names_are_other():
    records = [run_record(62, 100, 200, "n1", qos="gold.a.research"), run_record(63, 100, 200, "n2", qos="high")]
    tl = build(records, {}, 0, 300, SITE_LADDER)
    assert {i.job_id: i.level for i in tl.intervals} == {62: "GOLD", 63: OTHER_LEVEL}
    assert [name for name, _ in tl.levels] == ["GOLD", "SILVER", "BRONZE", OTHER_LEVEL]


def test_each_level_has_its_own_colour_highest_first_and_other_is_grey():
    colours = level_colours(DEFAULT_LADDER)
    assert [name for name, _ in colours] == [lvl.name for lvl in sorted(DEFAULT_LADDER, reverse=True)] + [OTHER_LEVEL]
    assert len({c for _, c in colours}) == len(colours) and colours[-1] == (OTHER_LEVEL, OTHER_COLOUR)
    two = level_colours((Level(1, "B"), Level(9, "A")))
    assert [n for n, _ in two] == ["A", "B", OTHER_LEVEL] and two[0][1] != two[1][1]


def embedded(html: str) -> dict:
    return json.loads(re.search(r'<script type="application/json" id="timeline-data">(.*?)</script>',
                                html, re.S).group(1))


def test_the_page_is_self_contained_and_carries_the_model():
    tl = build(PREEMPTED, PREEMPTED_EVENTS, since=0, until=1000, ladder=DEFAULT_LADDER, nodes=["n1", "n2", "n3", "n4"])
    html = page(tl, "HAI cluster timeline")
    assert embedded(html) == json.loads(json.dumps(tl.as_dict()))
    # nothing to fetch: no external script, style, image or font (the SVG namespace is a name, not a fetch)
    assert not re.search(r"<link|<img|\bsrc=|@import|url\(", html)
    assert set(re.findall(r"https?://[^\s\"'`]+", html)) == {"http://www.w3.org/2000/svg"}


def test_a_job_name_cannot_break_out_of_the_page():
    evil = "</script><script>alert(1)</script>"
    tl = build([run_record(70, 100, 200, "n1", name=evil)], {}, since=0, until=300, ladder=DEFAULT_LADDER)
    html = page(tl, "t")
    assert evil not in html and html.count("<script") == 2
    assert embedded(html)["intervals"][0]["name"] == evil
    assert ".innerHTML" not in html  # the script sets every text as text


def test_events_are_read_from_each_jobs_directory_and_only_what_is_an_event(tmp_path, monkeypatch):
    monkeypatch.setenv("HAI_HOME", str(tmp_path))
    me = pwd.getpwuid(os.getuid()).pw_name
    for job_id in (80, 81, 82, 83):
        JobDir.for_job(job_id).create()
    JobDir.for_job(80).event("start", run=0)
    with open(JobDir.for_job(80).path / "events.jsonl", "a") as f:  # what a crash or a user may leave
        f.write('{"t": 5, "event": "suspended", "run"\n[1, 2]\n"text"\n{"t": "soon", "event": "start"}\n'
                '{"t": NaN, "event": "start"}\n{"t": 7, "event": 3}\n{"t": 8, "event": "start", "run": "x"}\n'
                '{"t": 9, "event": "start", "run": "2"}\n' + "[" * 200_000 + "\n")  # nested past the parser
    secret = tmp_path / "secret"
    secret.write_text('{"t": 1, "event": "start"}\n')
    (JobDir.for_job(81).path / "events.jsonl").symlink_to(secret)  # a link is not followed
    os.mkfifo(JobDir.for_job(82).path / "events.jsonl")  # a FIFO is not waited on
    (JobDir.for_job(83).path / "events.jsonl").write_text('{"t": 1, "event": "start"}\n')
    nobody = pwd.getpwnam("nobody")
    if os.getuid() == 0:  # a file of another owner than the job's user is not read
        os.chown(JobDir.for_job(83).path / "events.jsonl", nobody.pw_uid, nobody.pw_gid)
    records = [run_record(j, 1, 2, "n1", owner=me) for j in (80, 80, 81, 82, 83, 84)]
    records.append(run_record(85, 1, 2, "n1", owner="no-such-user-here"))
    found = read_events(records, me)
    assert sorted(found) == [80, 81, 82, 83, 84, 85]
    assert [(e["event"], e["run"]) for e in found[80]] == [("start", 0), ("start", 2)]
    assert found[81] == found[82] == found[84] == found[85] == []
    assert found[83] == ([] if os.getuid() == 0 else [{"t": 1.0, "event": "start", "run": 0}])
    # the parts of a job in place: the array's directory, once, under the array's id
    JobDir.for_job(90).create()
    JobDir.for_job(90).event("start", run=0, part=1, nodes="n2")
    with open(JobDir.for_job(90).path / "events.jsonl", "a") as f:
        f.write('{"t": 9, "event": "start", "part": "two"}\n{"t": 9, "event": "start", "run": Infinity}\n')
    parts = [dataclasses.replace(run_record(j, 1, 2, "n1", owner=me), array_job_id=90, admin_comment="hai-parts=1:2")
             for j in (90, 91)]
    found = read_events(parts, me)
    assert list(found) == [90] and [(e["run"], e["part"]) for e in found[90]] == [(0, 1)]


def test_a_jobs_root_is_its_comments_hai_dir_else_its_users_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HAI_HOME", str(tmp_path / "mine"))
    me = pwd.getpwuid(os.getuid()).pw_name
    assert job_root(run_record(1, 1, 2, "n1", owner="x", comment=f"hai-dir={tmp_path}/shared"), me) == (
        tmp_path / "shared")
    assert job_root(run_record(1, 1, 2, "n1", owner=me), me) == tmp_path / "mine" / "jobs"
    other = pwd.getpwuid(0).pw_name if me != pwd.getpwuid(0).pw_name else "daemon"
    assert job_root(run_record(1, 1, 2, "n1", owner=other), me) == Path(pwd.getpwnam(other).pw_dir) / ".hai" / "jobs"
    assert job_root(run_record(1, 1, 2, "n1", owner="no-such-user-here"), me) is None


# ------------------------------------------------------------------ the Slurm read


def test_the_accounting_read_asks_sacct_for_every_run_since_then(tmp_path, monkeypatch):
    fixture = FIXTURES / "22.05.8" / "sacct.json"
    calls = fake_commands(tmp_path, monkeypatch, sacct=f"cat {fixture}")
    monkeypatch.setenv("TZ", "UTC")
    records = CliBackend().accounting_since(86400 + 3661)
    assert calls.read_text().split() == ["sacct", "--json", "--duplicates", "--allocations",
                                         "--starttime=1970-01-02T01:01:01", "--endtime=now", "--allusers"]
    requeued = json.loads((FIXTURES / "22.05.8" / "expected.json").read_text())["jobs"]["requeued"]
    assert [r.state for r in records if r.job_id == requeued] == ["REQUEUED", "PENDING"]  # both runs
    owner = records[0].user
    assert {r.user for r in records} == {owner}  # the fixture's jobs are one user's
    assert CliBackend().accounting_since(0, user="someone-else") == []  # 22.05 prints them all the same
    assert calls.read_text().splitlines()[-1].endswith("--user=someone-else")
    assert CliBackend().accounting_since(0, user=owner) == records


# ------------------------------------------------------------------ the commands


class TimelineSlurm:
    """The two reads the timeline makes."""

    name = "fake"

    def __init__(self, records: list[JobInfo]) -> None:
        self.records, self.calls = records, []

    def accounting_since(self, since, user=None):
        self.calls.append(("accounting_since", user))
        return [r for r in self.records if user is None or r.user == user]

    def nodes(self):
        self.calls.append(("nodes",))
        return [NodeInfo(f"n{i}", 8, frozenset({"gpu"})) for i in (1, 2, 3, 4, 5)]


@pytest.fixture
def slurm(monkeypatch, tmp_path):
    me = common.current_user()
    monkeypatch.setenv("HAI_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SLURM_CONF", raising=False)
    monkeypatch.setenv("HAI_POLICY", str(Path(__file__).resolve().parents[2] / "contrib/localcluster/policy.toml"))
    now = int(time.time())
    records = [dataclasses.replace(r, user=me, start_time=now - 1000 + r.start_time,
                                   end_time=now - 1000 + r.end_time) for r in PREEMPTED]
    records.append(run_record(12, now - 500, now - 100, "n5", owner="someone-else"))
    for job_id, events in PREEMPTED_EVENTS.items():  # the story, 1000 s ago
        path = JobDir.for_job(job_id).create().path / "events.jsonl"
        path.write_text("".join(json.dumps(e | {"t": now - 1000 + e["t"]}) + "\n" for e in events))
    fake = TimelineSlurm(records)
    monkeypatch.setattr(common, "slurm_backend", lambda: fake)
    monkeypatch.setattr(admin, "backend", lambda **_: fake)
    return fake


def test_hai_timeline_draws_only_your_jobs_on_the_nodes_they_held(slurm, tmp_path):
    out = tmp_path / "mine.html"
    r = CliRunner().invoke(user.main, ["timeline", "--since", "1h", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"wrote {out}: 2 job(s) on 4 node(s), 2 mark(s)")
    assert slurm.calls == [("accounting_since", common.current_user())]
    data = embedded(out.read_text())
    assert data["nodes"] == ["n1", "n2", "n3", "n4"] and {i["job_id"] for i in data["intervals"]} == {10, 11}
    assert [m["kind"] for m in data["marks"]] == ["suspend", "restart"]


def test_hai_admin_timeline_draws_every_job_on_every_node(slurm, tmp_path):
    r = CliRunner().invoke(admin.main, ["timeline", "--since", "30m", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["nodes"] == ["n1", "n2", "n3", "n4", "n5"]
    assert {i["job_id"] for i in data["intervals"]} == {10, 11, 12}
    assert slurm.calls == [("accounting_since", None), ("nodes",)]


@pytest.mark.parametrize("argv, error", [
    (["--since", "yesterday"], "Error: --since 'yesterday': use 30m, 2h, 1d, HH:MM or YYYY-MM-DD[THH:MM]"),
    (["--since", "1h", "--until", "2h"], "Error: --since 1h is not before --until 2h"),
])
@pytest.mark.parametrize("tool", [user.main, admin.main], ids=["hai", "hai-admin"])
def test_a_bad_window_is_one_line(slurm, tool, argv, error):
    r = CliRunner().invoke(tool, ["timeline", *argv])
    assert r.exit_code == 2 and r.output.strip() == error and slurm.calls == []


def test_an_unwritable_out_file_is_one_line(slurm, tmp_path):
    r = CliRunner().invoke(user.main, ["timeline", "--out", str(tmp_path / "no-such-dir" / "t.html")])
    assert r.exit_code == 1 and r.output.startswith("Error: ") and len(r.output.strip().splitlines()) == 1


def test_the_page_tells_times_as_the_cluster_does_wherever_it_is_opened(monkeypatch):
    monkeypatch.setenv("TZ", "Asia/Kolkata")  # UTC+05:30, no daylight saving
    time.tzset()
    try:
        html = page(build(PREEMPTED, PREEMPTED_EVENTS, since=0, until=1000, ladder=DEFAULT_LADDER), "t")
    finally:
        monkeypatch.undo()
        time.tzset()
    assert 'const OFFSET = 19800, ZONE = "IST";' in html
