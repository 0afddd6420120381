"""The local cluster's nodes keep their memory to themselves, as real nodes do (issue 12):
each slurmd runs in its own mount namespace with a private /dev/shm and /tmp, which its jobs
inherit. A file written there on one node is not seen on another, nor on the host; a slurmd
restart keeps it; losing the node (every process on it killed) loses it."""

from __future__ import annotations

import os
from pathlib import Path

from waiting import wait_for


def srun(live, node: str, script: str, check: bool = True):
    return live.run(["srun", "-N1", "-w", node, "sh", "-c", script], check=check, timeout=120)


def test_a_node_s_dev_shm_and_tmp_are_its_own_survive_a_slurmd_restart_and_die_with_the_node(live):
    name = f"hai-local-{live.state.name}-{os.getpid()}"
    files = [f"/dev/shm/{name}", f"/tmp/{name}"]
    srun(live, "n1", " && ".join(f"echo n1 > {f}" for f in files))
    assert srun(live, "n1", f"cat {' '.join(files)}").stdout.split() == ["n1", "n1"]
    for node in ("n2", "n3", "n4"):  # not on the other nodes
        p = srun(live, node, f"cat {files[0]} || cat {files[1]}", check=False)
        assert p.returncode != 0 and "n1" not in p.stdout, (node, p.stdout, p.stderr)
    assert not any(Path(f).exists() for f in files)  # nor on the host

    # a slurmd restart is not the node's loss: what is in its memory stays
    live.stop_slurmd("n1")
    live.node_up("n1")
    wait_for(lambda: live.in_service("n1"), 60, "n1 back in service")
    assert srun(live, "n1", f"cat {' '.join(files)}").stdout.split() == ["n1", "n1"]

    # losing the node: every process on it killed; started again, its memory is empty
    try:
        live.lose_node("n1")
        live.run(["scontrol", "update", "NodeName=n1", "State=DOWN", "Reason=test_local_nodes: node lost"])
    finally:  # never leave the cluster with a node down
        live.node_up("n1")
        live.run(["scontrol", "update", "NodeName=n1", "State=RESUME"], check=False)
    wait_for(lambda: live.in_service("n1"), 60, "n1 back in service")
    p = srun(live, "n1", f"ls {' '.join(files)}", check=False)
    assert p.returncode != 0 and "No such file" in p.stderr, (p.stdout, p.stderr)
