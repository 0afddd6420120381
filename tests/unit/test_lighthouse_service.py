"""The lighthouse service (slurm_hai/controller/lighthouse.py) with real torchft: lighthouses
started per job, torch-free, found again by the next service while parts keep their quorum,
replaced at a new address when one dies, stopped when their job ends. Slurm's answer (which
jobs ended) is the one thing given here; tests/cluster/test_lighthouse.py asks a live Slurm."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

from slurm_hai.controller.lighthouse import LighthouseError, Service, serve
from slurm_hai.runtime.parts import PartError, ask


def wait_for(what, cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value


class Parts:
    """torchft parts of one job: a ManagerServer each (heartbeats) and a loop that asks for a
    quorum every 0.1 s, recording each quorum's id."""

    def __init__(self, address: str, n: int):
        from torchft._torchft import ManagerClient, ManagerServer

        self.stop = threading.Event()
        self.quorums: list[list[int]] = [[] for _ in range(n)]
        self.errors: list[str] = []
        self.servers = [ManagerServer(replica_id=f"part{i}:{uuid.uuid4()}", lighthouse_addr=address,
                                      hostname="localhost", bind="[::]:0", store_addr="localhost:1", world_size=1,
                                      heartbeat_interval=timedelta(milliseconds=100),
                                      connect_timeout=timedelta(seconds=10), quorum_retries=0) for i in range(n)]
        self.clients = [ManagerClient(s.address(), connect_timeout=timedelta(seconds=10)) for s in self.servers]
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _loop(self, i: int) -> None:
        try:
            while not self.stop.is_set():
                q = self.clients[i]._quorum(group_rank=0, step=0, checkpoint_metadata="", shrink_only=False,
                                            timeout=timedelta(seconds=20), init_sync=True, commit_failures=0)
                self.quorums[i].append(q.quorum_id)
                time.sleep(0.1)
        except Exception as e:  # noqa: BLE001 - a part's failure is what the test reports
            self.errors.append(str(e).splitlines()[0])

    def each_has(self, count: int) -> bool:
        assert not self.errors, self.errors
        return all(len(q) >= count for q in self.quorums)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)
        for s in self.servers:
            s.shutdown()


def record(state: Path, job: int) -> dict:
    return json.loads((state / f"{job}.json").read_text())


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def state(tmp_path):
    """The state directory; every lighthouse recorded in it is stopped after the test."""
    yield tmp_path
    for path in tmp_path.glob("*.json"):
        try:
            os.kill(json.loads(path.read_text())["pid"], signal.SIGKILL)
        except (OSError, ValueError, KeyError):
            pass


def test_a_jobs_lighthouse_outlives_the_service_and_ends_with_the_job(state):
    over: set[int] = set()
    # torchft's 5 s heartbeat timeout: a loaded host's late heartbeat must not change the quorum here
    first = Service(state, ended=lambda ids: over & set(ids), heartbeat_timeout_ms=5000)
    address = first.address(7)
    assert first.address(7) == address  # one lighthouse per job
    pid = record(state, 7)["pid"]
    # torch-free and small: torchft's Rust lighthouse, not the torchft package
    assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text()
    rss_kib = int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                       if line.startswith("VmRSS:")))
    assert rss_kib < 64 * 1024

    parts = Parts(address, 2)
    try:
        wait_for("both parts' quorums", lambda: parts.each_has(3))
        before = [list(q) for q in parts.quorums]
        first.detach()  # the service ends (a restart, a crash): its lighthouse stays
        second = Service(state, ended=lambda ids: over & set(ids), heartbeat_timeout_ms=5000)
        assert second.address(7) == address and record(state, 7)["pid"] == pid
        wait_for("quorums after the restart", lambda: parts.each_has(len(before[0]) + 10))
        # the quorum of before the restart all along: the lighthouse kept it
        after = {q for qs, old in zip(parts.quorums, before) for q in qs[len(old):]}
        assert after == {before[0][-1]} == {before[1][-1]}
    finally:
        parts.close()

    assert second.sweep() == []  # the job still runs: its lighthouse stays
    assert running(pid)
    over.add(7)
    assert second.sweep() == [7]
    wait_for("the lighthouse to stop", lambda: not running(pid))
    assert not (state / "7.json").exists()
    assert second.address(7) is None  # ended: no new lighthouse


def test_a_lighthouse_that_died_is_replaced_at_a_new_address(state):
    service = Service(state, ended=lambda ids: set())
    address = service.address(8)
    pid = record(state, 8)["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for("the lighthouse to die", lambda: not running(pid))
    again = service.address(8)
    assert again != address and record(state, 8)["pid"] != pid
    # the next service does not take a record whose process is gone (or a reused pid)
    (state / "9.json").write_text(json.dumps({"job": 9, "pid": os.getpid(), "address": "http://x:1",
                                              "started": 0.0}))
    (state / "10.json").write_text("not json")
    service.detach()
    after = Service(state, ended=lambda ids: set())
    assert sorted(after.lighthouses) == [8]
    assert not (state / "9.json").exists() and not (state / "10.json").exists()


def test_parts_ask_over_http_and_get_one_line_answers(state):
    over = {11}

    def ended(ids):
        if 13 in ids:
            raise LighthouseError("cannot ask Slurm whether a job ended: slurmctld is down")
        return over & set(ids)

    service = Service(state, ended=ended)
    port: list[int] = []
    stop = threading.Event()
    server = threading.Thread(target=serve, args=(service, "127.0.0.1", 0, 0.2),
                              kwargs={"ready": port.append, "stop": stop}, daemon=True)
    server.start()
    url = f"http://127.0.0.1:{wait_for('the service', lambda: port)[0]}"
    try:
        address = ask(url, 12)
        assert address.startswith("http://") and ask(url, 12) == address
        with pytest.raises(PartError, match=r"/v1/jobs/11\?min=1: job 11 is not running or waiting in Slurm$"):
            ask(url, 11)
        with pytest.raises(PartError, match=r"/v1/jobs/13\?min=1: cannot ask Slurm whether a job ended: slurmctld is down$"):
            ask(url, 13)
        assert not (state / "13.json").exists()
        with pytest.raises(urllib.error.HTTPError) as bad:
            urllib.request.urlopen(f"{url}/v1/jobs/x1", timeout=5)
        assert bad.value.code == 400 and json.load(bad.value) == {"error": "ask GET /v1/jobs/<job id>[?min=<parts>]"}
        # a job's MIN reaches its lighthouse at the first ask: quorums of MIN parts or more
        ask(url, 14, min_parts=3)
        argv = Path(f"/proc/{json.loads((state / '14.json').read_text())['pid']}/cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"--min-parts") + 1] == b"3"
        over.add(12)
        wait_for("the sweep to stop job 12's lighthouse", lambda: not (state / "12.json").exists())
    finally:
        stop.set()
        server.join(timeout=10)
    with pytest.raises(PartError, match="no lighthouse service there"):
        ask(url, 12, timeout=2)


def test_a_part_that_goes_away_before_its_answer_leaves_no_traceback(state, capfd, caplog):
    # a part's task ends while its lighthouse watch asks (runtime/part_task.py): the service
    # answers into a closed connection, and says nothing of it above debug
    class Slow(Service):
        def address(self, job, min_parts=1):
            time.sleep(0.3)  # the part is gone by then
            return "http://lighthouse:1"

    port: list[int] = []
    stop = threading.Event()
    server = threading.Thread(target=serve, args=(Slow(state, ended=lambda ids: set()), "127.0.0.1", 0, 60.0),
                              kwargs={"ready": port.append, "stop": stop}, daemon=True)
    server.start()
    wait_for("the service", lambda: port)
    try:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port[0])) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset at close
                s.sendall(b"GET /v1/jobs/12 HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.6)  # the answers' writes fail meanwhile
        assert ask(f"http://127.0.0.1:{port[0]}", 12) == "http://lighthouse:1"  # it serves on
    finally:
        stop.set()
        server.join(timeout=10)
    assert "Traceback" not in capfd.readouterr().err
    assert not [r for r in caplog.records if r.levelno > 10], caplog.records
