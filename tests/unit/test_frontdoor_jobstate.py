"""Why a job was suspended, what `hai logs -f` marks, and what `hai status` says (pure)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from slurm_hai.jobs.status import (as_one_job, history, kept_cause, level_name, marker, notice_cause, reason_in_words,
                                   status, why_notice)
from slurm_hai.jobs.jobdir import run_notices, run_sizes
from slurm_hai.policy.levels import DEFAULT_LADDER as HAI, Level
from slurm_hai.policy.preemption import preempted_notice, preemptor, shrinks_to
from slurm_hai.slurm.records import JobInfo

# Noon of the day the module is read: times within 12 h of it print as HH:MM:SS. The clock
# is frozen at NOW for every test (status() reads it itself): runs near midnight once saw a
# date where the test expected none.
NOW = float(time.mktime((*time.localtime()[:3], 12, 0, 0, 0, 0, -1)))


@pytest.fixture(autouse=True)
def frozen_clock(monkeypatch):
    monkeypatch.setattr(time, "time", lambda: NOW)


def job(job_id: int, state: str, qos: str, *, partition: str = "gpu", preempt_time: int = 0, start_time: int = 0,
        end_time: int = 0, admin_comment: str = "", reason: str = "None", exit_code: int | None = None,
        nodes: int = 1) -> JobInfo:
    return JobInfo(job_id=job_id, name="j", user="u", state=state, reason=reason, qos=qos, partition=partition,
                   num_nodes=nodes, node_list="n1", restart_count=0, submit_time=0, start_time=start_time,
                   eligible_time=0, priority=1, preempt_time=preempt_time, end_time=end_time,
                   admin_comment=admin_comment, exit_code=exit_code)


def test_preemption_names_the_highest_oldest_pending_job_of_a_higher_level():
    me = job(5, "RUNNING", "low", start_time=int(NOW) - 100, preempt_time=int(NOW) - 1)
    queue = [me, job(9, "PENDING", "normal"), job(8, "PENDING", "high"), job(7, "PENDING", "high.u.bob"),
             job(3, "PENDING", "low"), job(6, "PENDING", "extreme_high", partition="other")]
    other, level = preemptor(me, queue, HAI)
    assert (other.job_id, level.name) == (7, "HIGH")
    assert preempted_notice(me, queue, HAI) == f"preempted:7:HIGH:0@{int(NOW) - 1}"


def test_the_preemptor_is_told_by_the_sites_ladder_not_hais():
    site = (Level(30, "GOLD"), Level(10, "SILVER"), Level(0, "BRONZE"))
    me = job(5, "RUNNING", "bronze", start_time=int(NOW) - 100, preempt_time=int(NOW) - 1)
    queue = [me, job(9, "PENDING", "high"), job(8, "PENDING", "silver.a.research"), job(7, "PENDING", "bronze")]
    assert preempted_notice(me, queue, site) == f"preempted:8:SILVER:0@{int(NOW) - 1}"
    # under HAI's ladder `bronze` is no level: no job is named, the cause still is
    assert preemptor(me, queue, HAI) is None
    assert preempted_notice(me, queue, HAI) == f"preempted:::0@{int(NOW) - 1}"


def test_an_elastic_job_preempted_learns_the_size_it_runs_on_beside_the_higher_job():
    def me(span: str) -> JobInfo:
        return job(5, "RUNNING", "low", start_time=int(NOW) - 100, preempt_time=int(NOW) - 1, nodes=4,
                   admin_comment=f"hai-level=LOW hai-nodes={span}")

    high = job(7, "PENDING", "high", nodes=2)
    assert shrinks_to(me("2:4:1"), high) == 2
    assert shrinks_to(me("3:4:1"), high) == 0  # below MIN: whole
    assert shrinks_to(me("2:4:1"), None) == 0  # no job named: whole
    told = replace(me("2:4:1"), admin_comment=f"hai-nodes=2:4:1 hai-notice={preempted_notice(me('2:4:1'), [high], HAI)}")
    cause = notice_cause(told, [], 0, NOW, 35)
    assert cause == {"cause": "preempted", "by_job": 7, "by_level": "HIGH", "target_size": 2}
    assert "preempted by job 7 (HIGH); runs on 2 node(s) beside it" == why_notice(cause)


def test_the_cause_is_the_daemons_tag_in_the_jobs_own_record_of_this_run_only():
    me = job(5, "RUNNING", "low", start_time=int(NOW) - 100, nodes=2,
             admin_comment=f"hai-level=LOW hai-nodes=2:4:1 hai-notice=grow:::4@{int(NOW) - 1}")
    cause = notice_cause(me, [], 0, NOW, 35)
    assert cause == {"cause": "grow", "target_size": 4}
    assert why_notice(cause) == "to grow to 4 nodes, idle long enough"
    # a tag older than the run (it ran again since) explains nothing
    old = replace(me, admin_comment=f"hai-level=LOW hai-notice=grow:::4@{int(NOW) - 200}")
    assert notice_cause(old, [], 0, NOW, 35) == {"cause": "unknown", "target_size": 0}
    # the job's own comment is its owner's to write: never the cause
    mine = replace(me, admin_comment="hai-level=LOW", comment=f"hai-notice=grow:::4@{int(NOW) - 1}")
    assert notice_cause(mine, [], 0, NOW, 35) == {"cause": "unknown", "target_size": 0}


def test_a_preemption_by_slurm_not_yet_told_by_the_daemon_names_no_job_and_no_size():
    me = job(5, "RUNNING", "low", start_time=int(NOW) - 100, preempt_time=int(NOW) - 1)
    assert notice_cause(me, [], 0, NOW, 35) == {"cause": "preempted"}  # the size comes with the daemon's word
    assert why_notice({"cause": "preempted"}) == "preempted by a job of a higher level"


def test_a_preemption_from_an_earlier_run_does_not_explain_this_notice():
    me = job(5, "RUNNING", "low", start_time=int(NOW) - 100, preempt_time=int(NOW) - 500)
    asked = [{"t": NOW - 1, "event": "suspend_requested", "run": 0, "by": 1001}]
    assert notice_cause(me, asked, 0, NOW, 35) == {"cause": "user", "by_uid": 1001, "target_size": 0}
    assert notice_cause(me, [], 0, NOW, 35) == {"cause": "unknown", "target_size": 0}


def test_a_hai_suspend_explains_the_notice_of_its_own_run_only_however_long_ago():
    me = job(5, "RUNNING", "low", start_time=int(NOW) - 100)
    before_the_start = [{"t": NOW - 90, "event": "suspend_requested", "run": 2, "by": 1001},
                        {"t": NOW - 80, "event": "start", "run": 2}]
    assert notice_cause(me, before_the_start, 2, NOW, 35) == {"cause": "user", "by_uid": 1001, "target_size": 0}
    assert notice_cause(me, before_the_start, 3, NOW, 35)["cause"] == "unknown"  # an earlier run's request
    failed = before_the_start + [{"t": NOW - 79, "event": "suspend_request_failed", "run": 2}]
    assert notice_cause(me, failed, 2, NOW, 35)["cause"] == "unknown"  # its signal reached no step


def test_a_notice_near_the_time_limit_is_the_time_limit_even_a_minute_early():
    me = job(5, "RUNNING", "low", start_time=int(NOW) - 6, end_time=int(NOW) + 54)  # --time 1 after 6 s
    assert notice_cause(me, [], 0, NOW, 35) == {"cause": "time_limit", "limit_at": int(NOW) + 54, "target_size": 0}
    far = job(5, "RUNNING", "low", start_time=int(NOW) - 6, end_time=int(NOW) + 3600)
    assert notice_cause(far, [], 0, NOW, 35)["cause"] == "unknown"


def test_a_demoted_job_asked_to_yield_names_the_job_it_yields_to():
    me = job(5, "RUNNING", "high", start_time=int(NOW) - 100,
             admin_comment=f"hai-yield=12@{int(NOW) - 10} hai-notice=demoted:12:HIGH:0@{int(NOW) - 10}")
    assert notice_cause(me, [], 0, NOW, 35) == {"cause": "preempted", "by_job": 12, "by_level": "HIGH", "demoted": True,
                                             "target_size": 0}


def test_the_daemons_later_word_completes_its_runs_notice_everywhere_it_is_told():
    evs = [{"t": NOW - 50, "event": "start", "run": 0},
           {"t": NOW - 30, "event": "notice", "run": 0, "cause": "preempted", "grace": 5},
           {"t": NOW - 29, "event": "notice_cause", "run": 0, "cause": "preempted", "by_job": 133, "by_level": "HIGH",
            "target_size": 0},
           {"t": NOW - 24, "event": "suspended", "run": 0, "how": "go_suspend"}]
    assert run_notices(evs)[0] == {"t": NOW - 30, "event": "notice", "run": 0, "cause": "preempted", "grace": 5,
                                   "by_job": 133, "by_level": "HIGH", "target_size": 0}
    assert "preempted by job 133 (HIGH)" in history(evs).last_suspend
    assert "preempted by job 133 (HIGH)" in history(evs[:3]).notice_pending
    assert "suspend notice: preempted by job 133 (HIGH); told by the policy daemon" in marker(evs[2])
    assert run_notices(evs[1:2])[0].get("by_job") is None  # no word: the notice as it was


def test_the_daemons_word_kept_in_the_record_tells_a_run_that_left_before_it_came():
    evs = [{"t": NOW - 50.4, "event": "start", "run": 0},
           {"t": NOW - 30, "event": "notice", "run": 0, "cause": "preempted", "grace": 5},  # Slurm's, no daemon yet
           {"t": NOW - 29.8, "event": "suspended", "run": 0, "how": "go_suspend"}]
    tag = f"hai-notice=preempted:133:HIGH:0@{int(NOW) - 30}"
    waiting = job(5, "PENDING", "low", reason="Priority", admin_comment=tag)
    told = kept_cause(waiting, evs, 0)
    assert told == {"cause": "preempted", "by_job": 133, "by_level": "HIGH", "target_size": 0}
    with_told = [*evs, {"event": "notice_cause", "run": 0, **told}]  # as `hai status` reads it (cli/user.py)
    assert "preempted by job 133 (HIGH)" in status(5, waiting, None, {}, 1, events=with_told).reason
    # no daemon, no tag: the cause in words all the same, without a job to name
    assert kept_cause(job(5, "PENDING", "low"), evs, 0) is None
    assert "suspended at " in status(5, job(5, "PENDING", "low"), None, {}, 1, events=evs).reason
    assert ": preempted by a job of a higher level" in status(5, job(5, "PENDING", "low"), None, {}, 1,
                                                               events=evs).reason
    # a tag older than the run (START_SLACK before its batch script's start), or of the run since
    assert kept_cause(job(5, "PENDING", "low", admin_comment=f"hai-notice=grow:::4@{int(NOW) - 60}"), evs, 0) is None
    running = replace(job(5, "RUNNING", "low", start_time=int(NOW) - 5,
                                      admin_comment=f"hai-notice=preempted:134:HIGH:0@{int(NOW) - 2}"), restart_count=1)
    assert kept_cause(running, evs, 0) is None
    assert kept_cause(replace(running, admin_comment=tag), evs, 0) == told  # still kept into run 1


def events_of_a_preempted_then_forced_job() -> list[dict]:
    return [
        {"t": NOW - 60, "event": "submit", "level": "LOW", "nodes": 1},
        {"t": NOW - 50, "event": "start", "run": 0, "nodes": "n1"},
        {"t": NOW - 30, "event": "notice", "run": 0, "source": "signal", "grace": 5, "cause": "preempted",
         "by_job": 133, "by_level": "HIGH"},
        {"t": NOW - 25, "event": "forced_suspend", "run": 0, "after": 5.0},
        {"t": NOW - 24, "event": "suspended", "run": 0, "how": "forced"},
    ]


def test_status_says_when_and_why_a_job_was_suspended_and_counts_forced_suspends():
    at = time.strftime("%H:%M:%S", time.localtime(NOW - 24))
    h = history(events_of_a_preempted_then_forced_job(), now=NOW)
    assert h.suspends == 1 and h.forced == 1 and h.retries == 0
    assert h.last_suspend.startswith(f"suspended at {at}: preempted by job 133 (HIGH); forced off after 5.0 s")
    pending = job(5, "PENDING", "low", reason="Priority")
    st = status(5, pending, None, {}, 1, "waiting for 1 node at LOW (position 1 in line)", 0,
                events=events_of_a_preempted_then_forced_job())
    assert st.state == "suspended" and st.forced_suspends == 1 and st.submitted == int(NOW - 60)
    assert st.reason.startswith(f"suspended at {at}: preempted by job 133 (HIGH)")
    assert st.reason.endswith("waiting for 1 node at LOW (position 1 in line)")


def test_by_you_and_by_an_administrator():
    evs = [{"t": NOW, "event": "start", "run": 0}, {"t": NOW + 1, "event": "notice", "run": 0, "cause": "user",
                                                     "by_uid": 1001},
           {"t": NOW + 2, "event": "suspended", "run": 0, "how": "go_suspend"}]
    assert history(evs, owner_uid=1001, now=NOW).last_suspend.endswith(": by you (hai suspend)")
    assert history(evs, owner_uid=1002, now=NOW).last_suspend.endswith(": by an administrator (hai suspend)")


def test_retries_are_counted_apart_from_restarts():
    evs = [{"t": NOW, "event": "start", "run": 0}, {"t": NOW + 1, "event": "retry", "run": 0, "exit_code": 3,
                                                     "retry": 1, "of": 2},
           {"t": NOW + 2, "event": "start", "run": 1}]
    h = history(evs, now=NOW)
    assert h.retries == 1 and h.suspends == 0 and h.last_suspend == ""


def test_log_markers_for_notice_forced_suspend_retry_and_restart():
    lines = [marker(e, now=NOW) for e in events_of_a_preempted_then_forced_job()]
    assert lines[0] is None  # submit: nothing to mark
    assert "run 0: suspend notice: preempted by job 133 (HIGH); grace 5 s" in lines[2]
    assert "suspended by force" in lines[3] and "waits to run again" in lines[4]
    assert "(restart 1)" in marker({"t": NOW, "event": "start", "run": 1, "nodes": "n2"}, now=NOW)
    assert "retry 1 of 2" in marker({"t": NOW, "event": "retry", "run": 0, "exit_code": 3, "retry": 1, "of": 2})
    assert "run 1: shrank from 4 to 2 nodes" in marker({"t": NOW, "event": "shrink", "run": 1, "from": 4, "to": 2})
    assert "run 2: grew from 2 to 4 nodes" in marker({"t": NOW, "event": "grow", "run": 2, "from": 2, "to": 4})
    assert "run 0: go_suspend() called; the step ends, the batch script requeues the job" in \
        marker({"t": NOW, "event": "go_suspend", "run": 0})
    assert marker({"t": NOW, "event": "left_for_requeue", "run": 0, "rank": 0}) is None  # each node's: not worth a line
    assert all(line.startswith("---- slurm-hai ") for line in lines[1:])


def test_a_running_job_with_a_notice_says_so():
    evs = [{"t": NOW, "event": "start", "run": 0},
           {"t": NOW + 1, "event": "notice", "run": 0, "cause": "time_limit", "grace": 5}]
    st = status(5, job(5, "RUNNING", "low"), None, {}, 0, "running at LOW on 1 node for 3 s", 0, events=evs)
    assert st.reason.startswith("suspend notice at ") and "time limit" in st.reason


def test_another_users_ended_job_is_told_in_words_from_slurm_alone():
    assert reason_in_words(job(5, "FAILED", "low", exit_code=3), None) == "exit code 3"
    assert reason_in_words(job(5, "FAILED", "low", exit_code=1, reason="NonZeroExitCode"), None) == "exit code 1"
    assert reason_in_words(job(5, "FAILED", "low", reason="JobLaunchFailure"), None).startswith("Slurm could not start it")
    assert reason_in_words(job(5, "COMPLETED", "low", exit_code=0), None) == "exited 0"
    assert reason_in_words(job(5, "PENDING", "low", reason="PartitionNodeLimit"), None).startswith("asks for more")


def test_an_estimate_of_when_a_preempted_job_runs_again_or_why_there_is_none():
    from slurm_hai.jobs.status import back_estimate

    evs = events_of_a_preempted_then_forced_job()
    limited = job(133, "RUNNING", "high", start_time=int(NOW) - 10, end_time=int(NOW) + 3590)
    at = time.strftime("%H:%M:%S", time.localtime(NOW + 3590))
    def among(*jobs):
        return {j.job_id: j for j in jobs}.get

    assert back_estimate(evs, among(limited), NOW) == f"runs again when job 133 ends, by {at} at the latest (its time limit)"
    unlimited = job(133, "RUNNING", "high", start_time=int(NOW) - 10, end_time=int(NOW) + 10 * 365 * 86400)
    assert back_estimate(evs, among(unlimited), NOW) == "runs again when job 133 ends, which has no time limit: no time can be told"
    assert back_estimate(evs, among(), NOW) == ""  # that job is gone: the line in the queue says the rest
    assert "is starting on its nodes" in back_estimate(evs, among(job(133, "PENDING", "high")), NOW)


def test_slurm_codes_in_the_policys_account_become_words():
    pending = job(5, "PENDING", "low", reason="PartitionNodeLimit")
    st = status(5, pending, None, {}, 0, "pending at LOW: PartitionNodeLimit", 0)
    assert st.reason == "pending at LOW: asks for more nodes than its node group has (or allows per job)"


def test_a_job_requeued_before_its_suspended_event_is_told_from_its_notice():
    evs = events_of_a_preempted_then_forced_job()[:3]  # notice written, run not yet marked suspended
    at = time.strftime("%H:%M:%S", time.localtime(NOW - 30))
    st = status(5, job(5, "COMPLETING", "low"), None, {}, 0, None, 0, events=evs)
    assert st.state == "suspended" and st.reason == f"suspended at {at}: preempted by job 133 (HIGH)"


def test_a_quota_override_qos_shows_as_its_level():
    assert level_name(job(1, "RUNNING", "normal.u.hai-bob")) == "NORMAL"
    assert level_name(job(2, "RUNNING", "above_normal.a.lab")) == "ABOVE_NORMAL"
    assert level_name(job(3, "RUNNING", "gold.u.bob")) == "GOLD"  # a site's own ladder
    assert level_name(job(4, "RUNNING", "high")) == "HIGH"


def test_an_elastic_job_shows_its_range_from_the_admin_comment_only_and_the_size_of_each_run():
    events = [{"event": "submit", "t": NOW - 60}, {"event": "start", "run": 0, "size": 4, "t": NOW - 50},
              {"event": "start", "run": 1, "size": 2, "t": NOW - 10}]
    me = replace(job(5, "RUNNING", "low", start_time=int(NOW) - 10,
                     admin_comment="hai-level=LOW hai-grace=5 hai-nodes=2:4:1"), num_nodes=2)
    st = status(5, me, None, {}, 1, events=events)
    assert (st.node_range, st.sizes, st.nodes_text) == ("2:4", [4, 2], "2/2:4")
    # the job's own comment is the user's to write: it never makes a job elastic
    fixed = replace(job(6, "RUNNING", "low", start_time=int(NOW) - 10, admin_comment="hai-level=LOW"),
                    comment="hai-nodes=1:9:1")
    assert status(6, fixed, None, {}, 0).nodes_text == "1"
    # an ended job: what hai-submit recorded
    assert status(7, None, {"state": "succeeded", "exit_code": 0}, {"nodes": 2, "node_range": "2:8:2"}, 0
                  ).nodes_text == "2/2:8:2"


def test_the_parts_of_a_job_in_place_are_one_job_running_on_its_running_parts():
    parts = dict(comment="hai-dir=/tmp/x;hai-parts=2:4", array_job_id=100)
    tasks = [replace(job(101, "RUNNING", "low", start_time=NOW - 50), node_list="n1", **parts),
             replace(job(103, "RUNNING", "low", start_time=NOW - 20), node_list="n3", restart_count=1, **parts),
             replace(job(102, "FAILED", "low"), **parts),  # a part's own failure: the others go on
             replace(job(100, "PENDING", "low", reason="Resources"), restart_count=1, **parts)]  # the rest
    other = job(99, "RUNNING", "high")
    (one, ) = [j for j in as_one_job([other, *tasks]) if j.job_id == 100]
    assert (one.state, one.num_nodes, one.node_list, one.restart_count) == ("RUNNING", 2, "n1,n3", 2)
    assert one.start_time == NOW - 50 and one.reason == "None"
    assert as_one_job([other, *tasks])[0] is other  # every other record as it is
    (waiting,) = as_one_job([tasks[2], tasks[3]])  # no part runs: it waits for its MIN, on no node
    assert (waiting.job_id, waiting.state, waiting.reason, waiting.num_nodes, waiting.node_list) == (
        100, "PENDING", "Resources", 2, "")
    (ended,) = as_one_job([tasks[2], replace(tasks[3], state="COMPLETED")])
    assert (ended.state, ended.num_nodes) == ("COMPLETED", 2)  # 2/2:4 in a list, not 0/2:4


def test_a_job_in_place_shows_its_size_over_time_from_its_parts_starts_and_leaves():
    def ev(kind: str, part: int, t: float, **more) -> dict:
        return {"event": kind, "part": part, "run": more.pop("run", 0), "t": NOW + t, **more}

    events = [{"event": "submit", "t": NOW - 1},
              *(ev("start", p, 0.1 * p) for p in range(4)),  # the four start together: one change
              ev("left", 2, 30, preempted=True), ev("left", 0, 30.2, preempted=True),  # a 2-node HIGH job
              ev("start", 2, 52, run=1), ev("start", 0, 60, run=1),  # back one by one
              ev("left", 1, 80, exit_code=1), ev("finished", 3, 99), ev("left", 0, 99.5)]  # the end
    assert run_sizes(events) == [4, 2, 3, 4, 3]
    me = replace(job(100, "RUNNING", "low", start_time=int(NOW)), num_nodes=3,
                 admin_comment="hai-level=LOW hai-grace=5", comment="hai-dir=/tmp/x;hai-parts=2:4")
    assert status(100, me, None, {"node_range": "2:4", "parts": 4}, 0, events=events).sizes == [4, 2, 3, 4, 3]
