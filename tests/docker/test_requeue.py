"""Requeue on the Docker cluster (contrib/slurm-docker/up): jobs that span containers, each
container a machine of its own (host name, network, cgroups, memory).

  * contrib/smoke.sh passes there, on 2 nodes;
  * a HIGH job takes a node of a LOW job that spans both containers; the LOW job commits a
    suspend checkpoint, is requeued, resumes after the HIGH job, and ends with the weights
    of an uninterrupted run, bit for bit;
  * a compute container killed (`docker kill`) in the middle of a 2-node run: Slurm finds
    the node dead and requeues the job, which resumes from its newest committed checkpoint
    (the killed node's memory is gone: the durable copy that the persist agents made, or the
    peer's) and ends bit for bit equal to an uninterrupted run.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

import uninterrupted
from uninterrupted import same_weights
import waiting

# Live-cluster tests: tests/conftest.py fails a CI run that executed none.
pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
STEPS = 200
# 2 nodes x 1 process: world size 2; a short sleep per step so that a suspend or a kill lands
# mid-run. A periodic checkpoint every 20 steps (train.py's --save-every).
TRAIN_ARGS = ["--nprocs", "1", "--steps", str(STEPS), "--step-sleep", "0.05"]


def wait_for(what: str, cond, timeout: float, interval: float = 0.3):
    return waiting.wait_for(cond, timeout, what, interval)


def events(job_dir: Path, name: str) -> list[dict]:
    try:
        lines = (job_dir / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [e for e in map(json.loads, filter(str.strip, lines)) if e["event"] == name]


def train_lines(job_dir: Path) -> list[str]:
    try:
        text = (job_dir / "logs" / "rank-0.log").read_text(errors="replace")
    except FileNotFoundError:
        return []
    return [line for line in text.splitlines() if line.startswith("[train]")]


def found(job_dir: Path, pattern: str) -> list[str]:
    return [m.group(1) for line in train_lines(job_dir) for m in [re.search(pattern, line)] if m]


def last_step(job_dir: Path) -> int:
    return max(map(int, found(job_dir, r" step (\d+)/")), default=0)


def resumed_from(job_dir: Path) -> list[int]:
    return list(map(int, found(job_dir, r"resumed from step (\d+)")))


def committed_steps(job_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (job_dir / "checkpoints").glob("step-*"))


def wait_final(job_dir: Path, timeout: float) -> dict:
    return wait_for(f"{job_dir} to end", lambda: (job_dir / "final.json").exists()
                    and json.loads((job_dir / "final.json").read_text()), timeout)


@pytest.fixture(scope="module")
def reference() -> Path:
    """examples/train.py run uninterrupted on this host, world size 2 (1 node x 2 processes:
    the same ranks and collectives as 2 containers x 1), by the venv whose torch & co. the
    image has at the same versions (contrib/slurm-docker/docker_cluster.py, PINNED)."""
    return uninterrupted.weights(["--nprocs", "2", "--steps", str(STEPS)])


@pytest.fixture
def work(docker_cluster, request) -> tuple[Path, str]:
    """A directory of /data for this test, examples/train.py in it."""
    here, there = docker_cluster.shared_dir(request.node.name[:40])
    shutil.copy(REPO / "examples" / "train.py", here / "train.py")
    return here, there


def test_smoke_script_passes_on_two_containers(docker_cluster, work):
    _, there = work
    script = (REPO / "contrib" / "smoke.sh").read_text()
    p = docker_cluster.run(["bash", "-c", script], env={"SMOKE_DIR": there, "SMOKE_NODES": "2"}, check=False)
    assert p.returncode == 0 and "SMOKE PASSED" in p.stdout, p.stdout + p.stderr


def test_high_job_preempts_low_job_across_containers_and_low_resumes_bit_for_bit(docker_cluster, work, reference):
    here, there = work
    (here / "high.py").write_text("import socket, time\ntime.sleep(3)\nprint('HIGH ran on', socket.gethostname())\n")
    low, low_dir = docker_cluster.submit(f"{there}/hai", f"{there}/train.py", "-n", "2", "-p", "LOW",
                                         args=TRAIN_ARGS)
    wait_for("the LOW job to train on both containers", lambda: last_step(low_dir) >= 30, 120)
    low_nodes = docker_cluster.run(["scontrol", "show", "hostnames", docker_cluster.job(low)["NodeList"]]).stdout.split()
    assert low_nodes == ["c1", "c2"]
    high, high_dir = docker_cluster.submit(f"{there}/hai", f"{there}/high.py", "-n", "1", "-p", "HIGH")
    suspended = wait_for("the LOW job to suspend", lambda: events(low_dir, "suspended"), 60)
    assert suspended[0]["how"] == "go_suspend"
    commits = list(map(int, found(low_dir, r"checkpoint step (\d+) committed")))
    assert len(commits) == 1 and 30 <= commits[0] < STEPS
    assert wait_final(high_dir, 120)["state"] == "succeeded"
    (high_start,) = events(high_dir, "start")
    assert high_start["nodes"] in low_nodes  # the HIGH job took a node of the LOW job
    assert wait_final(low_dir, 180)["state"] == "succeeded"
    assert resumed_from(low_dir) == commits  # where the suspend left it
    assert [e["run"] for e in events(low_dir, "start")] == [0, 1]
    assert [e["nodes"] for e in events(low_dir, "start")] == ["c[1-2]", "c[1-2]"]
    assert same_weights(low_dir / "final-weights.safetensors", reference), "resumed weights differ"


def test_compute_container_killed_mid_run_job_requeued_resumes_from_newest_commit(docker_cluster, work, reference):
    here, there = work
    job, job_dir = docker_cluster.submit(f"{there}/hai", f"{there}/train.py", "-n", "2", "-p", "LOW",
                                         args=TRAIN_ARGS)
    # 1. A suspend first: its checkpoint goes to each node's memory, and the persist agents
    #    of both containers make the durable copy once the job has let go.
    wait_for("the job to train", lambda: last_step(job_dir) >= 30, 120)
    docker_cluster.run(["hai", "suspend", str(job)])
    wait_for("run 1 to resume", lambda: resumed_from(job_dir), 90)
    (suspend_step,) = resumed_from(job_dir)
    (said,) = [line for line in train_lines(job_dir) if f"checkpoint step {suspend_step} committed" in line]
    assert "memory" in said, said  # suspend_save() committed to the nodes' memory
    wait_for("the persist agents' durable copy of the suspend checkpoint",
             lambda: suspend_step in committed_steps(job_dir), 60)
    # 2. Run 1 trains past a periodic commit; then the container of the node that is not the
    #    batch host is killed: its slurmd, the job's processes and its memory are gone.
    wait_for("a periodic commit after the resume", lambda: max(committed_steps(job_dir)) > suspend_step, 90)
    (node,) = [n for n in ("c1", "c2") if n != docker_cluster.job(job)["BatchHost"]]
    docker_cluster.kill_node(node)
    committed = committed_steps(job_dir)  # no save commits without the killed node's rank
    try:
        wait_for(f"Slurm to find {node} dead (SlurmdTimeout)", lambda: "down" in docker_cluster.node_state(node), 60)
        wait_for("the job to be requeued", lambda: docker_cluster.job(job)["JobState"] in ("PENDING", "REQUEUED"), 60)
    finally:  # never leave the cluster without the node, whatever failed above
        docker_cluster.node_up(node)
    final = wait_final(job_dir, 240)
    assert final["state"] == "succeeded"
    assert resumed_from(job_dir) == [suspend_step, max(committed)]
    assert [e["run"] for e in events(job_dir, "start")] == [0, 1, 2]
    (reload,) = [line for line in train_lines(job_dir) if f"run 2: resumed from step {max(committed)}" in line]
    assert "node memory" not in reload, reload  # the killed node's memory is gone
    assert same_weights(job_dir / "final-weights.safetensors", reference), "resumed weights differ"
