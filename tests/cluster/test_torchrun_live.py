"""hai-submit --torchrun on the live cluster: a 2-node torchrun job (2 processes per node,
gloo on CPU) is preempted by a higher level, resumes from its checkpoint and ends with the
weights of an uninterrupted run, bit for bit.

What it proves: torchrun runs once per node with the job's node count, the contract's node
rank and rank 0's address; RANK/LOCAL_RANK/WORLD_SIZE are torchrun's (global over both
nodes, an all_reduce sums every rank); every process of node 0, none of node 1, sees the
suspend notice; both runs use the thread count pinned in the job directory. On nodes that
track jobs by cgroup (issue 53), every process of either run (launchers, torchrun's agents,
their workers in sessions of their own) is in the job's cgroup on its own node, and none
outlives its run: not after the requeue, not after the end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from waiting import wait_for

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "torchrun_train.py"
STEPS = 200  # run 1 trains long enough (10 s at least) to be looked at
ALICE = "hai-alice"
RANK_LINE = re.compile(r"^\[torchrun\] rank (\d+)/(\d+) local_rank (\d+)/(\d+) node (\d+) run (\d+) threads (\d+) "
                       r"sum of ranks (\d+)$", re.M)


def events(job_dir: Path, name: str) -> list[dict]:
    path = job_dir / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e["event"] == name]


def node_log(job_dir: Path, node: int) -> str:
    path = job_dir / "logs" / f"rank-{node}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def last_step(job_dir: Path) -> int:
    steps = re.findall(r"^\[torchrun\] step (\d+)/", node_log(job_dir, 0), re.M)
    return int(steps[-1]) if steps else 0


def job_processes(job_dir: Path) -> list[int]:
    """Processes with the job's HAI_JOB_DIR in their environment (agents and workers of any run)."""
    needle = f"HAI_JOB_DIR={job_dir}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


def in_job_cgroups(live, job_id: int, pids: list[int]) -> dict[int, str]:
    """Each of `pids` -> its node, asserting (where the nodes track jobs by cgroup) that it is
    in a step cgroup of job `job_id` under that node's own cgroup."""
    nodes = {}
    for pid in pids:
        node, cgroup = live.node_of(pid), live.cgroup_of(pid)
        if node is None or cgroup is None:
            continue  # gone meanwhile
        if live.tracks_by_cgroup:
            want = rf"/hai-\d+/{node}/slurm_{node}/uid_{live.uid(ALICE)}/job_{job_id}/step_\w+(/task_\d+)?"
            assert re.fullmatch(want, cgroup), (pid, node, cgroup, Path(f"/proc/{pid}/cmdline").read_bytes())
        nodes[pid] = node
    return nodes


def test_torchrun_job_on_two_nodes_is_preempted_and_resumes_bit_for_bit(live, tmp_path):
    p = live.run(["hai-submit", "--json", "--torchrun", "-n", "2", "-p", "LOW", "--gpus-per-node", "2", str(SCRIPT),
                  "--steps", str(STEPS), "--step-sleep", "0.05"], user=ALICE)
    job_dir, job_id = Path(json.loads(p.stdout)["job_dir"]), json.loads(p.stdout)["job_id"]
    wait_for(lambda: last_step(job_dir) >= 20, 120, "run 0 to train 20 steps")
    run0 = in_job_cgroups(live, job_id, job_processes(job_dir))
    # on the 2 nodes: launchers, torchrun's agents and their workers (6 seen on 22.05 cgroup, CI 2026-12-06)
    assert len(set(run0.values())) == 2 and len(run0) >= 6, run0
    # a NORMAL job that needs every node takes the LOW job's two
    high = live.sbatch("-o", "/dev/null", "--qos=normal", "-N4", "--wrap", "sleep 2", user=ALICE)
    suspended = wait_for(lambda: events(job_dir, "suspended"), 60, "the preemption")
    assert suspended[0]["run"] == 0 and suspended[0]["how"] == "go_suspend", suspended
    assert events(job_dir, "notice")[0]["cause"] == "preempted", events(job_dir, "notice")
    # nothing of run 0 is left once the job is requeued
    live.wait_job(job_id, lambda j: j["JobState"] == "PENDING", 60, "the LOW job to be requeued")
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in run0), 20, "run 0's processes to be gone")
    assert live.wait_job(high, lambda j: j["JobState"] == "COMPLETED", 60, "the NORMAL job to run")
    resumed = wait_for(lambda: re.findall(r"^\[torchrun\] resumed from step (\d+)$", node_log(job_dir, 0), re.M),
                       150, "run 1 to resume")
    wait_for(lambda: last_step(job_dir) >= int(resumed[0]) + 5, 60, "run 1 to train 5 steps")
    run1 = in_job_cgroups(live, job_id, job_processes(job_dir))
    assert len(set(run1.values())) == 2 and len(run1) >= 6 and not set(run1) & set(run0), (run0, run1)
    final = wait_for(lambda: (job_dir / "final.json").exists() and json.loads((job_dir / "final.json").read_text()),
                     150, "the resumed run to finish")
    assert final["state"] == "succeeded", (final, node_log(job_dir, 0)[-3000:])
    assert [e["run"] for e in events(job_dir, "start")] == [0, 1]
    # nothing of either run outlives the job (torchrun's workers run in sessions of their own)
    wait_for(lambda: not job_processes(job_dir), 20, "the job's processes to be gone")

    logs = [node_log(job_dir, n) for n in (0, 1)]
    threads = (job_dir / "threads").read_text()
    for node, log in enumerate(logs):
        seen = {(int(m[5]), int(m[0])): m for m in RANK_LINE.findall(log)}
        # torchrun's meaning: global ranks over 2 nodes x 2 processes; node = the contract's node rank
        assert sorted(seen) == [(run, rank) for run in (0, 1) for rank in (2 * node, 2 * node + 1)], log
        for (_run, rank), m in seen.items():
            assert m[:5] == (str(rank), "4", str(rank % 2), "2", str(node))
            assert m[6] == threads and m[7] == "6"  # 0+1+2+3: the all_reduce spans both nodes
    # every process of node 0 saw the notice itself; node 1's learned it from the all_reduce
    suspends = [re.findall(r"^\[torchrun\] rank (\d+) suspends at step (\d+) \(notice on this node: (\w+)\)$", log, re.M)
                for log in logs]
    assert sorted(suspends[0]) == sorted([("0", suspends[0][0][1], "True"), ("1", suspends[0][0][1], "True")]), logs[0]
    assert sorted(suspends[1]) == sorted([("2", suspends[0][0][1], "False"), ("3", suspends[0][0][1], "False")]), logs[1]
    at = int(suspends[0][0][1])
    assert 20 <= at < STEPS and re.findall(r"^\[torchrun\] resumed from step (\d+)$", logs[0], re.M) == [str(at)]
    digest = re.findall(r"^\[torchrun\] done at step \d+: weights sha256=(\w+)$", logs[0], re.M)
    assert len(digest) == 1, logs[0]

    # the uninterrupted run, same world size (1 node x 4 processes), same pinned thread count
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HAI_", "SLURM_"))}
    ref = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                          str(SCRIPT), "--steps", str(STEPS), "--ckpt-dir", str(tmp_path / "ckpt")],
                         env={**env, "OMP_NUM_THREADS": threads}, text=True, capture_output=True, timeout=300)
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-2000:]
    assert digest == re.findall(r"^\[torchrun\] done at step \d+: weights sha256=(\w+)$", ref.stdout, re.M), (
        "resumed weights differ from the uninterrupted run")
