"""The persist agent against a hostile user, live: Bob (an unprivileged user) fills the spool
of the node where Alice's job runs with requests meant to hang or fool the root agent (four
naming memory parts whose part.json is a FIFO: before, each held one of the agent's four
children forever; one that is a link to /etc/shadow; one far over the size of a request).
Each is refused in one line and set aside, Alice's suspend save on that node is persisted
as soon as she suspends, and nothing of Bob's is left running on the node."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from test_acceptance import ALICE, BOB, TRAIN, committed_steps, daemon, last_step, named, submit, train_lines, wait_for  # noqa: F401

from slurm_hai.checkpoint.memory import DEFAULT_SPOOL

pytestmark = pytest.mark.cluster

FIFOS = 4  # the agent's MAX_CHILDREN before


def bobs_processes_on(live, node: str) -> list[str]:
    """Bob's processes in `node`'s mount namespace (the local nodes share this host's pids)."""
    bob, ns = live.uid(BOB), os.readlink(f"/proc/{live.node_pid(node)}/ns/mnt")
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and proc.stat().st_uid == bob and os.readlink(proc / "ns" / "mnt") == ns:
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue  # ended while we looked
    return found


def test_a_users_fifo_link_and_oversized_requests_are_refused_and_do_not_hold_another_users_save(
        live, daemon):  # noqa: F811 - fixture
    args = ["--nprocs", "1", "--steps", "100000", "--step-sleep", "0.05", "--save-every", str(10**9)]
    job, job_dir = submit(live, TRAIN, "-n", "1", "-p", "LOW", user=ALICE, args=args)
    wait_for("the job to train", lambda: last_step(job_dir) >= 5, 120, 0.2)
    (node,) = [p.name for p in (job_dir / "node-memory").iterdir()]
    agent_log = live.state / "log" / f"persist-{node}.console"
    log_from = agent_log.stat().st_size

    bob = live.uid(BOB)
    names = [f"{bob}-{job:012d}-{what}-0.json" for what in [*(f"fifo{k}" for k in range(FIFOS)), "link", "big"]]
    script = "set -e; d=$(mktemp -d /dev/shm/bob-XXXXXX)\n"
    for k, name in enumerate(names[:FIFOS]):
        script += (f"mkdir $d/{k} && mkfifo $d/{k}/part.json && "
                   f"printf '{{\"part\": \"%s\"}}' $d/{k} > {DEFAULT_SPOOL}/.{name} && "
                   f"mv {DEFAULT_SPOOL}/.{name} {DEFAULT_SPOOL}/{name}\n")
    script += f"ln -s /etc/shadow {DEFAULT_SPOOL}/{names[FIFOS]}\n"
    script += f"head -c 1000000 /dev/zero > {DEFAULT_SPOOL}/{names[FIFOS + 1]}\n"
    live.on_node(node, ["sh", "-c", script], user=BOB)

    def said() -> dict[str, list[str]]:
        with agent_log.open() as f:
            f.seek(log_from)
            lines = f.read().splitlines()
        return {name: [line for line in lines if name in line] for name in names}

    def all_set_aside() -> bool:
        return all(live.on_node(node, ["test", "-e", f"{DEFAULT_SPOOL}/failed-{name}"], check=False).returncode == 0
                   for name in names)

    wait_for("the agent to set Bob's requests aside", all_set_aside, 60)
    lines = said()
    for name in names:
        assert len(lines[name]) == 1 and "refused" in lines[name][0], (name, lines[name])
    assert "FIFO" in lines[names[0]][0] and "a symbolic link" in lines[names[FIFOS]][0]
    assert "1000000 bytes" in lines[names[FIFOS + 1]][0]

    # Alice suspends: her node's share reaches the durable directory through the same agent.
    live.run(["hai", "suspend", str(job)], user=ALICE)
    wait_for("the suspend", lambda: named(job_dir, "suspended"), 60)
    (commit,) = [m for line in train_lines(job_dir) for m in [re.search(r"checkpoint step (\d+) committed .*"
                                                                         r"node memory", line)] if m]
    at = int(commit.group(1))
    wait_for("the agent's durable commit of Alice's save", lambda: at in committed_steps(job_dir / "checkpoints"), 60)
    wait_for("Bob's processes on the node to end", lambda: not bobs_processes_on(live, node), 30)
    live.run(["scancel", str(job)])
