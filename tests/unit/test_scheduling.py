"""The policy daemon's decisions (slurm_hai.policy.rules), one rule at a time, and explain()."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from slurm_hai.policy.model import PolicyError, load_policy, parse_policy
from slurm_hai.policy.levels import LEVEL_STRIDE
from slurm_hai.policy.explain import explain
from slurm_hai.policy.rules import (NOTICE_KEPT_INTO_RUN, OVERLOOKED_AFTER, Action, auto_level, decide,
                                    fcfs_priorities, needs_idle_nodes, restart_look_at)
from slurm_hai.policy.tags import notice_value, parse as parse_tags, parse_notice, with_tags
from slurm_hai.slurm.records import JobInfo

REPO = Path(__file__).resolve().parents[2]
POLICY = load_policy(REPO / "contrib" / "localcluster" / "policy.toml")
NOW = 1_800_000_000
BASE = {"HIGH": 31 * LEVEL_STRIDE, "ABOVE_NORMAL": 21 * LEVEL_STRIDE, "NORMAL": 11 * LEVEL_STRIDE,
        "LOW": LEVEL_STRIDE}


def job(job_id: int, state: str = "PENDING", qos: str = "normal", user: str = "hai-alice", nodes: int = 1,
        reason: str | None = None, level: str | None = None, **kw) -> JobInfo:
    lvl_name = level or qos.split(".")[0].upper()
    defaults = dict(
        job_id=job_id, name="j", user=user, state=state,
        reason=reason if reason is not None else ("None" if state == "RUNNING" else "Priority"),
        qos=qos, partition="gpu", num_nodes=nodes, node_list="", restart_count=0,
        submit_time=NOW - 1000 + job_id, start_time=NOW - 100 if state == "RUNNING" else 0,
        eligible_time=NOW - 1000 + job_id, priority=BASE.get(qos.split(".")[0].upper(), 11 * LEVEL_STRIDE),
        admin_comment=f"hai-level={lvl_name}", account="hai",
    )
    defaults.update(kw)
    return JobInfo(**defaults)


def by_rule(actions: list[Action], rule: str) -> list[Action]:
    return [a for a in actions if rule in a.rule.split("+")]


def fields(actions: list[Action], job_id: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for a in actions:
        if a.job_id == job_id and a.kind == "update":
            out.update(a.field_dict())
    return out


# ------------------------------------------------------------------ quiet queue


def test_nothing_to_do_for_a_plain_queue():
    jobs = [job(1, "RUNNING", "high"), job(2, "RUNNING", "normal"), job(3), job(4), job(5, qos="low")]
    assert decide(jobs, POLICY, NOW) == []


# ------------------------------------------------------------------ (g) force a job that ignores its notice


def test_preempted_job_still_running_after_grace_is_requeued():
    jobs = [job(1, "RUNNING", "low", start_time=NOW - 60, preempt_time=NOW - 7)]
    (a,) = decide(jobs, POLICY, NOW)
    assert (a.kind, a.job_id, a.rule) == ("requeue", 1, "force-requeue")
    assert "ignored its suspend notice: preempted 7 s ago, grace 5 s" in a.why


def test_preempted_job_within_grace_is_told_why_once_and_otherwise_left_alone():
    told = f"hai-level=LOW hai-notice=preempted:::0@{NOW - 3}"
    jobs = [job(1, "RUNNING", "low", start_time=NOW - 60, preempt_time=NOW - 3, admin_comment=told)]
    assert decide(jobs, POLICY, NOW) == []
    # just past it: the job's launcher forces the suspend first (it counts from the notice's
    # arrival, after Slurm's whole-second preempt time); the daemon is the backstop
    jobs = [job(1, "RUNNING", "low", start_time=NOW - 60, preempt_time=NOW - 6, admin_comment=told)]
    assert decide(jobs, POLICY, NOW) == []


def test_a_preemption_by_slurm_is_told_in_the_jobs_record_once_with_the_job_it_is_for_and_the_size():
    low = job(1, "RUNNING", "low", nodes=4, start_time=NOW - 60, preempt_time=NOW - 1,
              admin_comment="hai-level=LOW hai-nodes=2:4:1")
    high = job(7, "PENDING", "high", nodes=2, reason="Resources")
    (a,) = decide([low, high, job(8, "PENDING", "normal", reason="Resources")], POLICY, NOW)
    assert (a.kind, a.rule) == ("update", "notice")
    assert fields([a], 1) == {"AdminComment": f"hai-level=LOW hai-nodes=2:4:1 hai-notice=preempted:7:HIGH:2@{NOW - 1}"}
    # told: nothing more, not even for another waiting job that comes since
    told = replace(low, admin_comment=fields([a], 1)["AdminComment"])
    later = decide([told, high, job(9, "PENDING", "extreme_high", reason="Resources")],
                   POLICY, NOW + 1)
    assert [a for a in later if a.job_id == 1] == []
    # a tag of an earlier run tells nothing of this one; a job Slurm does not preempt is not told
    again = replace(told, start_time=NOW + 10, preempt_time=NOW + 20)
    assert fields(decide([again, high], POLICY, NOW + 21), 1)["AdminComment"].endswith(
        f"hai-notice=preempted:7:HIGH:2@{NOW + 20}")
    assert decide([replace(low, preempt_time=0), high], POLICY, NOW) == []


def test_a_notice_tag_stays_while_the_job_waits_and_into_its_next_run_for_its_batch_script():
    tag = f"hai-level=LOW hai-notice=preempted:7:HIGH:0@{NOW - 1}"
    requeued = job(1, "PENDING", "low", reason="BeginTime", restart_count=1, admin_comment=tag)

    def comment_updates(jobs: list[JobInfo], now: int) -> list[tuple[str, str]]:
        return [(a.rule, a.field_dict()["AdminComment"]) for a in decide(jobs, POLICY, now)
                if a.job_id == 1 and "AdminComment" in a.field_dict()]

    assert comment_updates([requeued], NOW + 5) == []  # waits: kept (runtime/batch.py untold_cause reads it)
    again = replace(requeued, state="RUNNING", reason="None", start_time=NOW + 10)
    assert comment_updates([again], NOW + 10 + NOTICE_KEPT_INTO_RUN - 1) == []  # the batch script's read comes first
    assert comment_updates([again], NOW + 10 + NOTICE_KEPT_INTO_RUN) == [("notice", "hai-level=LOW")]


def test_a_job_gets_the_grace_it_asked_for_not_the_policys():
    policy = replace(POLICY, max_grace_seconds=60)
    asked = dict(start_time=NOW - 60, admin_comment=f"hai-level=LOW hai-grace=20 hai-notice=preempted:::0@{NOW - 60}")
    assert decide([job(1, "RUNNING", "low", preempt_time=NOW - 15, **asked)], policy, NOW) == []
    (a,) = decide([job(1, "RUNNING", "low", preempt_time=NOW - 22, **asked)], policy, NOW)
    assert a.rule == "force-requeue" and "grace 20 s" in a.why
    # a stamp beyond the policy's maximum (the policy changed since) counts as grace_seconds
    beyond = dict(asked, admin_comment="hai-level=LOW hai-grace=90")
    (a,) = decide([job(1, "RUNNING", "low", preempt_time=NOW - 7, **beyond)], policy, NOW)
    assert "grace 5 s" in a.why


def test_a_job_that_died_within_its_own_grace_is_requeued():
    policy = replace(POLICY, max_grace_seconds=300)
    died = dict(start_time=NOW - 400, preempt_time=NOW - 250, end_time=NOW - 50)  # 200 s after its notice
    assert by_rule(decide([job(1, "FAILED", "low", **died)], policy, NOW), "requeue-failed") == []
    asked = job(1, "FAILED", "low", admin_comment="hai-level=LOW hai-grace=180", **died)
    assert by_rule(decide([asked], policy, NOW), "requeue-failed")


def test_a_failed_job_that_had_asked_to_be_suspended_is_requeued():
    """Its requeue was lost (its comment's hai-suspend, for its last run), or it died of a
    notice Slurm still knows of, which says more."""
    lost = job(1, "FAILED", "low", start_time=NOW - 60, end_time=NOW - 5, restart_count=2)
    assert decide([lost], POLICY, NOW) == []  # a failure, as far as Slurm tells
    assert decide([replace(lost, comment="hai-suspend=1:go_suspend:none:0:111.5")], POLICY, NOW) == []  # an earlier run's
    lost = replace(lost, comment="hai-dir=/x hai-suspend=2:go_suspend:none:0:111.5")
    (a,) = decide([lost], POLICY, NOW)
    assert (a.kind, a.rule) == ("requeue", "requeue-failed") and "its requeue was lost" in a.why
    (a,) = decide([replace(lost, preempt_time=NOW - 8)], POLICY, NOW)
    assert a.why.startswith("died 3 s after its suspend notice")


def test_old_preempt_time_of_an_earlier_run_is_ignored():
    jobs = [job(1, "RUNNING", "low", start_time=NOW - 60, preempt_time=NOW - 500, restart_count=1)]
    assert decide(jobs, POLICY, NOW) == []


def test_job_that_died_of_its_notice_is_requeued_not_left_failed():
    died = job(1, "FAILED", "low", start_time=NOW - 60, preempt_time=NOW - 10, end_time=NOW - 9)
    (a,) = decide([died], POLICY, NOW)
    assert (a.kind, a.rule) == ("requeue", "requeue-failed")
    # a failure before any preemption, or long after it, is a real failure
    assert decide([replace(died, preempt_time=0)], POLICY, NOW) == []
    assert decide([replace(died, end_time=NOW - 10 + 500)], POLICY, NOW + 600) == []
    assert decide([replace(died, state="COMPLETED")], POLICY, NOW) == []


# ------------------------------------------------------------------ (e) requeue limit


def test_job_held_by_requeue_limit_is_released():
    (a,) = decide([job(1, reason="JobHoldMaxRequeue", priority=0, restart_count=5)], POLICY, NOW)
    assert (a.kind, a.job_id, a.rule) == ("release", 1, "release")


# ------------------------------------------------------------------ (d) requeue delay


def test_requeued_job_held_back_by_begin_time_starts_now():
    j = job(1, reason="BeginTime", restart_count=1, submit_time=NOW - 2, eligible_time=NOW + 3)
    actions = decide([j], POLICY, NOW, run_ends={1: "PREEMPTED"})
    assert fields(actions, 1) == {"StartTime": f"uts{NOW - 1}"}
    assert by_rule(actions, "start-now")
    assert decide([j], POLICY, NOW) == []  # how its run ended not known: Slurm's delay holds


def test_a_job_requeued_after_a_node_failure_keeps_slurms_delay():
    j = job(1, reason="BeginTime", restart_count=1, submit_time=NOW - 2, eligible_time=NOW + 3)
    for failed in ("NODE_FAIL", "BOOT_FAIL"):
        assert decide([j], POLICY, NOW, run_ends={1: failed}) == []
        assert restart_look_at([j], NOW, {1: failed}) is None
    assert restart_look_at([j], NOW - 2, {1: "REQUEUED"}) == NOW - 1 + OVERLOOKED_AFTER


def test_begin_time_of_the_owner_is_respected():
    first_run = job(1, reason="BeginTime", submit_time=NOW - 2, eligible_time=NOW + 3)
    user_begin = job(2, reason="BeginTime", restart_count=1, submit_time=NOW - 2, eligible_time=NOW + 3600)
    assert decide([first_run, user_begin], POLICY, NOW) == []


# ------------------------------------------------------------------ (b) submit-time level back


def test_requeued_job_gets_its_submit_time_level_back():
    moved = job(1, qos="normal", level="ABOVE_NORMAL", restart_count=1)
    bob = job(2, qos="low", user="hai-bob", level="HIGH", restart_count=2)
    actions = decide([moved, bob], POLICY, NOW)
    assert fields(actions, 1) == {"QOS": "above_normal"}
    assert fields(actions, 2) == {"QOS": "high.u.hai-bob"}  # the user's quota variant of the level
    assert "back at its submit-time level ABOVE_NORMAL (was NORMAL)" in by_rule(actions, "restore-level")[0].why


def test_level_is_not_touched_before_a_requeue():
    assert decide([job(1, qos="normal", level="ABOVE_NORMAL")], POLICY, NOW) == []


# ------------------------------------------------------------------ (a) demotion


def test_above_normal_is_marked_demoted_after_its_time():
    p = replace(POLICY, demotion=replace(POLICY.demotion, after_seconds=60))
    young = job(1, "RUNNING", "above_normal", start_time=NOW - 59)
    old = job(2, "RUNNING", "above_normal", start_time=NOW - 61)
    actions = decide([young, old], p, NOW)
    assert [a.job_id for a in actions] == [2]
    assert fields(actions, 2) == {"AdminComment": "hai-level=ABOVE_NORMAL hai-demoted=NORMAL"}
    assert "ABOVE_NORMAL -> NORMAL after 61 s running" in actions[0].why
    # once marked, nothing more to do while it runs
    marked = replace(old, admin_comment="hai-level=ABOVE_NORMAL hai-demoted=NORMAL")
    assert decide([young, marked], p, NOW) == []


def test_the_parts_of_an_elastic_job_in_place_are_demoted_by_the_jobs_first_start():
    """A part that rejoined 5 s ago belongs to a run of 61 s (its peers ran on): demoted with
    them. The tasks of a plain array are jobs of their own: each by its own start."""
    p = replace(POLICY, demotion=replace(POLICY.demotion, after_seconds=60))
    part = dict(qos="above_normal", array_job_id=8, comment="hai-dir=/x hai-parts=2:3")
    parts = [job(31, "RUNNING", start_time=NOW - 61, **part), job(32, "RUNNING", start_time=NOW - 5, **part),
             job(8, "PENDING", restart_count=1, **part)]
    actions = decide(parts, p, NOW)
    assert sorted(a.job_id for a in by_rule(actions, "demote")) == [31, 32]
    assert "ABOVE_NORMAL -> NORMAL after 61 s running" in by_rule(actions, "demote")[1].why
    plain = [replace(j, comment="") for j in parts[:2]]
    assert [a.job_id for a in by_rule(decide(plain, p, NOW), "demote")] == [31]
    # the whole job suspended and started again: a new run, a new clock
    again = [replace(j, start_time=NOW - 5) for j in parts[:2]]
    assert by_rule(decide(again, p, NOW), "demote") == []


def test_demoted_mark_is_dropped_after_a_requeue():
    p = replace(POLICY, demotion=replace(POLICY.demotion, after_seconds=60))
    pending = job(1, qos="above_normal", restart_count=1, admin_comment="hai-level=ABOVE_NORMAL hai-demoted=NORMAL")
    assert fields(decide([pending], p, NOW), 1) == {"AdminComment": "hai-level=ABOVE_NORMAL"}
    rerun = replace(pending, state="RUNNING", start_time=NOW - 5, reason="None")
    assert fields(decide([rerun], p, NOW), 1) == {"AdminComment": "hai-level=ABOVE_NORMAL"}


def demoted_scene(**head_kw):
    p = replace(POLICY, demotion=replace(POLICY.demotion, after_seconds=60))
    d1 = job(1, "RUNNING", "above_normal", nodes=2, start_time=NOW - 300,
             admin_comment="hai-level=ABOVE_NORMAL hai-demoted=NORMAL")
    d2 = job(2, "RUNNING", "above_normal", nodes=2, start_time=NOW - 200,
             admin_comment="hai-level=ABOVE_NORMAL hai-demoted=NORMAL")
    head = job(3, qos="above_normal", user="hai-carol", nodes=2, reason="Resources", **head_kw)
    return p, [d1, d2, head]


def test_demoted_job_yields_to_a_waiting_job_of_its_former_level():
    p, jobs = demoted_scene()
    actions = decide(jobs, p, NOW, idle_nodes={"gpu": 0})
    signal = [a for a in actions if a.kind == "signal"]
    assert [(a.job_id, a.field_dict()) for a in signal] == [(2, {"signal": "USR2"})]  # most recent run first
    assert fields(actions, 2) == {"AdminComment": f"hai-level=ABOVE_NORMAL hai-demoted=NORMAL hai-yield=3@{NOW} "
                                                  f"hai-notice=demoted:3:ABOVE_NORMAL:0@{NOW}"}
    assert "job 3 (ABOVE_NORMAL) needs its nodes" in signal[0].why


def test_no_yield_when_idle_nodes_suffice_or_the_level_preempts_by_itself():
    p, jobs = demoted_scene()
    assert not [a for a in decide(jobs, p, NOW, idle_nodes={"gpu": 2}) if a.kind == "signal"]
    # a HIGH job: Slurm preempts ABOVE_NORMAL by itself
    high = replace(jobs[2], qos="high", admin_comment="hai-level=HIGH", priority=BASE["HIGH"])
    assert not [a for a in decide([*jobs[:2], high], p, NOW, idle_nodes={}) if a.kind == "signal"]
    # a NORMAL job never preempts (demoted jobs count as NORMAL)
    normal = replace(jobs[2], qos="normal", admin_comment="hai-level=NORMAL", priority=BASE["NORMAL"])
    assert not [a for a in decide([*jobs[:2], normal], p, NOW, idle_nodes={}) if a.kind == "signal"]


def test_idle_nodes_are_needed_only_while_a_demoted_job_runs_and_a_job_above_it_waits():
    assert not needs_idle_nodes([job(1), job(2, "RUNNING")], POLICY, NOW)
    p, jobs = demoted_scene()
    assert needs_idle_nodes(jobs, p, NOW)
    assert not needs_idle_nodes(jobs[:2], p, NOW)  # nobody waits
    assert not needs_idle_nodes([jobs[2]], p, NOW)  # nothing demoted runs
    assert not needs_idle_nodes(jobs, replace(p, demotion=None), NOW)


def test_yielding_job_is_requeued_after_grace_and_held_until_the_waiting_job_runs():
    p, jobs = demoted_scene()
    victim = replace(jobs[1], admin_comment=f"{jobs[1].admin_comment} hai-yield=3@{NOW - 2}")
    assert [a for a in decide([jobs[0], victim, jobs[2]], p, NOW) if a.job_id == 2] == []  # within grace
    actions = decide([jobs[0], victim, jobs[2]], p, NOW + 4)
    mine = [(a.kind, a.rule) for a in actions if a.job_id == 2]
    assert mine == [("requeue", "yield"), ("hold", "yield")]
    # requeued by itself (cooperative) but not held yet: hold it
    pending = replace(victim, state="PENDING", reason="BeginTime", restart_count=1, priority=BASE["ABOVE_NORMAL"])
    assert [(a.kind, a.job_id) for a in decide([jobs[0], pending, jobs[2]], p, NOW + 4)] == [("hold", 2)]
    # held: nothing else happens to it while job 3 waits (no start-now, no fcfs)
    held = replace(pending, reason="JobHeldAdmin", priority=0)
    assert [a for a in decide([jobs[0], held, jobs[2]], p, NOW + 4) if a.job_id == 2] == []
    # job 3 runs: release, drop the tag
    running = replace(jobs[2], state="RUNNING", reason="None", start_time=NOW + 5)
    actions = decide([jobs[0], held, running], p, NOW + 6)
    assert [(a.kind, a.job_id) for a in actions] == [("release", 2), ("update", 2)]  # release first: see _pending
    assert fields(actions, 2)["AdminComment"] == "hai-level=ABOVE_NORMAL hai-behind=3"


def test_a_released_job_waits_behind_the_job_it_yielded_to_and_never_takes_its_nodes_back():
    # job 2 (demoted) gave its 2 nodes to carol's job 3 (1 node) and was released: back at
    # ABOVE_NORMAL it is earlier in line than job 3, but taking its nodes back would undo the
    # yield, and after the demotion time the two would trade the nodes forever
    p, jobs = demoted_scene()
    released = replace(jobs[1], state="PENDING", reason="Resources", restart_count=1, start_time=NOW - 60,
                       priority=BASE["ABOVE_NORMAL"], admin_comment="hai-level=ABOVE_NORMAL hai-behind=3")
    taker = replace(jobs[2], state="RUNNING", reason="None", num_nodes=1, start_time=NOW - 50)
    other = job(4, "RUNNING", "above_normal", user="hai-bob", start_time=NOW - 40, admin_comment="hai-level=ABOVE_NORMAL")
    scene = [released, taker]
    assert not [a for a in decide(scene, p, NOW, idle_nodes={"gpu": 1}) if a.kind == "signal"]
    assert explain(released, scene, p, NOW).startswith(
        "waiting for 2 nodes at ABOVE_NORMAL: gave its nodes to job 3 and waits behind it")
    # a later job it did not yield to is still taken, as for any job earlier in line
    actions = decide([*scene, other], p, NOW, idle_nodes={"gpu": 1})
    assert [a.job_id for a in actions if a.kind == "signal"] == [4]
    # running again, the tag goes: the next yield starts afresh
    again = replace(released, state="RUNNING", reason="None", start_time=NOW - 1)
    assert fields(decide([again, taker], p, NOW), 2) == {"AdminComment": "hai-level=ABOVE_NORMAL"}


def test_yielding_job_that_died_of_the_notice_is_requeued():
    p, jobs = demoted_scene()
    dead = replace(jobs[1], state="FAILED", end_time=NOW + 1,
                   admin_comment=f"{jobs[1].admin_comment} hai-yield=3@{NOW - 1}")
    actions = decide([jobs[0], dead, jobs[2]], p, NOW + 2)
    assert [(a.kind, a.job_id, a.rule) for a in actions if a.job_id == 2] == [("requeue", 2, "requeue-failed")]


def test_yield_is_called_off_when_the_waiting_job_is_gone():
    p, jobs = demoted_scene()
    victim = replace(jobs[1], admin_comment=f"{jobs[1].admin_comment} hai-yield=3@{NOW - 2}")
    actions = decide([jobs[0], victim], p, NOW)
    assert [(a.kind, a.job_id) for a in actions] == [("update", 2)]
    assert "preemption called off" in actions[0].why


def test_a_finished_job_with_an_old_yield_tag_blocks_nothing():
    p, jobs = demoted_scene()
    old = job(9, "CANCELLED", "above_normal", admin_comment="hai-level=ABOVE_NORMAL hai-yield=8@1")
    assert [a.job_id for a in decide([old, *jobs], p, NOW, idle_nodes={}) if a.kind == "signal"] == [2]


def test_one_preemption_in_flight_per_group():
    p, jobs = demoted_scene()
    victim = replace(jobs[1], admin_comment=f"{jobs[1].admin_comment} hai-yield=3@{NOW - 1}")
    other = job(4, qos="above_normal", nodes=4, reason="Resources")
    assert not [a for a in decide([jobs[0], victim, jobs[2], other], p, NOW, idle_nodes={}) if a.kind == "signal"]


# ------------------------------------------------------------------ (h) a place in line holds against later jobs


def line_scene(**later_kw):
    """alice's job 10 (requeued: earlier in line) waits for 3 nodes; one node is idle; later
    jobs of other users at NORMAL hold the rest: bob's 20 (started 100 s ago), carol's 30
    (50 s ago), bob's 40 (200 s ago)."""
    head = job(10, nodes=3, reason="Resources", restart_count=1)
    later = [job(20, "RUNNING", "normal.u.hai-bob", user="hai-bob", start_time=NOW - 100, **later_kw),
             job(30, "RUNNING", user="hai-carol", start_time=NOW - 50, **later_kw),
             job(40, "RUNNING", "normal.u.hai-bob", user="hai-bob", start_time=NOW - 200, **later_kw)]
    return [head, *later]


def signals(actions: list[Action]) -> list[int]:
    return [a.job_id for a in actions if a.kind == "signal"]


def test_an_earlier_job_of_another_user_gets_the_nodes_of_later_ones_back():
    jobs = line_scene()
    actions = decide(jobs, POLICY, NOW, idle_nodes={"gpu": 1})
    # just enough (3 nodes, 1 idle), the most recently started first; the tag before the notice
    assert signals(actions) == [30, 20]
    assert [(a.kind, a.job_id) for a in actions if a.rule == "yield"] == [
        ("update", 30), ("update", 20), ("signal", 30), ("signal", 20)]
    assert fields(actions, 30) == {"AdminComment": f"hai-level=NORMAL hai-yield=10@{NOW} "
                                                   f"hai-notice=earlier_in_line:10:NORMAL:0@{NOW}"}
    sig = next(a for a in actions if a.kind == "signal")
    assert sig.field_dict() == {"signal": "USR2"}
    assert "job 10 of hai-alice, earlier in line at NORMAL, needs its nodes" in sig.why
    assert needs_idle_nodes(jobs, POLICY, NOW)


def test_nodes_slurm_frees_by_itself_count_first_and_higher_levels_are_never_taken():
    head, *later = line_scene()
    low = job(50, "RUNNING", "low", user="hai-bob", nodes=2, start_time=NOW - 10)
    # LOW's 2 nodes (Slurm preempts them for NORMAL) + 1 idle: nothing else is needed
    assert signals(decide([head, *later, low], POLICY, NOW, idle_nodes={"gpu": 1})) == []
    # a later HIGH job of another user is above the waiting job: not its to take
    high = job(60, "RUNNING", "high", user="hai-carol", nodes=3, start_time=NOW - 1)
    assert signals(decide([head, high], POLICY, NOW, idle_nodes={"gpu": 0})) == []
    # an earlier job of another user keeps its nodes: it is ahead in line
    early = job(5, "RUNNING", user="hai-bob", nodes=3, start_time=NOW - 1)
    assert signals(decide([head, early], POLICY, NOW, idle_nodes={"gpu": 0})) == []


def test_the_tasks_of_a_job_array_keep_the_arrays_place_in_line():
    """A task of an array gets an id of its own when it starts, later than the jobs submitted
    after the array: its place is the array's. bob's array 8 runs as tasks 31 and 32; alice's
    job 10, submitted after it, waits: bob's tasks are ahead of it, not later in line."""
    head = job(10, nodes=2, reason="Resources")
    tasks = [job(i, "RUNNING", "normal.u.hai-bob", user="hai-bob", start_time=NOW - 100, array_job_id=8)
             for i in (31, 32)]
    assert signals(decide([head, *tasks], POLICY, NOW, idle_nodes={"gpu": 0})) == []
    assert not needs_idle_nodes([head, *tasks], POLICY, NOW)
    # the same two jobs outside an array are later in line: alice gets their nodes
    alone = [replace(t, array_job_id=t.job_id) for t in tasks]
    assert signals(decide([head, *alone], POLICY, NOW, idle_nodes={"gpu": 0})) == [31, 32]
    # and a requeued task waits in the array's place, ahead of job 10 (fcfs: the higher priority)
    waiting = replace(tasks[0], state="PENDING", reason="Priority", start_time=0, restart_count=1)
    prio = {a.job_id: int(a.field_dict()["Priority"]) for a in decide([head, waiting], POLICY, NOW) if a.rule == "fcfs"}
    assert prio.get(31, waiting.priority) > prio.get(10, head.priority)


def test_the_same_users_later_job_is_never_suspended():
    head, *later = line_scene()
    alices = [replace(j, user="hai-alice", qos="normal") for j in later]
    assert signals(decide([head, *alices], POLICY, NOW, idle_nodes={"gpu": 1})) == []
    assert not needs_idle_nodes([head, *alices], POLICY, NOW)
    # her own most recent job is passed over, bob's are taken
    mixed = [later[0], replace(later[1], user="hai-alice"), later[2]]
    assert signals(decide([head, *mixed], POLICY, NOW, idle_nodes={"gpu": 1})) == [20, 40]


def test_a_job_slurm_already_preempts_or_of_another_partition_is_never_taken():
    head, bob, carol, bob2 = line_scene()
    # carol's job has Slurm's notice already: bob's two go instead, the most recent first
    noticed = replace(carol, preempt_time=NOW - 1)
    assert signals(decide([head, bob, noticed, bob2], POLICY, NOW, idle_nodes={"gpu": 1})) == [20, 40]
    # a notice of an earlier run of hers does not count
    earlier = replace(carol, preempt_time=NOW - 60)
    assert signals(decide([head, bob, earlier, bob2], POLICY, NOW, idle_nodes={"gpu": 1})) == [30, 20]
    # bob's job 20 runs in another partition: not the waiting job's to take
    elsewhere = replace(bob, partition="cpu")
    assert signals(decide([head, elsewhere, carol, bob2], POLICY, NOW, idle_nodes={"gpu": 1, "cpu": 0})) == [30, 40]
    # a job waiting in two partitions is first in line in each: it takes the nodes of the one they run in
    both = replace(head, partition="cpu,gpu")
    assert signals(decide([both, bob, carol, bob2], POLICY, NOW, idle_nodes={"gpu": 1, "cpu": 0})) == [30, 20]


def test_jobs_younger_than_min_run_seconds_are_not_taken():
    p = replace(POLICY, min_run_seconds=120)
    jobs = line_scene()
    # only bob's 40 has run 120 s: not enough for 2 nodes, so nothing at all
    assert signals(decide(jobs, p, NOW, idle_nodes={"gpu": 1})) == []
    assert signals(decide(jobs, p, NOW, idle_nodes={"gpu": 2})) == [40]
    assert not needs_idle_nodes(jobs, replace(POLICY, min_run_seconds=300), NOW)


def test_the_per_level_switch_turns_it_off():
    jobs = line_scene()
    for p in (replace(POLICY, fcfs_preempt_levels=("HIGH",)), parse_policy({"fcfs_preempt_levels": []})):
        assert signals(decide(jobs, p, NOW, idle_nodes={"gpu": 1})) == []
        assert not needs_idle_nodes(jobs, p, NOW)
    on = parse_policy({"fcfs_preempt_levels": ["normal", "NORMAL", "LOW"]})
    assert on.fcfs_preempt_levels == ("NORMAL", "LOW") and on.fcfs_preempts("NORMAL")
    assert signals(decide(jobs, on, NOW, idle_nodes={"gpu": 1})) == [30, 20]
    assert parse_policy({}).fcfs_preempt_levels is None and POLICY.fcfs_preempts("UNDER_NORMAL")  # HAI: every level


@pytest.mark.parametrize("value,message", [
    ("NORMAL", "policy.toml: fcfs_preempt_levels: expected a list of level names, got 'NORMAL'"),
    (["NORMAL", "MEDIUM"], "policy.toml: fcfs_preempt_levels: unknown level 'MEDIUM'"),
    ([1], "policy.toml: fcfs_preempt_levels: expected a non-empty string, got 1"),
])
def test_the_per_level_switch_is_checked(value, message):
    with pytest.raises(PolicyError) as e:
        parse_policy({"fcfs_preempt_levels": value})
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_no_suspension_when_idle_nodes_suffice():
    jobs = line_scene()
    assert signals(decide(jobs, POLICY, NOW, idle_nodes={"gpu": 3})) == []
    assert signals(decide(jobs, POLICY, NOW)) == []  # idle nodes not asked for: nothing is preempted
    # a waiting job over its quota would not start on more nodes: alice runs 2 of her 4 NORMAL nodes
    busy = job(7, "RUNNING", nodes=2, start_time=NOW - 500, partition="other")
    assert signals(decide([*jobs, busy], POLICY, NOW, idle_nodes={"gpu": 0})) == []


def test_only_a_job_waiting_for_nodes_and_first_in_line_takes_nodes():
    head, *later = line_scene()
    for not_waiting in (replace(head, reason="BeginTime"), replace(head, reason="JobHeldUser", priority=0),
                        replace(head, reason="Dependency")):
        assert signals(decide([not_waiting, *later], POLICY, NOW, idle_nodes={"gpu": 1})) == []
    # a waiting HIGH job is first in line: the NORMAL one behind it takes nothing meanwhile
    high = job(70, "PENDING", "high", user="hai-carol", nodes=4, reason="Resources", priority=BASE["HIGH"])
    assert signals(decide([head, *later, high], POLICY, NOW, idle_nodes={"gpu": 1})) == []


def test_a_demoted_job_goes_before_a_later_job_of_the_waiting_jobs_own_level():
    p = replace(POLICY, demotion=replace(POLICY.demotion, after_seconds=60))
    head = job(10, "PENDING", "above_normal", nodes=2, reason="Resources")
    demoted = job(5, "RUNNING", "above_normal", user="hai-carol", start_time=NOW - 300,
                  admin_comment="hai-level=ABOVE_NORMAL hai-demoted=NORMAL")
    later = job(20, "RUNNING", "above_normal.u.hai-bob", user="hai-bob", start_time=NOW - 10)
    actions = decide([head, demoted, later], p, NOW, idle_nodes={"gpu": 0})
    assert signals(actions) == [5, 20]
    assert "demoted to NORMAL" in next(a for a in actions if a.kind == "signal" and a.job_id == 5).why


def test_no_loop_the_suspended_job_waits_held_until_the_earlier_one_runs():
    head, bob, carol, bob2 = line_scene()
    tagged = replace(carol, admin_comment=f"hai-level=NORMAL hai-yield=10@{NOW}")
    assert explain(tagged, [head, tagged], POLICY, NOW + 2) == (
        "running at NORMAL; asked to give its nodes to job 10, earlier in line at NORMAL, 2 s ago "
        "(forced off after 5 s)")
    # one preemption in flight per group: nothing more while it is under way
    assert decide([head, bob, tagged, bob2], POLICY, NOW + 2, idle_nodes={"gpu": 1}) == []
    # grace over: requeued and held
    mine = [(a.kind, a.rule) for a in decide([head, tagged, bob2], POLICY, NOW + 6, idle_nodes={"gpu": 2})]
    assert mine == [("requeue", "yield"), ("hold", "yield")]
    assert "later in line, gives its nodes to job 10" in decide([head, tagged], POLICY, NOW + 6)[0].why
    held = replace(tagged, state="PENDING", reason="JobHeldAdmin", priority=0, restart_count=1)
    assert explain(held, [head, held], POLICY, NOW + 7) == (
        "suspended for job 10, earlier in line at NORMAL; waits until that job runs")
    assert decide([head, held], POLICY, NOW + 7, idle_nodes={"gpu": 3}) == []
    # job 10 runs: released, and it waits behind job 10 without taking anything back
    ran = replace(head, state="RUNNING", reason="None", start_time=NOW + 8)
    actions = decide([ran, held], POLICY, NOW + 9, idle_nodes={"gpu": 0})
    assert [(a.kind, a.job_id) for a in actions] == [("release", 30), ("update", 30)]
    assert fields(actions, 30) == {"AdminComment": "hai-level=NORMAL hai-behind=10"}
    waiting = replace(held, reason="Resources", priority=BASE["NORMAL"], admin_comment="hai-level=NORMAL hai-behind=10")
    assert signals(decide([ran, waiting], POLICY, NOW + 10, idle_nodes={"gpu": 0})) == []
    assert not needs_idle_nodes([ran, waiting], POLICY, NOW + 10)


def test_a_yield_tells_its_cause_in_the_same_update_as_its_tag():
    from slurm_hai.jobs.status import notice_cause, why_notice

    head = job(10, nodes=3, reason="Resources")
    carol = job(30, "RUNNING", user="hai-carol", start_time=NOW - 50, admin_comment="hai-level=NORMAL")
    actions = decide([head, carol], POLICY, NOW, idle_nodes={"gpu": 2})
    comment = fields(actions, 30)["AdminComment"]
    assert f"hai-notice=earlier_in_line:10:NORMAL:0@{NOW}" in comment.split()
    me = replace(carol, admin_comment=comment)
    cause = notice_cause(me, [], 0, NOW, 35)  # what the job's launcher reads of its own record
    assert cause == {"cause": "preempted", "by_job": 10, "by_level": "NORMAL", "earlier_in_line": True, "target_size": 0}
    assert why_notice(cause) == "for job 10, earlier in line at NORMAL"


# ------------------------------------------------------------------ (f) AUTO


def test_auto_takes_the_highest_level_with_quota_left():
    used = {("hai-bob", "HIGH"): 1}
    assert auto_level(POLICY, "hai-bob", "hai", 1, {}) == "HIGH"
    assert auto_level(POLICY, "hai-bob", "hai", 1, used) == "ABOVE_NORMAL"
    assert auto_level(POLICY, "hai-bob", "hai", 2, used) == "NORMAL"
    assert auto_level(POLICY, "hai-bob", "hai", 3, used) == "UNDER_NORMAL"  # unlimited
    assert auto_level(POLICY, "hai-alice", "hai", 1, {}) == "EXTREME_HIGH"
    tight = parse_policy({"quota": {lvl: 1 for lvl in ("EXTREME_HIGH", "VERY_HIGH", "HIGH", "ABOVE_NORMAL", "NORMAL",
                                                        "UNDER_NORMAL", "BELOW_NORMAL", "LOW")}})
    full = {("u", lvl.name): 1 for lvl in tight.ladder}
    assert auto_level(tight, "u", "", 1, full) == "EXTREME_HIGH"  # none has room: wait at the highest that fits


def test_pending_auto_jobs_move_to_levels_with_room_in_turn():
    running = job(1, "RUNNING", "high.u.hai-bob", user="hai-bob", level="AUTO")
    a2 = job(2, qos="high.u.hai-bob", user="hai-bob", level="AUTO", reason="QOSMaxNodePerUserLimit")
    a3 = job(3, qos="high.u.hai-bob", user="hai-bob", level="AUTO", reason="QOSMaxNodePerUserLimit")
    actions = decide([running, a2, a3], POLICY, NOW)
    assert fields(actions, 2) == {"QOS": "above_normal.u.hai-bob"}
    assert fields(actions, 3) == {"QOS": "normal.u.hai-bob"}
    assert "AUTO: ABOVE_NORMAL is the highest level where hai-bob has quota" in by_rule(actions, "auto")[0].why


def test_auto_job_moves_back_up_when_quota_frees():
    a2 = job(2, qos="normal.u.hai-bob", user="hai-bob", level="AUTO", reason="Resources")
    assert fields(decide([a2], POLICY, NOW), 2) == {"QOS": "high.u.hai-bob"}


def test_auto_job_already_right_is_left_alone():
    assert decide([job(2, qos="high.u.hai-bob", user="hai-bob", level="AUTO", priority=BASE["HIGH"])],
                  POLICY, NOW) == []


# ------------------------------------------------------------------ (c) FCFS across requeues


def test_requeued_job_keeps_its_place_ahead_of_later_jobs():
    base = BASE["NORMAL"]
    early = job(10, priority=base)
    requeued = job(11, priority=base, restart_count=1, submit_time=NOW - 1)  # submit time reset by the requeue
    later = [job(i, priority=base) for i in range(12, 15)]
    actions = decide([early, requeued, *later], POLICY, NOW)
    prio = {a.job_id: int(a.field_dict()["Priority"]) for a in by_rule(actions, "fcfs")}
    assert prio == {11: base + 1, 10: base + 2}  # later jobs keep Slurm's own priority
    # the order Slurm then uses: priority desc, submit time, job id
    after = [replace(j, priority=prio.get(j.job_id, j.priority)) for j in [early, requeued, *later]]
    order = sorted(after, key=lambda j: (-j.priority, j.submit_time, j.job_id))
    assert [j.job_id for j in order] == [10, 11, 12, 13, 14]
    assert decide(after, POLICY, NOW) == []  # stable: nothing more to change


def test_fcfs_is_per_level_and_partition():
    a = job(1, qos="high", priority=BASE["HIGH"], restart_count=1, submit_time=NOW)
    b = job(2, qos="high", priority=BASE["HIGH"])
    c = job(3, priority=BASE["NORMAL"], restart_count=1, submit_time=NOW)
    d = job(4, priority=BASE["NORMAL"], partition="other")
    prio = {x.job_id: int(x.field_dict()["Priority"]) for x in decide([a, b, c, d], POLICY, NOW)}
    assert prio == {1: BASE["HIGH"] + 1}


def test_fcfs_fixes_a_priority_outside_its_level_band():
    moved = job(1, priority=BASE["HIGH"] + 3)  # explicit priority kept from an earlier level
    assert fields(decide([moved], POLICY, NOW), 1) == {"Priority": str(BASE["NORMAL"])}


def test_fcfs_skips_held_jobs_and_caps_updates():
    base = BASE["NORMAL"]
    jobs = [job(i, priority=base, submit_time=NOW - i) for i in range(1, 50)]  # every submit time reversed
    jobs.append(job(99, priority=0, reason="JobHeldUser"))
    actions = decide(jobs, POLICY, NOW, max_priority_updates=10)
    assert len(actions) == 10 and 99 not in {a.job_id for a in actions}
    assert max(int(a.field_dict()["Priority"]) for a in actions) == base + 48  # the head of the line first


def test_fcfs_priorities_overflowing_the_band_stay_in_it():
    members = [job(i, priority=0, submit_time=NOW - i) for i in range(5)]
    out = fcfs_priorities(members, 100)
    assert out == sorted(out, reverse=True)
    small_band = fcfs_priorities(members, LEVEL_STRIDE)
    assert all(LEVEL_STRIDE <= p < 2 * LEVEL_STRIDE - 1 for p in small_band)


def test_accepts_slurm_rounding_below_the_base():
    # Slurm computes e.g. 30999999 for HIGH (float rounding): already in order, nothing to do
    jobs = [job(1, qos="high", priority=BASE["HIGH"] - 1), job(2, qos="high", priority=BASE["HIGH"] - 1)]
    assert decide(jobs, POLICY, NOW) == []


# ------------------------------------------------------------------ merging, tags


def test_updates_to_one_job_are_merged_into_one_call():
    j = job(1, qos="normal", level="HIGH", restart_count=1, reason="BeginTime", submit_time=NOW - 3,
            eligible_time=NOW + 4)
    actions = decide([j], POLICY, NOW, run_ends={1: "REQUEUED"})
    assert len(actions) == 1
    assert actions[0].field_dict() == {"QOS": "high", "StartTime": f"uts{NOW - 2}"}
    assert actions[0].rule == "restore-level+start-now"
    assert actions[0].describe().startswith(f"job 1: update QOS=high StartTime=uts{NOW - 2} [restore-level+start-now] ")


def test_a_requeue_of_this_very_second_is_not_started_early():
    # slurmctld kills a relaunch in the requeue's own second ("Job credential revoked"): the
    # start is the next second by slurmctld's clock, whatever the daemon's clock says
    j = job(1, restart_count=1, reason="BeginTime", submit_time=NOW, eligible_time=NOW + 6)
    for now in (NOW - 5, NOW, NOW + 0.99, NOW + 5):
        (a,) = decide([j], POLICY, now, run_ends={1: "REQUEUED"})
        assert (a.rule, a.field_dict()) == ("start-now", {"StartTime": f"uts{NOW + 1}"})
    assert decide([replace(j, eligible_time=NOW + 1)], POLICY, NOW) == []  # already so


def test_a_requeued_job_that_slurms_scheduler_overlooked_gets_a_pass():
    # 25.11: the pass the start-now queued came before its second, the next only with backfill
    given = job(1, restart_count=1, reason="BeginTime", submit_time=NOW, eligible_time=NOW + 1)
    assert decide([given], POLICY, NOW + 1.1) == []  # the pass of that second may still come
    (a,) = decide([given], POLICY, NOW + 1.2)
    assert (a.rule, a.field_dict()) == ("start-now", {"StartTime": f"uts{NOW + 1}"})
    assert decide([replace(given, reason="Priority")], POLICY, NOW + 3) == []  # looked at: waits its turn
    assert decide([replace(given, eligible_time=NOW + 7)], POLICY, NOW + 8) == []  # Slurm's own hold ran out


def test_tags_round_trip():
    assert with_tags("hai-level=HIGH other", {"hai-demoted": "NORMAL"}) == "hai-level=HIGH other hai-demoted=NORMAL"
    assert with_tags("hai-level=HIGH hai-demoted=NORMAL", drop=["hai-demoted"]) == "hai-level=HIGH"
    assert parse_tags("hai-level=AUTO;hai-yield=3@5") == {"hai-level": "AUTO", "hai-yield": "3@5"}


def test_a_notice_tag_reads_back_as_the_notice_events_fields_of_its_run_only():
    assert parse_notice(notice_value("demoted", 12, "HIGH", 0, 100), 100) == {
        "cause": "preempted", "demoted": True, "by_job": 12, "by_level": "HIGH", "target_size": 0}
    assert parse_notice(notice_value("earlier_in_line", 12, "NORMAL", 0, 100), 90)["earlier_in_line"] is True
    assert parse_notice(notice_value("preempted", 7, "HIGH", 2, 100), 0) == {
        "cause": "preempted", "by_job": 7, "by_level": "HIGH", "target_size": 2}
    assert parse_notice(notice_value("preempted", None, "", 0, 100), 0) == {"cause": "preempted", "target_size": 0}
    assert parse_notice(notice_value("grow", None, "", 4, 100), 0) == {"cause": "grow", "target_size": 4}
    assert parse_notice(notice_value("grow", None, "", 4, 100), 101) is None  # of an earlier run
    for bad in (None, "", "grow:::4", "grow::4@1", "shrug:::4@1", "grow:::x@1", "preempted:x:HIGH:0@1", "grow:::4@"):
        assert parse_notice(bad, 0) is None, bad
    with pytest.raises(ValueError):
        notice_value("user", None, "", 0, 100)


# ------------------------------------------------------------------ explain


def test_explain_over_quota():
    running = [job(i, "RUNNING", nodes=2) for i in (1, 2)]
    waiting = job(3, reason="QOSMaxNodePerUserLimit")
    assert explain(waiting, [*running, waiting], POLICY, NOW) == "over quota at NORMAL: 4/4 nodes in use"
    bob = job(4, qos="normal.u.hai-bob", user="hai-bob", reason="QOSMaxNodePerUserLimit")
    bob_run = job(5, "RUNNING", qos="normal.u.hai-bob", user="hai-bob", nodes=2)
    assert explain(bob, [bob, bob_run], POLICY, NOW) == "over quota at NORMAL: 2/2 nodes in use"


def test_explain_over_quota_before_slurm_says_so():
    running = job(1, "RUNNING", nodes=4)
    waiting = job(2, reason="None")
    assert explain(waiting, [running, waiting], POLICY, NOW) == "over quota at NORMAL: 4/4 nodes in use"


def test_explain_waiting_for_nodes_with_position():
    jobs = [job(1, "RUNNING", nodes=4, user="root"), job(2, qos="high", nodes=2, reason="Resources"),
            job(3, nodes=1), job(4, nodes=3, reason="Priority"), job(5, qos="low")]
    assert explain(jobs[1], jobs, POLICY, NOW) == "waiting for 2 nodes at HIGH (position 1 in line)"
    assert explain(jobs[3], jobs, POLICY, NOW) == ("waiting for 3 nodes at NORMAL (position 3 in line, "
                                                   "behind job 2 at HIGH and job 3 at NORMAL)")
    assert explain(jobs[4], jobs, POLICY, NOW) == ("waiting for 1 node at LOW (position 4 in line, "
                                                   "behind job 2 at HIGH and job 3 at NORMAL and job 4 at NORMAL)")
    crowd = [*jobs, *(job(10 + i, qos="low") for i in range(3)), job(20, qos="low")]
    assert explain(crowd[-1], crowd, POLICY, NOW) == ("waiting for 1 node at LOW (position 8 in line, "
                                                      "behind 3 jobs at higher levels and 4 earlier at LOW)")


def test_explain_requeue_delay_and_holds():
    j = job(1, reason="BeginTime", restart_count=1, submit_time=NOW - 1, eligible_time=NOW + 4)
    assert explain(j, [j], POLICY, NOW) == "held back after requeue: may start again in ~4 s"
    due = job(1, reason="BeginTime", restart_count=1, submit_time=NOW - 5, eligible_time=NOW - 1)
    assert explain(due, [due], POLICY, NOW) == "held back after requeue: may start again at Slurm's next scheduling pass"
    h = job(2, reason="JobHoldMaxRequeue", priority=0, restart_count=6)
    assert explain(h, [h], POLICY, NOW) == ("held by Slurm's requeue limit after 6 restarts "
                                            "(the policy daemon releases it)")
    u = job(3, reason="JobHeldUser", priority=0)
    assert explain(u, [u], POLICY, NOW) == "held by its owner (scontrol release 3)"
    y = job(4, reason="JobHeldAdmin", priority=0,
            admin_comment="hai-level=ABOVE_NORMAL hai-demoted=NORMAL hai-yield=9@1")
    assert "gave its nodes to job 9 (it had been demoted)" in explain(y, [y], POLICY, NOW)


def test_explain_running_demoted_and_preempted():
    d = job(1, "RUNNING", "above_normal", start_time=NOW - 3600)
    assert explain(d, [d], POLICY, NOW).startswith("running at ABOVE_NORMAL for 60 min: counts as NORMAL")
    p = job(2, "RUNNING", "low", start_time=NOW - 60, preempt_time=NOW - 2)
    assert explain(p, [p], POLICY, NOW) == "running at LOW, asked to suspend 2 s ago (forced off after 5 s)"
    r = job(3, "RUNNING", "high", nodes=2, start_time=NOW - 30)
    assert explain(r, [r], POLICY, NOW) == "running at HIGH on 2 nodes for 30 s"


def test_an_elastic_job_below_its_max_is_told_who_grows_it_back():
    """Issue 54, finding 3: on a cluster where no policy daemon runs a shrunk job never grows
    back, and nothing said so."""
    shrunk = job(4, "RUNNING", "low", nodes=2, start_time=NOW - 30, admin_comment="hai-level=LOW hai-nodes=2:4:1")
    assert explain(shrunk, [shrunk], POLICY, NOW) == (
        "running at LOW on 2 nodes for 30 s; the policy daemon grows it to up to 4 nodes once nodes stay idle "
        f"{POLICY.grow_after_seconds} s (where none runs, it stays on 2)")
    never = replace(POLICY, grow_after_seconds=None)
    assert explain(shrunk, [shrunk], never, NOW).endswith("; it never grows back to 4: this policy grows no job "
                                                          "(grow = false)")
    whole = job(5, "RUNNING", "low", nodes=4, start_time=NOW - 30, admin_comment="hai-level=LOW hai-nodes=2:4:1")
    assert explain(whole, [whole], POLICY, NOW) == "running at LOW on 4 nodes for 30 s"


def test_explain_auto_and_other_reasons():
    a = job(1, qos="high.u.hai-bob", user="hai-bob", level="AUTO", reason="Resources")
    assert explain(a, [a], POLICY, NOW) == "AUTO, now waiting for 1 node at HIGH (position 1 in line)"
    o = job(2, reason="ReqNodeNotAvail")
    assert explain(o, [o], POLICY, NOW) == "pending at NORMAL: ReqNodeNotAvail"
    assert explain(job(3, "COMPLETED"), [], POLICY, NOW) == "completed"


@pytest.mark.parametrize("n", [0, 1, 3])
def test_decide_is_deterministic(n):
    jobs = [job(i, priority=BASE["NORMAL"], submit_time=NOW - i) for i in range(n)]
    assert decide(jobs, POLICY, NOW) == decide(list(jobs), POLICY, NOW)
