"""Elastic jobs in the rules: the grow rule, the shrink target, the idle history, and a
synthetic timeline that shows no grow/shrink loop (issue 11, items 2 and 3)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from slurm_hai.policy.elastic import IdleHistory, shrink_target
from slurm_hai.policy.model import PolicyError, parse_policy
from slurm_hai.policy.rules import decide, needs_idle_nodes
from slurm_hai.policy.sizes import NodeRange
from slurm_hai.policy.tags import parse as parse_tags
from test_scheduling import NOW, POLICY, by_rule, fields, job

GROW_AFTER = POLICY.grow_after_seconds


def elastic(job_id: int, nodes: int, span: str = "2:4:1", qos: str = "low", **kw):
    kw.setdefault("admin_comment", f"hai-level={qos.upper()} hai-nodes={span}")
    return job(job_id, "RUNNING", qos, nodes=nodes, **kw)


def grows(actions, job_id: int) -> int | None:
    """The size the actions ask `job_id` to grow to (tag and notice both there), else None."""
    tag = parse_tags(fields(actions, job_id).get("AdminComment", "")).get("hai-grow")
    signalled = [a for a in by_rule(actions, "grow") if a.kind == "signal" and a.job_id == job_id]
    assert bool(tag) == bool(signalled), actions
    return int(tag.split("@")[0]) if tag else None


# ------------------------------------------------------------------ shrink target and idle history


def test_shrink_target_keeps_the_largest_allowed_size_or_suspends_whole():
    assert shrink_target(NodeRange(2, 4), 4, 2) == 2
    assert shrink_target(NodeRange(2, 4), 4, 1) == 3
    assert shrink_target(NodeRange(2, 4), 4, 3) == 0  # 1 node left: below MIN
    assert shrink_target(NodeRange(2, 8, 2), 8, 3) == 4  # 5 left, steps of 2 from 2
    assert shrink_target(NodeRange(2, 4), 3, 0) == 3


def test_idle_history_counts_only_nodes_idle_for_the_whole_window():
    h = IdleHistory()
    for t, idle in [(0, {"gpu": 2}), (5, {"gpu": 3}), (10, {"gpu": 2, "cpu": 1})]:
        h.record(NOW + t, idle)
    assert h.steady(NOW + 10, 20) == {}  # the samples span 10 s, not 20
    assert h.steady(NOW + 10, 10) == {"gpu": 2}  # cpu was idle only in the last sample
    h.record(NOW + 12, {"gpu": 0})
    assert h.steady(NOW + 12, 5) == {}
    h.record(NOW + 30, {"gpu": 4})  # 18 s without a sample: nobody watched in between
    h.record(NOW + 31, {"gpu": 4})
    assert h.steady(NOW + 31, 5) == {}
    h.forget()
    assert h.steady(NOW + 31, 0) == {}


# ------------------------------------------------------------------ the grow rule


def test_an_elastic_job_below_max_grows_into_nodes_idle_long_enough():
    jobs = [elastic(1, 2, start_time=NOW - GROW_AFTER)]
    assert needs_idle_nodes(jobs, POLICY, NOW)
    actions = decide(jobs, POLICY, NOW, idle_nodes={"gpu": 2}, steady_idle={"gpu": 2})
    assert grows(actions, 1) == 4
    comment = fields(actions, 1)["AdminComment"].split()
    assert f"hai-grow=4@{NOW}" in comment and f"hai-notice=grow:::4@{NOW}" in comment
    # the tags are written before the notice: the launcher reads the cause when the notice comes
    kinds = [a.kind for a in actions if a.job_id == 1]
    assert kinds == ["update", "signal"]


def test_no_grow_without_steady_idle_nodes_or_before_grow_after_at_its_size():
    assert grows(decide([elastic(1, 2, start_time=NOW - GROW_AFTER)], POLICY, NOW, steady_idle={}), 1) is None
    assert grows(decide([elastic(1, 2, start_time=NOW - GROW_AFTER + 1)], POLICY, NOW,
                        steady_idle={"gpu": 2}), 1) is None
    assert grows(decide([elastic(1, 4, start_time=NOW - 999)], POLICY, NOW, steady_idle={"gpu": 2}), 1) is None
    fixed = job(1, "RUNNING", "low", nodes=2, start_time=NOW - 999)
    assert not needs_idle_nodes([fixed], POLICY, NOW)
    assert decide([fixed], POLICY, NOW, steady_idle={"gpu": 2}) == []
    never = replace(POLICY, grow_after_seconds=None)
    assert not needs_idle_nodes([elastic(1, 2)], never, NOW)
    assert grows(decide([elastic(1, 2, start_time=NOW - 999)], never, NOW, steady_idle={"gpu": 2}), 1) is None


@pytest.mark.parametrize("waiting,blocks", [
    (dict(qos="low", reason="Resources"), True),  # its own level waits for nodes
    (dict(qos="high", reason="Priority"), True),
    (dict(qos="high", reason="BeginTime", restart_count=1, submit_time=NOW - 1, eligible_time=NOW + 4), True),
    (dict(qos="low", reason="QOSMaxNodePerUserLimit"), False),  # waits for its quota, not for nodes
    (dict(qos="low", reason="Resources", priority=0), False),  # held
])
def test_never_grows_into_nodes_a_waiting_job_of_its_level_or_above_is_entitled_to(waiting, blocks):
    jobs = [elastic(1, 2, start_time=NOW - 999), job(2, nodes=4, **waiting)]
    assert (grows(decide(jobs, POLICY, NOW, steady_idle={"gpu": 2}), 1) is None) == blocks


def test_a_waiting_job_of_a_lower_level_does_not_stop_a_grow():
    jobs = [elastic(1, 2, qos="normal", start_time=NOW - 999), job(2, qos="low", nodes=4, reason="Resources")]
    assert grows(decide(jobs, POLICY, NOW, steady_idle={"gpu": 2}), 1) == 4


def test_the_grow_respects_step_and_quota_and_takes_the_highest_level_first():
    # 2:8:2 on 2 nodes with 3 idle: 4, not 5
    assert grows(decide([elastic(1, 2, "2:8:2", start_time=NOW - 999)], POLICY, NOW, steady_idle={"gpu": 3}), 1) == 4
    # hai-bob may hold 2 nodes at NORMAL (contrib/localcluster/policy.toml): a 1:4 job on 1 grows to 2
    bob = elastic(1, 1, "1:4:1", qos="normal", user="hai-bob", start_time=NOW - 999)
    assert grows(decide([bob], POLICY, NOW, steady_idle={"gpu": 3}), 1) == 2
    # one grow in flight per partition: the higher level gets it
    jobs = [elastic(1, 2, qos="low", start_time=NOW - 999), elastic(2, 2, qos="normal", start_time=NOW - 999)]
    actions = decide(jobs, POLICY, NOW, steady_idle={"gpu": 2})
    assert (grows(actions, 1), grows(actions, 2)) == (None, 4)


def test_a_grow_in_flight_is_requeued_after_the_grace_and_its_tag_dropped_once_it_runs_again():
    asked = NOW - 3
    running = elastic(1, 2, start_time=NOW - 999, admin_comment=f"hai-level=LOW hai-nodes=2:4:1 hai-grow=4@{asked}")
    assert decide([running], POLICY, NOW, steady_idle={"gpu": 2}) == []  # within its grace: nothing more
    later = decide([running], POLICY, asked + POLICY.grace_seconds, steady_idle={"gpu": 2})
    assert [(a.kind, a.rule) for a in later] == [("requeue", "grow")]
    replayed = decide([running], POLICY, NOW, replay=True)
    assert [(a.kind, a.rule) for a in replayed] == [("signal", "grow")]
    again = replace(running, num_nodes=4, start_time=asked + 8)
    done = decide([again], POLICY, asked + 9)
    assert "hai-grow" not in parse_tags(fields(done, 1)["AdminComment"])
    # while it is requeued (pending) its partition has a grow in flight: no second one
    pending = replace(running, state="PENDING", reason="BeginTime", restart_count=1)
    other = elastic(2, 2, start_time=NOW - 999)
    assert grows(decide([pending, other], POLICY, NOW, steady_idle={"gpu": 2}), 2) is None


def test_policy_file_elastic_table():
    base = {"levels": {"NORMAL": 10, "LOW": 0}}
    assert parse_policy(base).grow_after_seconds == 60
    assert parse_policy({**base, "elastic": {"grow_after": "90s"}}).grow_after_seconds == 90
    assert parse_policy({**base, "elastic": {"grow": False}}).grow_after_seconds is None
    with pytest.raises(PolicyError, match=r"\[elastic\] grow_after: must be at least 1 second"):
        parse_policy({**base, "elastic": {"grow_after": 0}})
    with pytest.raises(PolicyError, match="unknown key"):
        parse_policy({**base, "elastic": {"shrink": True}})


# ------------------------------------------------------------------ no loop over a synthetic timeline


class Cluster:
    """4 nodes, one elastic LOW job (2:4) and HIGH jobs of 2 nodes that come and go; the rules
    act once a second (with IdleHistory as the daemon keeps it). A job asked to resize, or
    preempted, runs again `restart` seconds later on the nodes free then (as Slurm would)."""

    def __init__(self, restart: int = 3) -> None:
        self.t = NOW
        self.size = 4
        self.restart_at: int | None = None
        self.started = NOW - 999
        self.high = 0  # nodes the HIGH jobs hold
        self.restart = restart
        self.sizes = [4]
        self.history = IdleHistory()

    def low(self):
        return elastic(1, self.size, start_time=self.started)

    def step(self, high: int) -> None:
        if high > self.high and self.restart_at is None and self.size + high > 4:
            self.restart_at, self.size = self.t + self.restart, 0  # Slurm preempts the LOW job whole
        self.high = high
        if self.restart_at is not None and self.t >= self.restart_at:
            self.size, self.started, self.restart_at = 4 - self.high, self.t, None
            self.sizes.append(self.size)
        if self.restart_at is None:
            idle = {"gpu": 4 - self.high - self.size}
            self.history.record(self.t, idle)
            actions = decide([self.low()], POLICY, self.t, idle_nodes=idle,
                             steady_idle=self.history.steady(self.t, GROW_AFTER))
            if grows(actions, 1):
                self.restart_at, self.size = self.t + self.restart, 0
        self.t += 1


def test_a_high_job_that_comes_and_goes_faster_than_grow_after_never_makes_the_job_grow():
    c = Cluster()
    period = GROW_AFTER // 2
    for s in range(20 * GROW_AFTER):
        c.step(2 if (s // period) % 2 == 0 else 0)  # HIGH holds 2 nodes half of the time
    assert c.sizes == [4, 2]  # shrank once for the first HIGH job, never grew: nodes never idle long enough


def test_each_long_absence_of_the_high_job_is_one_grow_and_each_arrival_one_shrink():
    c = Cluster()
    period = 3 * GROW_AFTER
    for s in range(8 * period):
        c.step(2 if (s // period) % 2 == 0 else 0)
    assert c.sizes == [4, 2, 4, 2, 4, 2, 4, 2, 4]  # 4 arrivals, 4 absences: no extra resize


def test_a_grow_that_came_back_short_is_not_asked_again_before_the_retry_time():
    from slurm_hai.policy.rules import GROW_RETRY_AFTER

    asked = NOW - 20
    short = elastic(1, 3, start_time=asked + 3, admin_comment=f"hai-level=LOW hai-nodes=2:4:1 hai-grow=4@{asked}")
    # 1 node idle long enough, but the grow to 4 came back on 3 (22.05): no restart per grow_after
    assert decide([short], POLICY, NOW, steady_idle={"gpu": 1}) == []
    later = asked + GROW_RETRY_AFTER * GROW_AFTER
    dropped = decide([short], POLICY, later, steady_idle={"gpu": 1})
    assert "hai-grow" not in parse_tags(fields(dropped, 1)["AdminComment"])  # the retry time is over
    untagged = replace(short, admin_comment="hai-level=LOW hai-nodes=2:4:1")
    assert grows(decide([untagged], POLICY, later, steady_idle={"gpu": 1}), 1) == 4
