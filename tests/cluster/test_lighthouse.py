"""`hai-admin lighthouse` on the live cluster (issue 31): the jobs' parts ask it for their
job's torchft lighthouse; it starts one while Slurm holds the job, keeps it through its own
kill -9, and stops it once Slurm says the job ended."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import wait_for

from slurm_hai.runtime.parts import PartError, ask

pytestmark = pytest.mark.cluster
ALICE = "hai-alice"
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


def test_a_jobs_lighthouse_runs_while_slurm_holds_the_job_and_through_the_services_kill_9(live, tmp_path):
    state, log = tmp_path / "state", tmp_path / "service.log"
    job = int(live.run(["sbatch", "--parsable", "--hold", "-o", "/dev/null", "--wrap", "sleep 600"],
                       user=ALICE).stdout.strip().split(";")[0])
    service, url = start_service(live, state, log)
    try:
        address = ask(url, job)
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
