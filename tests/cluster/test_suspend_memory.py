"""Suspend in memory time on the live cluster: examples/train.py, 4 nodes x 1 process, as
Alice. At the notice it commits to each node's memory (HAI_NODE_MEMORY, the node's own
/dev/shm) and lets go; the persist agent of each node (started by the local cluster inside
the node) copies its node's share to the durable directory as Alice, and the last one
commits it. The restart lands on the same 4 nodes and loads from their memory, and the
final weights are bit for bit those of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import re
import stat

import pytest
from test_acceptance import (ALICE, BOB, STEPS, TRAIN, committed_steps, daemon, last_step, named, reference,  # noqa: F401
                             resumed_from, same_weights, submit, train_lines, wait_final, wait_for)

from slurm_hai.checkpoint import verify_checkpoint
from slurm_hai.checkpoint.manifest import step_dir_name
from slurm_hai.checkpoint.memory import DEFAULT_SPOOL

pytestmark = pytest.mark.cluster

# No periodic save: a suspend at a step a periodic save already committed durably is skipped
# (nothing to write) and goes to no node memory, which these tests are about (1 in 20 before).
NO_PERIODIC_SAVE = ["--save-every", str(10**9)]


def test_a_suspend_goes_to_each_node_memory_the_restart_loads_it_there_and_the_agents_commit_it(
        live, daemon, reference):  # noqa: F811 - fixtures
    args = ["--nprocs", "1", "--steps", str(STEPS), "--step-sleep", "0.03", "--ballast-mb", "16", *NO_PERIODIC_SAVE]
    job, job_dir = submit(live, TRAIN, "-n", "4", "-p", "LOW", user=ALICE, args=args)
    wait_for("the job to train", lambda: last_step(job_dir) >= 20, 120, 0.2)
    live.run(["hai", "suspend", str(job)], user=ALICE)
    suspended = wait_for("the suspend", lambda: named(job_dir, "suspended"), 60)
    assert suspended[0]["how"] == "go_suspend"
    (commit,) = [m for line in train_lines(job_dir) for m in [re.search(r"checkpoint step (\d+) committed .*"
                                                                         r"node memory", line)] if m]
    at = int(commit.group(1))

    # Each node kept its share in its own memory: the directory the launcher made there is
    # not on any other node.
    memory = {p.name: p.read_text() for p in (job_dir / "node-memory").iterdir()}
    assert sorted(memory) == ["n1", "n2", "n3", "n4"]
    for node, path in memory.items():
        assert live.on_node(node, ["test", "-d", f"{path}/parts/{step_dir_name(at)}"], check=False).returncode == 0
        other = "n2" if node == "n1" else "n1"
        assert live.on_node(other, ["test", "-e", path], check=False).returncode != 0

    # Bob hands n1's agent a request naming Alice's part: it runs as Bob, who cannot read it.
    # (The agent's log is the whole session's: read what it says from here on.)
    agent_log = live.state / "log" / "persist-n1.console"
    log_from = agent_log.stat().st_size
    bob_request = f"{DEFAULT_SPOOL}/{live.uid(BOB)}-{at:012d}-bob-0.json"
    live.on_node("n1", ["sh", "-c", f"echo '{{\"part\": \"{memory['n1']}/parts/{step_dir_name(at)}\"}}' > "
                        f"{bob_request}"], user=BOB)

    # The agents commit the durable copy, as Alice, private to her.
    ckpt = job_dir / "checkpoints"
    wait_for("the agents' durable commit", lambda: at in committed_steps(ckpt), 60)
    step_dir = ckpt / step_dir_name(at)
    assert verify_checkpoint(step_dir).ok
    alice = live.uid(ALICE)
    for path in [step_dir, *step_dir.rglob("*")]:
        st = os.lstat(path)
        assert st.st_uid == alice, path
        assert not stat.S_IMODE(st.st_mode) & 0o077, path
    assert not list(ckpt.glob(".persist-*")) and not list(ckpt.glob(".persisting-*"))

    def said_of_bobs() -> list[str]:
        with agent_log.open() as f:
            f.seek(log_from)
            return [line for line in f.read().splitlines() if f"{os.path.basename(bob_request)}: " in line]

    # It refuses the request (and says "gone" once Alice's memory copy is removed); nothing
    # of it is ever copied or committed.
    said = wait_for("the agent to try Bob's request", said_of_bobs, 30)
    assert "permission denied" in said[0], said
    assert not [line for line in said if "copied" in line or "committed" in line], said

    # The restart landed on the same nodes (the job holds all four) and loaded from memory.
    wait_for("the restart", lambda: resumed_from(job_dir), 90)
    assert resumed_from(job_dir) == [at]
    assert any(f"resumed from step {at}" in line and "from node memory" in line for line in train_lines(job_dir))
    final = wait_final(job_dir, 180)
    assert final["state"] == "succeeded"
    assert same_weights(job_dir / "final-weights.safetensors", reference), "resumed weights differ"
    # The job is done: each node's agent removes its memory directory (it held a part).
    wait_for("the agents to remove the job's node memory", lambda: all(
        live.on_node(node, ["test", "-e", path], check=False).returncode != 0 for node, path in memory.items()), 60)


def test_a_node_lost_after_go_suspend_before_the_durable_commit_resumes_through_its_peer_copy(
        live, daemon, reference):  # noqa: F811 - fixtures
    """n2 is lost after go_suspend(), its share of the suspend checkpoint still only in memory
    (its agent and that of n3, which holds n2's peer copy, were stopped). Once n3's agent
    runs again, it persists n3's share and n2's from the peer copy, and the checkpoint is
    committed without n2. The restart (n2 back, its memory empty) waits for that commit and
    resumes from the suspend step, bitwise."""
    args = ["--nprocs", "1", "--steps", str(STEPS), "--step-sleep", "0.03", *NO_PERIODIC_SAVE]
    job, job_dir = submit(live, TRAIN, "-n", "4", "-p", "LOW", user=ALICE, args=args)
    wait_for("the job to train", lambda: last_step(job_dir) >= 20, 120, 0.2)
    agents = {node: int((live.state / "run" / f"persist-{node}.pid").read_text().split()[0]) for node in ("n2", "n3")}
    for pid in agents.values():
        os.kill(pid, signal.SIGSTOP)
    # n2 drains: the requeued job cannot start again before n2 was lost and came back
    live.run(["scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=test: n2 is about to be lost"])
    try:
        live.run(["hai", "suspend", str(job)], user=ALICE)
        wait_for("the suspend", lambda: named(job_dir, "suspended"), 60)
        (commit,) = [m for line in train_lines(job_dir)
                     for m in [re.search(r"checkpoint step (\d+) committed .*node memory", line)] if m]
        at = int(commit.group(1))
        ckpt = job_dir / "checkpoints"
        live.lose_node("n2")  # its memory, its stopped agent and its requests are gone
        assert at not in committed_steps(ckpt)
        os.kill(agents["n3"], signal.SIGCONT)
        wait_for("n3's agent to commit with n2's share from its peer copy", lambda: at in committed_steps(ckpt), 60)
        assert verify_checkpoint(ckpt / step_dir_name(at)).ok
        live.node_up("n2")
    finally:
        for pid in agents.values():
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if live.slurmd_pid("n2") is None:
            live.node_up("n2")
        live.run(["scontrol", "update", "NodeName=n2", "State=RESUME"], check=False)
    final = wait_final(job_dir, 240)
    assert final["state"] == "succeeded"
    assert resumed_from(job_dir) == [at]
    assert any(f"resumed from step {at}" in line and "from node memory" not in line for line in train_lines(job_dir))
    assert same_weights(job_dir / "final-weights.safetensors", reference), "resumed weights differ"


def test_the_agents_remove_the_node_memory_of_a_job_that_is_over_and_keep_a_running_ones(
        live, daemon):  # noqa: F811 - fixtures
    """A job cancelled after a suspend left its memory on its nodes (the launcher removes it
    only when the job ends with exit 0): the nodes' agents remove it once Slurm says the job
    ended, and leave the memory of a job still running alone."""
    args = ["--nprocs", "1", "--steps", "100000", "--step-sleep", "0.05", *NO_PERIODIC_SAVE]
    over, over_dir = submit(live, TRAIN, "-n", "2", "-p", "LOW", user=ALICE, args=args)
    running, running_dir = submit(live, TRAIN, "-n", "2", "-p", "LOW", user=BOB, args=args)
    for job_dir in (over_dir, running_dir):
        wait_for("the jobs to train", lambda: last_step(job_dir) >= 5, 120, 0.2)
    live.run(["hai", "suspend", str(over)], user=ALICE)
    wait_for("the suspend", lambda: named(over_dir, "suspended"), 60)
    (commit,) = [m for line in train_lines(over_dir)
                 for m in [re.search(r"checkpoint step (\d+) committed .*node memory", line)] if m]
    at = int(commit.group(1))
    wait_for("the agents' durable commit", lambda: at in committed_steps(over_dir / "checkpoints"), 60)

    def memory(job_dir):
        return {p.name: p.read_text() for p in (job_dir / "node-memory").iterdir()}

    def left(where):
        return [node for node, path in where.items()
                if live.on_node(node, ["test", "-e", path], check=False).returncode == 0]

    mine, theirs = memory(over_dir), memory(running_dir)
    assert len(left(mine)) == 2 and len(left(theirs)) == 2
    live.run(["scancel", str(over)])
    wait_for("the agents to remove the ended job's node memory", lambda: not left(mine), 60)
    assert len(left(theirs)) == 2 and last_step(running_dir) > 5  # still running, still there
    live.run(["scancel", str(running)])
    wait_for("the agents to remove the second job's node memory", lambda: not left(theirs), 60)
