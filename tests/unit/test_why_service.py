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
from slurm_hai.controller import why
from slurm_hai.controller.why import MAX_JOBS, WhyService, ask, everyone
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
    monkeypatch.setattr(user, "find_policy", lambda: policy)
    monkeypatch.setattr(slurm_hai.policy.model, "find_policy", lambda: policy)  # front.daemon_service's
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


def test_list_all_takes_everyone_elses_jobs_from_the_daemon_and_reads_only_yours(commands, service):
    r = CliRunner().invoke(user.main, ["list", "--all", "--json"])
    assert r.exit_code == 0, r.output
    assert commands.calls == [("jobs", (), None)]  # the daemon has read nothing yet: the whole queue
    whole = json.loads(r.output)
    service.seen(QUEUE, POLICY, time.time())
    commands.calls.clear()
    r = CliRunner().invoke(user.main, ["list", "--all", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == whole  # the same rows, root's running job included
    assert commands.calls == [("jobs", (), "hai-alice")]  # alice's own jobs alone
    # a job of alice's that started after the daemon's read is shown (hers are read now);
    # another user's, from the daemon's next read on
    commands.queue = [*QUEUE, job(6, "RUNNING"), job(7, user="hai-bob")]
    commands.calls.clear()
    r = CliRunner().invoke(user.main, ["list", "--all"])
    assert r.exit_code == 0, r.output
    shown = [int(line.split()[0]) for line in r.output.splitlines()[1:]]
    assert shown == [1, 2, 3, 4, 5, 6] and commands.calls == [("jobs", (), "hai-alice")]
    # one of alice's waiting jobs the daemon has no words for: the whole queue, as before
    commands.queue = [*QUEUE, job(8)]
    commands.calls.clear()
    r = CliRunner().invoke(user.main, ["list", "--all"])
    assert r.exit_code == 0, r.output
    assert commands.calls == [("jobs", (), "hai-alice"), ("jobs", (), None)]
    assert [int(line.split()[0]) for line in r.output.splitlines()[1:]] == [1, 2, 3, 4, 5, 8]


def test_everyone_is_answered_from_the_read_before_while_the_newest_ones_answer_is_made(service):
    service.seen(QUEUE, POLICY, time.time())
    first = everyone(url(service))
    assert first is not None and [s.job_id for s in first] == [1, 2, 3, 4, 5]
    assert first[0].private and first[0].reason.startswith("running at NORMAL on 4 nodes")
    service.seen([*QUEUE, job(6)], POLICY, time.time())
    assert [s.job_id for s in everyone(url(service))] == [1, 2, 3, 4, 5]  # at once, the read before's
    deadline = time.monotonic() + 10
    while len(everyone(url(service))) < 6:  # the newest read's, once made
        assert time.monotonic() < deadline
        time.sleep(0.01)
    service.seen(QUEUE, POLICY, time.time() - 60)  # a daemon stuck on a slurmctld that does not answer
    with service._lock:
        service._everyone = None
    assert everyone(url(service)) is None


def test_everyone_from_a_daemon_of_another_version_is_not_taken(service, monkeypatch):
    service.seen(QUEUE, POLICY, time.time())
    monkeypatch.setattr(why, "_fields", lambda: ["job_id", "name"])  # the daemon's HaiStatus has other fields
    body = service.everyone()
    monkeypatch.undo()
    assert json.loads(body)["fields"] == ["job_id", "name"]
    with service._lock:
        service._everyone = (service._everyone[0], body)
    assert everyone(url(service)) is None
