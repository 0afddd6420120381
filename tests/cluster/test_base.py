"""The base the project stands on, proven on the live local cluster."""

from __future__ import annotations

import time

import pytest

from waiting import FIRST_START


def test_batch_job_runs_on_two_nodes_with_gpus(live, tmp_path):
    out = live.shared_dir("two-nodes")
    job = live.sbatch("-N2", "--gres=gpu:8", f"--output={out}/%j.out",
                      "--wrap", "srun bash -c 'echo $SLURMD_NODENAME gpus=$SLURM_GPUS_ON_NODE'")
    info = live.wait_job(job, lambda j: j["JobState"] == "COMPLETED", 60, "completion")
    assert info["NumNodes"] == "2"
    lines = sorted((out / f"{job}.out").read_text().split("\n"))
    lines = [line for line in lines if line]
    assert len(lines) == 2
    assert {line.split()[0] for line in lines} == {"n1", "n2"}
    assert all(line.endswith("gpus=8") for line in lines)


def test_more_gpus_than_a_node_has_is_refused(live):
    p = live.run(["sbatch", "--gres=gpu:9", "--wrap", "true"], check=False)
    assert p.returncode != 0
    assert "Requested node configuration is not available" in p.stderr


@pytest.fixture
def short_low_grace(live):
    """QOS low with a 2 s GraceTime for one test: the local cluster's is 60 s (the most a job
    may ask for), and a job that ignores the notice is requeued only when it ends."""
    def grace(seconds: int) -> None:
        live.run(["sacctmgr", "-i", "modify", "qos", "where", "name=low", "set", f"GraceTime={seconds}"])
        time.sleep(1)  # slurmdbd pushes the change to slurmctld (no command shows a QOS's GraceTime there)

    shown = live.run(["sacctmgr", "-n", "-P", "show", "qos", "low", "format=GraceTime"]).stdout.strip()
    h, m, sec = (int(x) for x in shown.split(":"))  # HH:MM:SS
    grace(2)
    try:
        yield live
    finally:
        grace(3600 * h + 60 * m + sec)


def test_higher_qos_preempts_lower_which_is_requeued_and_runs_again(short_low_grace):
    live = short_low_grace
    out = live.shared_dir("preempt")
    # The batch script outlives its killed step, so only Slurm's requeue ends the run.
    low = live.sbatch("-N4", "--qos=low", "--gres=gpu:8", "--requeue", "--open-mode=append",
                      f"--output={out}/low.out",
                      "--wrap", "echo run=${SLURM_RESTART_COUNT:-0}; srun sleep 600; sleep 600")
    live.wait_job(low, lambda j: j["JobState"] == "RUNNING", FIRST_START, "the low job to run")
    high = live.sbatch("-N2", "--qos=high", "--gres=gpu:8", f"--output={out}/high.out", "--wrap", "sleep 2")
    live.wait_job(high, lambda j: j["JobState"] in ("RUNNING", "COMPLETED"), 90, "the high job to start")
    # The low job is requeued, not cancelled: same id, restart count 1, and it runs again.
    info = live.wait_job(low, lambda j: j["Restarts"] == "1" and j["JobState"] == "RUNNING", 120,
                         "the low job to run again after its requeue")
    assert info["QOS"] == "low"
    assert live.job(high)["JobState"] == "COMPLETED"
    deadline = time.monotonic() + 20
    while "run=1" not in (out / "low.out").read_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    runs = [w for w in (out / "low.out").read_text().split() if w.startswith("run=")]
    assert runs == ["run=0", "run=1"]


def test_same_qos_never_preempts(live):
    first = live.sbatch("-N4", "--qos=normal", "--gres=gpu:8", "--wrap", "srun sleep 600")
    live.wait_job(first, lambda j: j["JobState"] == "RUNNING", FIRST_START, "the first job to run")
    second = live.sbatch("-N1", "--qos=normal", "--gres=gpu:8", "--wrap", "true")
    time.sleep(8)  # longer than grace + a scheduling pass
    assert live.job(first)["JobState"] == "RUNNING"
    assert live.job(first)["Restarts"] == "0"
    assert live.job(second)["JobState"] == "PENDING"


def test_accounting_and_qos_are_enforced(live):
    p = live.run(["sbatch", "--qos=no_such_qos", "--wrap", "true"], check=False)
    assert p.returncode != 0 and "Invalid qos specification" in p.stderr
    # A user without an accounting association cannot run anything.
    p = live.run(["sbatch", "--wrap", "true"], user="nobody", check=False)
    assert p.returncode != 0 and "Invalid account" in p.stderr
    job = live.sbatch("-N1", "--qos=low", "--wrap", "true", user="hai-alice")
    live.wait_job(job, lambda j: j["JobState"] == "COMPLETED", 60, "completion")
    # slurmdbd fills the record in steps (the QOS name may read "Unknown" for a moment).
    expected = "hai-alice|low|hai|COMPLETED"
    acct = ""
    deadline = time.monotonic() + 30
    while acct.strip() != expected and time.monotonic() < deadline:
        time.sleep(1)
        acct = live.run(["sacct", "-n", "-X", "-P", "-j", str(job), "-o", "User,QOS,Account,State"]).stdout
    assert acct.strip() == expected


def test_localcluster_down_up_twice_and_status(live):
    """down stops exactly the daemons it started; up brings the same cluster back; up is idempotent."""
    import os
    import subprocess
    from pathlib import Path

    here = Path(__file__).resolve().parents[2] / "contrib" / "localcluster"

    def script(name: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(here / name)], text=True, capture_output=True, env=os.environ, timeout=300)

    pids_before = {p.name: p.read_text().strip() for p in (live.state / "run").glob("*.pid")}
    down = script("down")
    assert down.returncode == 0 and "slurmctld" in down.stdout
    st = script("status")
    assert st.returncode == 1 and "cluster is down" in st.stdout
    for name, pid in pids_before.items():  # gone (a zombie waiting for init to reap it has no exe)
        assert not Path(f"/proc/{pid}/exe").exists(), f"{name} (pid {pid}) still runs after down"
    for _ in range(2):
        up = script("up")
        assert up.returncode == 0, up.stderr
        tracked = "jobs tracked by cgroup" if live.tracks_by_cgroup else "jobs tracked by proctrack/linuxproc"
        assert f"is up (4 nodes x 8 GPUs, {tracked}" in up.stdout, up.stdout
    st = script("status")
    assert st.returncode == 0 and "cluster is up" in st.stdout and st.stdout.count("idle") == 4
    job = live.sbatch("-N4", "--wrap", "true")
    live.wait_job(job, lambda j: j["JobState"] == "COMPLETED", 60, "a job on the rebooted cluster")
