"""The policy daemon's answers to why jobs wait (controller/why.py): a real server on the
loopback, asked as `hai` asks it, and `hai status`/`hai list` taking its words."""

from __future__ import annotations

import dataclasses
import json
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

import slurm_hai.policy.model
from slurm_hai.cli import common, user
from slurm_hai.controller.why import MAX_JOBS, WhyService, ask
from slurm_hai.policy.explain import Explainer
from slurm_hai.policy.model import load_policy
from slurm_hai.slurm.records import JobInfo
from test_frontdoor_list import CountingSlurm

REPO = Path(__file__).resolve().parents[2]
POLICY = load_policy(REPO / "contrib" / "localcluster" / "policy.toml")


def job(job_id: int, state: str = "PENDING", qos: str = "normal", user: str = "hai-alice", nodes: int = 1,
        reason: str = "Priority", restarts: int = 0) -> JobInfo:
    return JobInfo(job_id=job_id, name=f"j{job_id}", user=user, state=state, reason=reason if state == "PENDING"
                   else "None", qos=qos, partition="debug", num_nodes=nodes, node_list="n1" if state == "RUNNING"
                   else "", restart_count=restarts, submit_time=1_000 + job_id, start_time=2_000 if state == "RUNNING"
                   else 0, eligible_time=0, priority=100 - job_id)


QUEUE = [job(1, "RUNNING", nodes=4, user="root"), job(2, qos="high", nodes=2, reason="Resources"), job(3),
         job(4, nodes=3), job(5, qos="low")]


@pytest.fixture
def service():
    s = WhyService(0, "127.0.0.1")
    yield s
    s.close()


def url(s: WhyService) -> str:
    return f"http://127.0.0.1:{s.port}"


def test_a_waiting_job_gets_the_words_the_whole_queue_gives(service):
    assert ask(url(service), QUEUE[1:3]) == {}  # nothing read yet: no answer, the command reads the queue
    service.seen(QUEUE, POLICY, time.time())
    words = Explainer(QUEUE, POLICY)
    assert ask(url(service), QUEUE) == {j.job_id: words(j) for j in QUEUE[1:]}  # the running job is not asked
    assert ask(url(service), [QUEUE[4]])[5] == ("waiting for 1 node at LOW (position 4 in line, behind job 2 at HIGH "
                                                "and job 3 at NORMAL and job 4 at NORMAL)")


def test_words_that_no_longer_hold_are_not_taken(service):
    service.seen(QUEUE, POLICY, time.time())
    started = dataclasses.replace(QUEUE[2], state="RUNNING", reason="None")
    requeued = dataclasses.replace(QUEUE[3], restart_count=1)
    other_reason = dataclasses.replace(QUEUE[4], reason="QOSMaxNodePerUserLimit")
    new = job(9)  # submitted after the daemon's read
    assert ask(url(service), [started, requeued, other_reason, new, QUEUE[1]]) == {2: Explainer(QUEUE, POLICY)(QUEUE[1])}


def test_an_old_read_or_no_daemon_is_no_answer(service):
    service.seen(QUEUE, POLICY, time.time() - 60)  # a daemon stuck on a slurmctld that does not answer
    assert ask(url(service), QUEUE) == {}
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    t0 = time.monotonic()
    assert ask(f"http://127.0.0.1:{free}", QUEUE) == {}
    assert time.monotonic() - t0 < 0.5


def test_a_request_it_cannot_read_is_refused_in_words(service):
    service.seen(QUEUE, POLICY, time.time())
    for path in ("/nope", "/why?jobs=2,x", "/why?jobs=" + ",".join(["2"] * (MAX_JOBS + 1))):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url(service) + path, timeout=5)
        assert e.value.code == 400
    with urllib.request.urlopen(url(service) + "/why?jobs=2,404", timeout=5) as r:
        assert list(json.load(r)["jobs"]) == ["2"]
    many = [dataclasses.replace(QUEUE[1], job_id=1_000_000 + i) for i in range(MAX_JOBS)]
    service.seen([*QUEUE, *many], POLICY, time.time())
    assert len(ask(url(service), many)) == MAX_JOBS  # seven-digit ids, one request line
    assert ask(url(service), [*many, QUEUE[1]]) == {}  # more than that: not asked


def test_a_time_in_the_words_is_of_the_answer_not_of_the_read(service):
    begin = dataclasses.replace(job(7, reason="BeginTime"), eligible_time=int(time.time()) + 100)
    service.seen([begin], POLICY, time.time() - 5)
    assert ask(url(service), [begin])[7] in (f"starts no earlier than in {s} s (--begin)" for s in (98, 99, 100))


@pytest.fixture
def commands(monkeypatch, tmp_path, service):
    """`hai` of user hai-alice on QUEUE, the policy naming `service`."""
    slurm = CountingSlurm(QUEUE)
    policy = dataclasses.replace(POLICY, daemon_service=url(service))
    monkeypatch.setattr(slurm_hai.policy.model, "find_policy", lambda: policy)
    monkeypatch.setattr(user, "backend", lambda: slurm)
    monkeypatch.setattr(common, "backend", lambda: slurm)
    monkeypatch.setattr(common, "current_user", lambda: "hai-alice")
    monkeypatch.setattr(user, "current_user", lambda: "hai-alice")
    monkeypatch.setenv("HAI_HOME", str(tmp_path / "home"))
    return slurm


def test_status_and_list_take_the_daemons_words_and_read_the_queue_without_them(commands, service):
    expected = Explainer(QUEUE, POLICY)(QUEUE[4])
    r = CliRunner().invoke(user.main, ["status", "5", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["reason"] == expected, r.output
    assert commands.calls == [("jobs", (5,), None), ("jobs", (), None)]  # no answer yet: the whole queue
    service.seen(QUEUE, POLICY, time.time())
    commands.calls.clear()
    r = CliRunner().invoke(user.main, ["status", "5", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["reason"] == expected, r.output
    assert commands.calls == [("jobs", (5,), None)]  # the job's own record alone
    commands.calls.clear()
    r = CliRunner().invoke(user.main, ["list", "--json"])
    assert r.exit_code == 0, r.output
    assert {row["job_id"]: row["reason"] for row in json.loads(r.output)} == {
        j.job_id: Explainer(QUEUE, POLICY)(j) for j in QUEUE[1:]}
    assert commands.calls == [("jobs", (), "hai-alice")]
