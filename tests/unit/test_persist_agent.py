"""The persist agent against hostile requests (agent.py, memory.py): what it refuses, how it
shares its children among users, its time limit, its spool's place and its pid file. The
live proof, as unprivileged users on real nodes, is tests/cluster/test_persist_agent_hostile.py."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from test_checkpoint_memory import single_state

from slurm_hai.checkpoint import CheckpointManager, agent as agent_mod, memory
from slurm_hai.checkpoint.agent import (REFUSED, REQUEST_MAX_BYTES, Agent, AgentError, Request, child_argv, child_env,
                                        next_request, prepare_spool)
from slurm_hai.checkpoint.manifest import step_dir_name

NOBODY = 65534


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    prepare_spool(tmp_path / "run" / "persist")
    return tmp_path / "run" / "persist"


def served(agent: Agent, timeout: float = 60) -> None:
    """agent.serve(once=True) in a thread: it must come back (no child blocks)."""
    done = threading.Event()
    thread = threading.Thread(target=lambda: (agent.serve(poll=0.02, once=True), done.set()), daemon=True)
    thread.start()
    assert done.wait(timeout), f"the agent still serves {sorted(agent.requests)} after {timeout} s"


def refused_lines(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and name in r.getMessage()]


def test_a_request_that_is_a_link_fifo_directory_or_too_big_is_refused_at_once_in_one_line(spool, caplog):
    os.symlink("/etc/passwd", spool / "0-link.json")
    os.mkfifo(spool / "0-fifo.json")
    (spool / "0-dir.json").mkdir()
    (spool / "0-big.json").write_bytes(b" " * (REQUEST_MAX_BYTES + 1))
    (spool / "0-good.json").write_text('{"part": "/nowhere"}')
    agent = Agent(spool)
    agent.scan()
    assert sorted(agent.requests) == ["0-good.json"]
    for name, why in (("0-link.json", "a symbolic link"), ("0-fifo.json", "a FIFO"), ("0-dir.json", "a directory"),
                      ("0-big.json", f"{REQUEST_MAX_BYTES + 1} bytes")):
        assert os.path.lexists(spool / f"failed-{name}") and not os.path.lexists(spool / name), name
        (line,) = refused_lines(caplog, name)
        assert why in line, line
    agent.scan()  # never looked at again
    assert sorted(agent.requests) == ["0-good.json"] and len(refused_lines(caplog, "0-fifo.json")) == 1


def test_a_users_flood_of_requests_is_cut_at_the_cap(spool, caplog, monkeypatch):
    monkeypatch.setattr(agent_mod, "MAX_WAITING_PER_UID", 3)
    for k in range(5):
        (spool / f"0-{k}.json").write_text('{"part": "/nowhere"}')
    agent = Agent(spool)
    agent.scan()
    assert len(agent.requests) == 3 and len(list(spool.glob("failed-*"))) == 2
    assert "has 3 requests waiting already" in refused_lines(caplog, "failed-")[0]


@pytest.mark.parametrize("what", ["part.json a FIFO", "part.json a link", "part a FIFO", "part a link",
                                  "a data file a FIFO", "not JSON", "a relative part"])
def test_a_request_whose_files_are_not_regular_or_that_is_malformed_is_refused_without_blocking(
        tmp_path, spool, monkeypatch, what):
    durable, fast = tmp_path / "durable", tmp_path / "shm"
    monkeypatch.setenv("HAI_PERSIST_SPOOL", str(spool))
    memory.write_agent_pidfile(spool)  # this test process stands in for the agent while saving
    CheckpointManager(durable, fast_dir=fast).suspend_save(2, single_state(2.0))
    (request,) = spool.glob("*-*.json")
    part = fast / "parts" / step_dir_name(2)
    if what.startswith("part.json"):
        (part / "part.json").unlink()
        os.mkfifo(part / "part.json") if "FIFO" in what else os.symlink(tmp_path / "elsewhere", part / "part.json")
    elif what.startswith("part a"):
        request.write_text(json.dumps({"part": str(tmp_path / "odd")}))
        os.mkfifo(tmp_path / "odd") if "FIFO" in what else os.symlink(part, tmp_path / "odd")
    elif what == "a data file a FIFO":
        data = next(p for p in part.iterdir() if p.name != "part.json")
        data.unlink()
        os.mkfifo(data)
    else:
        request.write_text('{"part": ' if what == "not JSON" else '{"part": "shm/parts/x"}')
    agent = Agent(spool)
    served(agent)
    assert (spool / f"failed-{request.name}").exists() and not request.exists()
    assert not (durable / step_dir_name(2)).exists()


def test_the_child_says_why_it_refuses_in_one_line_and_exits_refused(tmp_path, capfd):
    os.mkfifo(tmp_path / "part")
    request = tmp_path / "0-000000000002-tok-0.json"
    request.write_text(json.dumps({"part": str(tmp_path / "part")}))
    assert agent_mod.handle(request) == REFUSED and request.exists()
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and f"{request.name}: refused, kept as failed-{request.name}" in err[0] and "FIFO" in err[0]


def req(uid: int, order: int, **kw) -> Request:
    return Request(Path(f"/spool/{uid}-{order}.json"), uid, order, **kw)


def start(requests: list[Request], turns: dict[int, int]) -> list[Request]:
    """Start what next_request picks until it picks nothing; returns those, in order."""
    started = []
    while (r := next_request(requests, 0.0, turns)) is not None:
        r.child = object()  # type: ignore[assignment]
        turns[r.uid] = 100 + len(started)
        started.append(r)
    return started


def test_one_child_per_user_so_four_requests_of_one_user_do_not_hold_another_users():
    bob = [req(1001, k) for k in range(4)]
    alice = req(1000, 9)
    assert start([*bob, alice], {}) == [bob[0], alice]


def test_children_go_round_robin_to_the_user_who_waited_longest_and_never_above_the_cap():
    turns = {1000: 5, 1001: 3, 1002: 7}  # 1001 started a child longest ago, then 1000, then 1002
    requests = [req(1002, 0), req(1000, 1), req(1001, 2), req(1001, 3), req(1003, 4), req(1004, 5)]
    started = start(requests, turns)
    # new users first (never served), then by their last start; one each; four in all
    assert [r.uid for r in started] == [1003, 1004, 1001, 1000]
    assert next_request(requests, 0.0, turns) is None


def test_a_request_waits_out_its_back_off():
    late = req(1000, 0, next_try=10.0)
    assert next_request([late], 5.0, {}) is None and next_request([late], 10.0, {}) is late


def test_a_child_past_its_time_limit_is_killed_and_its_request_tried_again_then_failed(spool, monkeypatch, caplog):
    monkeypatch.setattr(agent_mod, "MAX_ATTEMPTS", 2)
    monkeypatch.setattr(agent_mod, "child_argv", lambda _: [sys.executable, "-c", "import time; time.sleep(600)"])
    request = spool / "0-000000000001-tok-0.json"
    request.write_text('{"part": "/nowhere"}')
    agent = Agent(spool, child_timeout_s=0.3)
    pids = []

    def one_child_then_its_end() -> None:
        agent.scan()
        agent.step()
        pids.append(agent.requests[request.name].child.pid)
        while request.name in agent.requests and agent.requests[request.name].child is not None:
            time.sleep(0.02)
            agent.step()
        assert not os.path.exists(f"/proc/{pids[-1]}")  # killed and reaped

    one_child_then_its_end()
    assert agent.requests[request.name].attempts == 1 and request.exists()  # tried again later
    agent.requests[request.name].next_try = 0.0  # the back-off (2 s) is not what this test is about
    one_child_then_its_end()
    assert request.name not in agent.requests and (spool / f"failed-{request.name}").exists()
    assert len([r for r in caplog.records if "ran past 0.3 s; killed" in r.getMessage()]) == 2


def test_the_child_is_a_fresh_interpreter_with_a_fixed_environment(monkeypatch):
    monkeypatch.setenv("ALICE_API_KEY", "secret")
    monkeypatch.setenv("PYTHONPATH", "/home/alice/lib")
    monkeypatch.setenv("HAI_PEER_GRACE_S", "0.5")
    assert child_argv(Path("/spool/r.json")) == [sys.executable, "-I", "-m", "slurm_hai.checkpoint.agent",
                                                 "/spool/r.json"]
    assert child_env() == {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "HAI_PEER_GRACE_S": "0.5"}


def test_a_spool_whose_place_others_can_write_to_or_that_is_a_link_is_refused(tmp_path):
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o1777)
    with pytest.raises(AgentError, match=r"others can create entries in .*open \(mode 1777\)"):
        prepare_spool(tmp_path / "open" / "persist")
    os.symlink(tmp_path / "safe", tmp_path / "link")
    (tmp_path / "safe").mkdir()
    with pytest.raises(AgentError, match="link is a symbolic link"):
        prepare_spool(tmp_path / "link" / "persist")
    os.symlink(tmp_path / "safe", tmp_path / "safe" / "persist")
    with pytest.raises(AgentError, match="is not a directory of uid"):
        prepare_spool(tmp_path / "safe" / "persist")
    (tmp_path / "theirs").mkdir()
    os.chown(tmp_path / "theirs", NOBODY, NOBODY)
    with pytest.raises(AgentError, match=f"belongs to uid {NOBODY}"):
        prepare_spool(tmp_path / "theirs" / "persist")
    prepare_spool(tmp_path / "new" / "run" / "persist")  # made with its parents, each 0755
    assert [oct(p.stat().st_mode & 0o7777) for p in (tmp_path / "new", tmp_path / "new" / "run")] == ["0o755"] * 2
    assert oct((tmp_path / "new" / "run" / "persist").stat().st_mode & 0o7777) == "0o1733"


def test_only_the_spools_owners_pid_file_says_an_agent_runs_and_a_fifo_there_does_not_block(spool):
    memory.write_agent_pidfile(spool)
    assert memory.agent_alive(spool)
    os.chown(spool / "agent.pid", NOBODY, NOBODY)  # a live pid, but not the agent's file
    assert not memory.agent_alive(spool)
    (spool / "agent.pid").unlink()
    os.mkfifo(spool / "agent.pid")
    assert not memory.agent_alive(spool)


def test_the_pid_file_is_written_over_a_link_or_a_directory_left_in_its_place(spool, tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep")
    os.symlink(target, spool / "agent.pid")
    memory.write_agent_pidfile(spool)
    assert target.read_text() == "keep" and memory.agent_alive(spool)
    (spool / "agent.pid").unlink()
    (spool / "agent.pid").mkdir()
    (spool / "agent.pid" / "x").touch()
    memory.write_agent_pidfile(spool)
    assert memory.agent_alive(spool) and len(list(spool.glob("failed-agent.pid-*"))) == 1
