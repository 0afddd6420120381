"""`hai-admin lighthouse` on the live cluster (issue 31): the jobs' parts ask it for their
job's torchft lighthouse; it starts one while Slurm holds the job, keeps it through its own
kill -9, and stops it once Slurm says the job ended. Only the job's owner gets it (issue 57):
the asks carry MUNGE credentials, here made by real unprivileged users on the cluster's
munged; a slow client holds no one else's ask; a lighthouse listens only where the service
does."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

import pytest
from slow_client import SlowClient
from waiting import wait_for

from slurm_hai import slurm
from slurm_hai.runtime.parts import PartError, ask

pytestmark = pytest.mark.cluster
ALICE, BOB = "hai-alice", "hai-bob"
REPO = Path(__file__).resolve().parents[2]


def start_service(live, state: Path, log: Path) -> tuple[subprocess.Popen, str]:
    seen = log.stat().st_size if log.exists() else 0  # an earlier service's lines stay in the log
    out = log.open("a")
    proc = subprocess.Popen([sys.executable, "-m", "slurm_hai.cli.admin", "lighthouse", "--listen", "127.0.0.1",
                             "--port", "0", "--state-dir", str(state), "--sweep-every", "0.5"],
                            env=live.env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    port = wait_for(lambda: proc.poll() is not None or
                    re.findall(r"lighthouse service on 127\.0\.0\.1:(\d+)", log.read_text()[seen:]), 20,
                    "the lighthouse service", 0.05)
    assert proc.poll() is None, log.read_text()
    return proc, f"http://127.0.0.1:{port[-1]}"


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_jobs_lighthouse_runs_while_slurm_holds_the_job_and_through_the_services_kill_9(live, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.setenv("SLURM_CONF", str(live.conf))  # this process's asks: MUNGE on the cluster's socket
    slurm.forget_munge_socket()
    state, log = tmp_path / "state", tmp_path / "service.log"
    job = int(live.run(["sbatch", "--parsable", "--hold", "-o", "/dev/null", "--wrap", "sleep 600"],
                       user=ALICE).stdout.strip().split(";")[0])
    service, url = start_service(live, state, log)
    try:
        address = ask(url, job)  # as root
        pid = json.loads((state / f"{job}.json").read_text())["pid"]
        assert running(pid) and ask(url, job) == address
        with pytest.raises(PartError, match=f"job {job + 1000} is not running or waiting in Slurm"):
            ask(url, job + 1000)

        service.kill()  # kill -9: the lighthouse runs on, and the next service finds it
        service.wait()
        assert running(pid)
        service, url = start_service(live, state, log)
        assert ask(url, job) == address and running(pid)

        live.run(["scancel", str(job)])
        wait_for(lambda: not running(pid), 30, "the sweep to stop the ended job's lighthouse")
        assert not (state / f"{job}.json").exists()
        with pytest.raises(PartError, match=f"job {job} is not running or waiting in Slurm"):
            ask(url, job)
    finally:
        service.send_signal(signal.SIGTERM)
        service.wait(15)
        for path in state.glob("*.json"):
            os.kill(json.loads(path.read_text())["pid"], signal.SIGKILL)
    assert "Traceback" not in log.read_text(), log.read_text()


def ask_as(live, user: str, url: str, job: int, min_parts: int) -> str:
    """`ask` as `user`, in a process of theirs: the lighthouse's address, or PartError's line."""
    code = ("import sys\nfrom slurm_hai.runtime.parts import PartError, ask\n"
            "try:\n    print(ask(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))\n"
            "except PartError as e:\n    print(e)\n")
    return live.run([sys.executable, "-c", code, url, str(job), str(min_parts)], user=user, cwd=REPO).stdout.strip()


def munged_as(live, user: str, target: str) -> str:
    """A MUNGE credential of `user` for `target`, as their `munge` makes it (captured here)."""
    sock = re.search(r"socket=([^,]+)", live.run(["scontrol", "show", "config"]).stdout).group(1)
    return live.run(["munge", "--socket", sock, "-s", target], user=user).stdout.strip()


def get(url: str, headers: dict[str, str]) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def listening(pid: int) -> set[str]:
    """The local addresses process `pid` listens on (TCP), as ss prints them."""
    out = subprocess.run(["ss", "-H", "-ltnp"], text=True, capture_output=True, check=True).stdout
    return {line.split()[3] for line in out.splitlines() if f"pid={pid}," in line}


def test_only_the_jobs_owner_gets_its_lighthouse_and_a_slow_client_holds_no_ask(live, tmp_path):
    state, log = tmp_path / "state", tmp_path / "service.log"
    job = int(live.run(["sbatch", "--parsable", "--hold", "-o", "/dev/null", "--wrap", "sleep 600"],
                       user=ALICE).stdout.strip().split(";")[0])
    service, url = start_service(live, state, log)
    slow = SlowClient(int(url.rsplit(":", 1)[1]), b"GET /v1/jobs/1?min=1 HTTP/1.1\r\nHost: x\r\n\r\n")

    try:
        # hai-bob first, with a wrong MIN: no credential, his own, one of hers for another ask
        target = f"/v1/jobs/{job}?min=9"
        assert get(url + target, {}) == (403, {"error": "no credential: ask with 'Authorization: Munge "
                                                        "<munge -s TARGET>' (slurm_hai.runtime.parts.ask does)"})
        assert ask_as(live, BOB, url, job, 9) == (
            f"{url}{target}: job {job} is not yours (you are uid {live.uid(BOB)}): only its owner and root may "
            "ask for its lighthouse")
        assert get(url + target, {"Authorization": f"Munge {munged_as(live, ALICE, f'/v1/jobs/{job}?min=2')}"}) == \
            (403, {"error": "the MUNGE credential was made for another request: munge the request's own target"})
        assert not (state / f"{job}.json").exists()  # he started nothing

        # a client that sends one byte every 0.9 s holds no one's ask, and is cut off
        slow.start()
        wait_for(lambda: slow.sent, 10, "the slow client's first byte", 0.05)
        assert not slow.cut.is_set()
        address = ask_as(live, ALICE, url, job, 2)  # her MIN
        assert address.startswith("http://127.0.0.1:"), address
        wait_for(slow.cut.is_set, 60, "the service to cut the slow client off", 0.1)
        assert len(slow.sent) < len(slow.request)

        # her credential, once used, is refused to him (munged: replayed)
        hers = munged_as(live, ALICE, f"/v1/jobs/{job}?min=2")
        assert get(f"{url}/v1/jobs/{job}?min=2", {"Authorization": f"Munge {hers}"}) == \
            (200, {"job": job, "address": address})
        assert get(f"{url}/v1/jobs/{job}?min=2", {"Authorization": f"Munge {hers}"}) == \
            (403, {"error": "the MUNGE credential is replayed: ask again with a fresh one"})
        assert ask_as(live, BOB, url, job, 1).endswith(f"job {job} is not yours (you are uid {live.uid(BOB)}): only "
                                                       "its owner and root may ask for its lighthouse")

        # her lighthouse: her MIN, and only where the service listens (--listen 127.0.0.1)
        pid = json.loads((state / f"{job}.json").read_text())["pid"]
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"--min-parts") + 1] == b"2"
        assert listening(pid) == {f"127.0.0.1:{address.rsplit(':', 1)[1]}"}
        # a quorum there forms of her two parts
        from torchft._torchft import LighthouseClient

        quorums: list = []
        first = threading.Thread(target=lambda: quorums.append(LighthouseClient(address, timedelta(seconds=10)).quorum(
            replica_id="part0", timeout=timedelta(seconds=60))))
        first.start()
        second = LighthouseClient(address, timedelta(seconds=10)).quorum(replica_id="part1",
                                                                          timeout=timedelta(seconds=60))
        first.join(60)
        assert sorted(m.replica_id for m in second.participants) == ["part0", "part1"]
        assert [sorted(m.replica_id for m in q.participants) for q in quorums] == [["part0", "part1"]]
    finally:
        slow.close()
        service.send_signal(signal.SIGTERM)
        service.wait(15)
        for path in state.glob("*.json"):
            os.kill(json.loads(path.read_text())["pid"], signal.SIGKILL)
        live.run(["scancel", str(job)])
    assert "Traceback" not in log.read_text(), log.read_text()
