"""The local cluster's nodes keep their memory to themselves, as real nodes do (issue 12):
each slurmd runs in its own mount namespace with a private /dev/shm and /tmp, which its jobs
inherit. A file written there on one node is not seen on another, nor on the host; a slurmd
restart keeps it; losing the node (every process on it killed) loses it."""

from __future__ import annotations

import os
import re
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


def host_has_cgroup_v1() -> bool:
    v1 = {line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines() if line.split()[2] == "cgroup"}
    return all(f"/sys/fs/cgroup/{c}" in v1 for c in ("freezer", "cpuset", "memory", "devices"))


def test_a_job_is_tracked_and_constrained_by_its_cgroup_on_its_own_node(live):
    """As on a site's nodes (issue 53): where the host mounts cgroup v1, the local cluster
    tracks jobs by cgroup; a step is in its job's cgroup under its node's own, may open the GPU
    devices it was given and no other, and its memory limit is its allocation."""
    assert live.tracks_by_cgroup == host_has_cgroup_v1()
    if not live.tracks_by_cgroup:
        return
    gpus = sorted((live.state / "gpu").glob("nvidia*"))
    assert len(gpus) == 8 and all(g.is_char_device() for g in gpus)
    script = ("cat /proc/self/cgroup; echo CUDA=$CUDA_VISIBLE_DEVICES; "
              "for g in " + " ".join(map(str, gpus[:3])) + "; do "
              """python3 -c 'import os, sys
try: os.open(sys.argv[1], os.O_RDONLY)
except OSError as e: print("open", sys.argv[1], e.strerror)' $g; done; """
              # the job's memory cgroup, seen from the node's root
              r"cat /sys/fs/cgroup/memory$(sed -n 's,^[0-9]*:memory:\(.*/job_[0-9]*\)/.*,\1,p' /proc/self/cgroup)"
              "/memory.limit_in_bytes")
    uid = live.uid("hai-alice")
    out = live.run(["srun", "-N1", "-w", "n3", "--gres=gpu:2", "--mem=300", "sh", "-c", script], user="hai-alice",
                   timeout=120).stdout
    # inside the node's cgroup namespace the job's cgroup is seen from the node's root
    freezer = re.search(r"^\d+:freezer:(\S+)$", out, re.M)[1]
    assert re.fullmatch(rf"/slurm_n3/uid_{uid}/job_\d+/step_\d+", freezer), out
    given = [int(i) for i in re.search(r"^CUDA=(\S+)$", out, re.M)[1].split(",")]
    assert given == [0, 1], out
    for i, gpu in enumerate(gpus[:3]):  # no driver behind them: a device it may open says ENXIO
        want = "No such device or address" if i in given else "Operation not permitted"
        assert f"open {gpu} {want}" in out, out
    assert out.splitlines()[-1] == str(300 * 2**20), out  # its job's memory limit: what it asked
