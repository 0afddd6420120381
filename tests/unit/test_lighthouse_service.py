"""The lighthouse service (slurm_hai/controller/lighthouse.py) with real torchft: lighthouses
started per job, torch-free, found again by the next service while parts keep their quorum,
replaced at a new address when one dies, stopped when their job ends; only its job's owner
(and root) gets its address, every connection is bounded, and the state directory is the
service's own. Slurm's answers (which jobs ended, who owns them) and MUNGE (who asks) are
given here; tests/cluster/test_lighthouse.py asks a live Slurm, as real users with MUNGE."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
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

from munge_fake import Unmunge, credential
from slow_client import SlowClient
from slurm_hai.controller import bounded_http
from slurm_hai.controller.lighthouse import (LighthouseError, Refused, Service, allowed, bind_address, credential_of,
                                             own_state_dir, reported_address, serve, uid_of_unmunged)
from slurm_hai.runtime import parts as parts_module
from slurm_hai.runtime.parts import PartError, ask

ALICE, BOB = 1001, 1002  # uids; this test runs as root, which may ask for any job


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


@pytest.fixture
def as_user(monkeypatch):
    """as_user(uid): the parts' asks in this process carry a fake credential of `uid`."""
    def become(uid: int) -> None:
        monkeypatch.setattr(parts_module, "munge_credential", lambda payload: credential(uid, payload))
    become(ALICE)
    return become


@pytest.fixture
def served():
    """served(service): the service answering on 127.0.0.1 (fake MUNGE), its URL; stopped after."""
    stops: list[tuple[threading.Event, threading.Thread]] = []

    def start(service: Service) -> str:
        port: list[int] = []
        stop = threading.Event()
        thread = threading.Thread(target=serve, args=(service, "127.0.0.1", 0, 0.2),
                                  kwargs={"ready": port.append, "stop": stop, "identify": Unmunge()}, daemon=True)
        thread.start()
        stops.append((stop, thread))
        return f"http://127.0.0.1:{wait_for('the service', lambda: port)[0]}"

    yield start
    for stop, thread in stops:
        stop.set()
        thread.join(timeout=10)


class Fixed(Service):
    """A service whose jobs (all ALICE's) have the lighthouse http://lighthouse:1, no process."""

    def address(self, job, min_parts, asker):
        allowed(job, ALICE, asker)
        return "http://lighthouse:1"


def test_a_jobs_lighthouse_outlives_the_service_and_ends_with_the_job(state):
    over: set[int] = set()

    def owner(job):
        return None if job in over else ALICE

    # torchft's 5 s heartbeat timeout: a loaded host's late heartbeat must not change the quorum here
    first = Service(state, ended=lambda ids: over & set(ids), heartbeat_timeout_ms=5000, owner=owner)
    address = first.address(7, 1, ALICE)
    assert first.address(7, 1, ALICE) == address == first.address(7, 1, 0)  # one lighthouse per job; root too
    assert address.startswith("http://127.0.0.1:")  # where the service listens, not this host's name
    with pytest.raises(Refused, match=f"^job 7 is not yours \\(you are uid {BOB}\\)"):
        first.address(7, 1, BOB)
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
        second = Service(state, ended=lambda ids: over & set(ids), heartbeat_timeout_ms=5000, owner=owner)
        assert second.address(7, 1, ALICE) == address and record(state, 7)["pid"] == pid
        with pytest.raises(Refused):  # the owner is kept in the record: still not BOB's
            second.address(7, 1, BOB)
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
    assert second.address(7, 1, ALICE) is None  # ended: no new lighthouse


def test_a_lighthouse_that_died_is_replaced_at_a_new_address(state):
    service = Service(state, ended=lambda ids: set(), owner=lambda job: ALICE)
    address = service.address(8, 1, ALICE)
    pid = record(state, 8)["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for("the lighthouse to die", lambda: not running(pid))
    again = service.address(8, 1, ALICE)
    assert again != address and record(state, 8)["pid"] != pid
    # the next service does not take a record whose process is gone (or a reused pid)
    (state / "9.json").write_text(json.dumps({"job": 9, "pid": os.getpid(), "address": "http://x:1",
                                              "started": 0.0}))
    (state / "10.json").write_text("not json")
    # a record of before owners were kept: its owner is asked of Slurm
    old = record(state, 8)
    del old["uid"]
    (state / "8.json").write_text(json.dumps(old))
    service.detach()
    after = Service(state, ended=lambda ids: set(), owner=lambda job: ALICE)
    assert sorted(after.lighthouses) == [8]
    assert not (state / "9.json").exists() and not (state / "10.json").exists()
    assert after.address(8, 1, ALICE) == again
    with pytest.raises(Refused):
        after.address(8, 1, BOB)


def test_parts_ask_over_http_and_get_one_line_answers(state, served, as_user):
    over = {11}

    def owner(job):
        if job == 13:
            raise LighthouseError("cannot ask Slurm about job 13: slurmctld is down")
        return None if job in over else ALICE

    url = served(Service(state, ended=lambda ids: over & set(ids), owner=owner))
    address = ask(url, 12)
    assert address.startswith("http://") and ask(url, 12) == address
    with pytest.raises(PartError, match=r"/v1/jobs/11\?min=1: job 11 is not running or waiting in Slurm$"):
        ask(url, 11)
    with pytest.raises(PartError, match=r"/v1/jobs/13\?min=1: cannot ask Slurm about job 13: slurmctld is down$"):
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


def test_only_the_jobs_owner_and_root_get_its_lighthouse(state, served, as_user):
    url = served(Service(state, ended=lambda ids: set(), owner=lambda job: ALICE))
    as_user(BOB)  # the first ask of a job not his starts nothing, with any MIN
    with pytest.raises(PartError, match=rf"/v1/jobs/15\?min=9: job 15 is not yours \(you are uid {BOB}\): only its "
                                        "owner and root may ask for its lighthouse$"):
        ask(url, 15, min_parts=9)
    assert not (state / "15.json").exists()
    as_user(ALICE)
    address = ask(url, 15, min_parts=2)
    argv = Path(f"/proc/{record(state, 15)['pid']}/cmdline").read_bytes().split(b"\0")
    assert argv[argv.index(b"--min-parts") + 1] == b"2"  # hers, not his
    as_user(BOB)
    with pytest.raises(PartError, match="job 15 is not yours"):
        ask(url, 15)
    as_user(0)
    assert ask(url, 15) == address

    def refused(headers: dict[str, str]) -> str:
        with pytest.raises(urllib.error.HTTPError) as no:
            urllib.request.urlopen(urllib.request.Request(f"{url}/v1/jobs/15?min=1", headers=headers), timeout=5)
        assert no.value.code == 403
        return json.load(no.value)["error"]

    assert refused({}).startswith("no credential: ask with 'Authorization: Munge <munge -s TARGET>'")
    assert refused({"Authorization": "Basic YWxpY2U6eA=="}).startswith("not a MUNGE credential")
    # ALICE's credential of one ask is good for that ask only, once
    theirs = credential(ALICE, "/v1/jobs/15?min=1")
    assert refused({"Authorization": f"Munge {credential(ALICE, '/v1/jobs/16?min=1')}"}) == \
        "the MUNGE credential was made for another request: munge the request's own target"
    with urllib.request.urlopen(urllib.request.Request(f"{url}/v1/jobs/15?min=1",
                                                       headers={"Authorization": f"Munge {theirs}"}), timeout=5) as r:
        assert json.load(r)["address"] == address
    assert refused({"Authorization": f"Munge {theirs}"}) == \
        "the MUNGE credential is replayed: ask again with a fresh one"


def raw_ask(port: int, job: int, uid: int = ALICE, source: str = "127.0.0.1") -> socket.socket:
    """A connection from `source` that sent a whole ask for `job` as `uid`."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))
    target = f"/v1/jobs/{job}?min=1"
    s.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Munge {credential(uid, target)}\r\n\r\n"
              .encode())
    return s


def test_a_part_that_goes_away_before_its_answer_leaves_no_traceback(state, capfd, caplog, served, as_user):
    # a part's task ends while its lighthouse watch asks (runtime/part_task.py): the service
    # answers into a closed connection, and says nothing of it above debug
    class Slow(Fixed):
        def address(self, job, min_parts, asker):
            time.sleep(0.3)  # the part is gone by then
            return super().address(job, min_parts, asker)

    url = served(Slow(state, ended=lambda ids: set()))
    for _ in range(3):
        with raw_ask(int(url.rsplit(":", 1)[1]), 12) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset at close
    time.sleep(0.6)  # the answers' writes fail meanwhile
    assert ask(url, 12) == "http://lighthouse:1"  # it serves on
    assert "Traceback" not in capfd.readouterr().err
    assert not [r for r in caplog.records if r.levelno > 10], caplog.records


def test_a_client_that_trickles_its_request_holds_no_other_ask_and_is_cut_off(state, served, as_user):
    url = served(Fixed(state, ended=lambda ids: set()))
    slow = SlowClient(int(url.rsplit(":", 1)[1]), b"GET /v1/jobs/12?min=1 HTTP/1.1\r\nHost: x\r\n\r\n").start()
    wait_for("the slow client's first bytes", lambda: len(slow.sent) >= 2)
    assert ask(url, 12) == "http://lighthouse:1" and not slow.cut.is_set()  # answered while the slow one trickles
    wait_for("the service to cut the slow client off", slow.cut.is_set, timeout=60)
    # before it was whole
    assert slow.sock.recv(100).startswith(b"HTTP/1.0 408 ") and len(slow.sent) < len(slow.request)
    slow.close()


def test_a_crowd_of_idle_connections_keeps_no_ask_out(state, served, as_user):
    url = served(Fixed(state, ended=lambda ids: set()))
    port = int(url.rsplit(":", 1)[1])
    crowd = [socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.2", 0))
             for _ in range(bounded_http.MAX_CONNECTIONS)]
    try:
        assert ask(url, 12) == "http://lighthouse:1"
        # too big a head: answered 431, in one line (all of it read: a close without a reset)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as big:
            big.sendall(b"GET /v1/jobs/12 HTTP/1.1\r\nX: ".ljust(bounded_http.MAX_HEAD + 1, b"y"))
            answer = big.makefile("rb").read()
        assert answer.startswith(b"HTTP/1.0 431 ") and answer.endswith(b"over 8192 bytes; send a shorter request\n")
    finally:
        for s in crowd:
            s.close()


def test_credentials_and_unmunges_answers_are_read_strictly():
    good = "MUNGE:AwQFAAB" + "x" * 100 + "=:"
    assert credential_of([f"Munge {good}"]) == good
    for bad in ([], [f"Munge {good}", f"Munge {good}"], [f"Basic {good}"], ["Munge MUNGE:a b:"],
                ["Munge MUNGE:" + "x" * 1001 + ":"], ["Munge MUNGE:x:\r\nX: y"]):
        with pytest.raises(Refused):
            credential_of(bad)
    target = "/v1/jobs/5?min=2"
    assert uid_of_unmunged(0, f"UID:             1001\n\n{target}", "", target) == 1001
    with pytest.raises(Refused, match="^the MUNGE credential was made for another request"):
        uid_of_unmunged(0, "UID:             1001\n\n/v1/jobs/6?min=2", "", target)
    with pytest.raises(Refused, match="^the MUNGE credential is replayed: ask again with a fresh one$"):
        uid_of_unmunged(17, "UID:             1001\n\n", "", target)
    with pytest.raises(Refused, match="^the MUNGE credential is expired"):
        uid_of_unmunged(15, "", "", target)
    with pytest.raises(LighthouseError, match=r'^cannot check MUNGE credentials: Failed to access "/x": No such file'):
        uid_of_unmunged(6, "", 'unmunge: Error: Failed to access "/x": No such file or directory\n', target)
    with pytest.raises(LighthouseError, match="unmunge said"):
        uid_of_unmunged(0, "STATUS: 0\n\n" + target, "", target)
    allowed(5, ALICE, ALICE)
    allowed(5, ALICE, 0)
    with pytest.raises(Refused, match=f"^job 5 is not yours \\(you are uid {BOB}\\)"):
        allowed(5, ALICE, BOB)


def test_the_parts_munge_on_slurms_socket(monkeypatch):
    from slurm_hai import slurm
    from slurm_hai.slurm import SlurmError

    class Conf:
        auth_info = ""

        def config(self):
            if self.auth_info is None:
                raise SlurmError("scontrol: slurmctld is down")
            return {"AuthInfo": self.auth_info}

    conf = Conf()
    monkeypatch.setattr(slurm, "backend", lambda: conf)
    for auth_info, socket_path in (("socket=/s/munged.sock,cred_expire=5", "/s/munged.sock"),
                                   ("/var/run/munge/munge.socket.2", "/var/run/munge/munge.socket.2"),
                                   ("(null)", None), ("cred_expire=5", None), (None, None)):
        conf.auth_info = auth_info
        slurm.forget_munge_socket()
        assert slurm.munge_socket() == socket_path, auth_info
    # a service started before slurmctld answers: asked again once it does (CI: every check
    # of a lighthouse service went to MUNGE's default socket)
    slurm.forget_munge_socket()
    conf.auth_info = None
    assert slurm.munge_socket() is None
    conf.auth_info = "socket=/s/munged.sock"
    assert slurm.munge_socket() == "/s/munged.sock"
    conf.auth_info = None
    assert slurm.munge_socket() == "/s/munged.sock"  # Slurm's answer is kept
    slurm.forget_munge_socket()


def test_lighthouses_bind_where_the_service_listens():
    assert [bind_address(a) for a in ("127.0.0.1", "::1", "0.0.0.0", "")] == \
        ["127.0.0.1:0", "[::1]:0", "0.0.0.0:0", "0.0.0.0:0"]
    assert reported_address("127.0.0.1", "http://vm:4321") == "http://127.0.0.1:4321"
    assert reported_address("::1", "http://vm:4321") == "http://[::1]:4321"
    assert reported_address("0.0.0.0", "http://vm:4321") == "http://vm:4321"


def test_the_state_directory_must_be_the_services_own(tmp_path):
    assert own_state_dir(tmp_path / "mine") == tmp_path / "mine"
    assert (tmp_path / "mine").stat().st_mode & 0o777 == 0o700
    sticky = tmp_path / "sticky"
    sticky.mkdir(mode=0o1777)
    sticky.chmod(0o1777)  # as /tmp: another user's entries can be made there, ours not replaced
    own_state_dir(sticky / "mine")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "theirs").mkdir()
    os.chown(tmp_path / "theirs", 65534, 65534)
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared").chmod(0o775)
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    for path, why in ((tmp_path / "link", "a link, not a directory"),
                      (tmp_path / "theirs", "owned by uid 65534, not this service's user"),
                      (tmp_path / "shared", "writable by other users"),
                      (tmp_path / "open" / "state", f"{tmp_path / 'open'}: writable by other users")):
        with pytest.raises(LighthouseError, match=re.escape(why)):
            own_state_dir(path)
    assert not (tmp_path / "open" / "state").exists() and not list((tmp_path / "elsewhere").iterdir())
    # the service fails safe, in one line
    p = subprocess.run([sys.executable, "-m", "slurm_hai.cli.admin", "lighthouse", "--port", "0", "--state-dir",
                        str(tmp_path / "link")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stdout == "" and len(p.stderr.splitlines()) == 1, p.stderr
    assert "a link, not a directory; remove it or give another --state-dir" in p.stderr
