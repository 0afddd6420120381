"""The job's checkpoint directory fills up (issue 18): a 5 MiB file system, mounted on every
node for the test, holds two of the job's checkpoints and not a third. The failing save says
so in one line in the job's log and training goes on; the checkpoints that committed stay
and verify; a suspend goes to node memory, and the restart resumes from it; the persist
agent, which cannot copy it to the full disk, says why and never commits a part of it."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
from test_acceptance import (ALICE, TRAIN, daemon, last_step, named, resumed_from, submit,  # noqa: F401
                             train_lines, wait_final, wait_for)

pytestmark = pytest.mark.cluster

NODES = ("n1", "n2", "n3", "n4")


def test_a_full_checkpoint_disk_fails_saves_in_one_line_keeps_the_good_checkpoints_and_the_job_goes_on(
        live, daemon):  # noqa: F811 - fixture
    small = f"/mnt/hai-full-{os.getpid()}"
    os.makedirs(small, exist_ok=True)  # on the host's file system: every node sees the mount point
    for node in NODES:
        live.on_node(node, ["mount", "-t", "tmpfs", "-o", "size=5m,mode=1777", "tmpfs", small])
    drained: list[str] = []
    agent_logs = {node: live.state / "log" / f"persist-{node}.console" for node in NODES}
    logged = {node: path.stat().st_size for node, path in agent_logs.items()}  # what earlier tests left
    try:
        ckpt = f"{small}/ckpt"
        args = ["--nprocs", "1", "--steps", "300", "--step-sleep", "0.03", "--ballast-mb", "2",
                "--save-every", "20", "--ckpt-dir", ckpt]
        job, job_dir = submit(live, TRAIN, "-n", "1", "-p", "LOW", user=ALICE, args=args)

        def failed() -> list[str]:
            return [line for line in train_lines(job_dir) if "checkpoint failed" in line]

        wait_for("a periodic save to fail", failed, 120, 0.2)
        line = failed()[0]
        assert "no space left" in line and "Traceback" not in "\n".join(train_lines(job_dir)), line
        at_failure = last_step(job_dir)
        wait_for("training to go on", lambda: last_step(job_dir) >= at_failure + 30, 60, 0.2)

        # Only the job's node takes jobs: the restart lands where its suspend checkpoint is.
        (node,) = [p.name for p in (job_dir / "node-memory").iterdir()]
        drained = [n for n in NODES if n != node]
        live.run(["scontrol", "update", f"NodeName={','.join(drained)}", "State=DRAIN", "Reason=test: full disk"])
        live.run(["hai", "suspend", str(job)], user=ALICE)
        wait_for("the suspend", lambda: named(job_dir, "suspended"), 60)
        (commit,) = [m for line in train_lines(job_dir)
                     for m in [re.search(r"checkpoint step (\d+) committed .*node memory", line)] if m]
        at = int(commit.group(1))
        wait_for("the restart", lambda: resumed_from(job_dir), 90)
        assert resumed_from(job_dir) == [at]
        assert any(f"resumed from step {at}" in line and "from node memory" in line for line in train_lines(job_dir))
        assert wait_final(job_dir, 180)["state"] == "succeeded"

        # The agent could not copy the suspend checkpoint to the full disk: it says why, and
        # nothing of that step is in the checkpoint directory.
        def agent_said() -> str:
            with open(agent_logs[node]) as f:
                f.seek(logged[node])
                return f.read()

        wait_for("the agent to try", lambda: f"-{at:012d}-" in agent_said(), 30)
        assert "no space left" in agent_said().split(f"-{at:012d}-", 1)[1].splitlines()[0]
        listing = live.on_node(node, [f"{sys.prefix}/bin/hai", "ckpt", "ls", "--json", ckpt]).stdout
        steps = sorted(c["step"] for c in json.loads(listing)["checkpoints"])
        assert steps == [20, 40], listing  # the two that fit, whole
        verified = live.on_node(node, [f"{sys.prefix}/bin/hai", "ckpt", "verify", ckpt], check=False)
        assert verified.returncode == 0, verified.stdout + verified.stderr
    finally:
        if drained:
            live.run(["scontrol", "update", f"NodeName={','.join(drained)}", "State=RESUME"], check=False)
        for node in NODES:
            live.on_node(node, ["umount", small], check=False)
        os.rmdir(small)
