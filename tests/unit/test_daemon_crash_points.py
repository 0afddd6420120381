"""The policy daemon killed after any action of a preemption it decided, then started
again (issue 18): the job hears the notice, is requeued exactly once, and is never left
held. A small model of Slurm applies the daemon's actions; the daemon is "killed" after
its k-th action for every k of an uninterrupted run (nothing after that action happens),
and a new daemon takes over the same queue."""

from __future__ import annotations

from dataclasses import replace

import pytest

from slurm_hai.controller.daemon import PolicyDaemon
from slurm_hai.policy.rules import NOTICE_KEPT_INTO_RUN, is_held
from slurm_hai.policy.tags import parse as parse_tags

from test_scheduling import NOW, demoted_scene


class Killed(BaseException):
    """SIGKILL: nothing after it runs (BaseException: no handler of the daemon catches it)."""


class SlurmModel:
    """Just enough of slurmctld for one yield: requeue, hold (priority 0), release, tags,
    signals; the waiting job 3 starts once job 2's nodes are free."""

    def __init__(self, jobs, kill_after: int | None) -> None:
        self.q = {j.job_id: j for j in jobs}
        self.kill_after = kill_after
        self.done = 0
        self.log: list[tuple] = []

    def _act(self, *what) -> None:
        if self.kill_after is not None and self.done >= self.kill_after:
            raise Killed
        self.log.append(what)
        self.done += 1

    def jobs(self, job_ids=(), user=None):
        return list(self.q.values())

    def idle_nodes(self):
        return {"gpu": 0}

    def last_run_ends(self, job_ids):  # the daemon's requeues: every run ended on all its nodes
        return dict.fromkeys(job_ids, "REQUEUED")

    def update_job(self, job_id, **fields):
        self._act("update", job_id, tuple(sorted(fields)))
        j = self.q[job_id]
        self.q[job_id] = replace(j, admin_comment=fields.get("AdminComment", j.admin_comment),
                                 priority=int(fields.get("Priority", j.priority)),
                                 reason="JobHeldAdmin" if fields.get("Priority") == "0" else j.reason)

    def requeue(self, job_id):
        self._act("requeue", job_id)
        j = self.q[job_id]
        assert j.state == "RUNNING", "requeue of a job that is not running"
        self.q[job_id] = replace(j, state="PENDING", reason="BeginTime", restart_count=j.restart_count + 1,
                                 start_time=0)

    def release(self, job_id):
        self._act("release", job_id)
        j = self.q[job_id]
        self.q[job_id] = replace(j, priority=1, reason="Priority")

    def cancel(self, job_id, signal=None):
        self._act("signal", job_id, signal)

    def schedule(self, now: float) -> None:
        """Job 3 gets job 2's nodes once job 2 left them."""
        if self.q[2].state == "PENDING" and self.q[3].state == "PENDING":
            self.q[3] = replace(self.q[3], state="RUNNING", reason="None", start_time=int(now))


def play(kill_after: int | None) -> SlurmModel:
    policy, jobs = demoted_scene()
    return drive(SlurmModel(jobs, kill_after), policy)


def drive(slurm: SlurmModel, policy, cycles: int = 40) -> SlurmModel:
    """Daemon cycles a second apart over the model; a kill starts a new daemon."""
    now = [float(NOW)]
    daemon = PolicyDaemon(slurm, policy=policy, clock=lambda: now[0])
    for _ in range(cycles):
        try:
            daemon.cycle()
        except Killed:
            slurm.kill_after = None  # one kill; a new daemon takes over the same queue
            daemon = PolicyDaemon(slurm, policy=policy, clock=lambda: now[0])
        now[0] += 1
        slurm.schedule(now[0])
    return slurm


UNINTERRUPTED = [("update", 2, ("AdminComment",)), ("signal", 2, "USR2"), ("requeue", 2),
                 ("update", 2, ("Priority",)), ("release", 2), ("update", 2, ("AdminComment",)),
                 ("update", 2, ("Priority",))]  # tag, notice, requeue, hold, release, untag, its place in line


def test_the_uninterrupted_preemption():
    assert play(None).log == UNINTERRUPTED


@pytest.mark.parametrize("k", range(len(UNINTERRUPTED)))
def test_killed_after_any_action_the_preemption_completes_exactly_once(k):
    slurm = play(k)
    j2, j3 = slurm.q[2], slurm.q[3]
    log = [(a[0], a[1]) for a in slurm.log]
    assert log.count(("requeue", 2)) == 1  # suspended exactly once
    assert ("signal", 2) in log and log.index(("signal", 2)) < log.index(("requeue", 2))  # heard the notice first
    assert j3.state == "RUNNING"
    assert j2.state == "PENDING" and not is_held(j2), j2  # never left held
    assert "hai-yield" not in parse_tags(j2.admin_comment)
    assert not any(a[1] != 2 for a in slurm.log)  # nothing else touched


# ------------------------------------------------------------------ a grow (issue 11)


class GrowModel(SlurmModel):
    """An elastic job 1 (2:4) on 2 of 4 nodes, the other 2 idle: the daemon grows it. The job
    ignores its notice (the daemon requeues it after the grace); Slurm holds the requeued job
    back (BeginTime) until the daemon's start-now, then starts it on the 4 free nodes."""

    def __init__(self, kill_after: int | None) -> None:
        super().__init__([replace(elastic_job(), submit_time=NOW - 999)], kill_after)
        self.now = float(NOW)

    def idle_nodes(self):
        return {"gpu": 4 - sum(j.num_nodes for j in self.q.values() if j.state == "RUNNING")}

    def update_job(self, job_id, **fields):
        self._act("update", job_id, tuple(sorted(fields)))
        j = replace(self.q[job_id], admin_comment=fields.get("AdminComment", self.q[job_id].admin_comment))
        if "StartTime" in fields:  # uts<second>: slurmctld takes no moment before its own now
            j = replace(j, eligible_time=max(int(fields["StartTime"].removeprefix("uts")), int(self.now)))
        self.q[job_id] = j

    def requeue(self, job_id):
        super().requeue(job_id)
        self.q[job_id] = replace(self.q[job_id], submit_time=int(self.now), eligible_time=int(self.now) + 5)

    def schedule(self, now: float) -> None:
        self.now = now
        j = self.q[1]
        if j.state == "PENDING" and (j.reason != "BeginTime" or j.eligible_time <= now):
            self.q[1] = replace(j, state="RUNNING", reason="None", num_nodes=4, start_time=int(now))


def elastic_job():
    from test_elastic_rules import elastic

    return elastic(1, 2, start_time=NOW - 999)


def play_grow(kill_after: int | None) -> GrowModel:
    from test_scheduling import POLICY

    # long enough for the notice's cause to be dropped NOTICE_KEPT_INTO_RUN into the next run
    return drive(GrowModel(kill_after), replace(POLICY, grow_after_seconds=3), cycles=40 + NOTICE_KEPT_INTO_RUN)


# tags, notice, requeue, start-now, untag hai-grow, untag hai-notice (once the next run's batch
# script has read it: runtime/batch.py untold_cause)
GROW_UNINTERRUPTED = [("update", 1, ("AdminComment",)), ("signal", 1, "USR2"), ("requeue", 1),
                      ("update", 1, ("StartTime",)), ("update", 1, ("AdminComment",)), ("update", 1, ("AdminComment",))]


def test_the_uninterrupted_grow():
    slurm = play_grow(None)
    assert slurm.log == GROW_UNINTERRUPTED
    assert not {"hai-grow", "hai-notice"} & set(parse_tags(slurm.q[1].admin_comment))


@pytest.mark.parametrize("k", range(len(GROW_UNINTERRUPTED)))
def test_killed_after_any_action_of_a_grow_it_completes_exactly_once(k):
    slurm = play_grow(k)
    j = slurm.q[1]
    log = [(a[0], a[1]) for a in slurm.log]
    assert log.count(("requeue", 1)) == 1  # resized exactly once
    assert log.index(("signal", 1)) < log.index(("requeue", 1))  # heard the notice first
    assert (j.state, j.num_nodes) == ("RUNNING", 4)
    assert not {"hai-grow", "hai-notice"} & set(parse_tags(j.admin_comment))
