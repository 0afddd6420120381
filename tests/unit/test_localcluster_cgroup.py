"""How a local cluster's nodes track jobs (contrib/localcluster, issue 53): chosen when a state
directory is first set up and kept by it; the cgroup layout's node processes start in the
node's cgroups and a cgroup namespace rooted there. (Live: tests/cluster/test_local_nodes.py.)"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "contrib" / "localcluster"))
import localcluster  # noqa: E402


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("HAI_CLUSTER_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(localcluster, "host_has_cgroup_v1", lambda: True)
    return localcluster.cluster_from_env()


def test_a_new_directory_tracks_by_cgroup_unless_asked_and_keeps_what_it_chose(fresh, monkeypatch, tmp_path):
    localcluster.choose_proctrack(fresh, linuxproc=False)
    assert fresh.cgroup and localcluster.cluster_from_env().cgroup
    localcluster.choose_proctrack(fresh, linuxproc=False)  # kept
    with pytest.raises(localcluster.ClusterError, match="tracks jobs by cgroup; for linuxproc use another"):
        localcluster.choose_proctrack(fresh, linuxproc=True)

    monkeypatch.setenv("HAI_CLUSTER_DIR", str(tmp_path / "other"))
    other = localcluster.cluster_from_env()
    localcluster.choose_proctrack(other, linuxproc=True)
    assert not other.cgroup and not localcluster.cluster_from_env().cgroup


def test_a_directory_set_up_before_the_layout_and_a_host_without_v1_track_by_linuxproc(fresh, monkeypatch, tmp_path,
                                                                                         capsys):
    fresh.prefix_file.parent.mkdir(parents=True)
    fresh.prefix_file.write_text("\n")  # up ran here before etc/proctrack existed
    localcluster.choose_proctrack(fresh, linuxproc=False)
    assert not fresh.cgroup and fresh.proctrack_file.read_text() == "linuxproc\n"

    monkeypatch.setenv("HAI_CLUSTER_DIR", str(tmp_path / "v2"))
    monkeypatch.setattr(localcluster, "host_has_cgroup_v1", lambda: False)
    v2 = localcluster.cluster_from_env()
    localcluster.choose_proctrack(v2, linuxproc=False)
    assert not v2.cgroup and "cgroup v2 alone" in capsys.readouterr().out


def test_a_node_of_the_cgroup_layout_mounts_its_own_hierarchies_and_whatever_enters_it_joins_them(fresh):
    fresh.cgroup = True
    node = fresh.nodes[1]
    holder = localcluster.holder_argv(fresh, node, Path("/run/x.pid"))
    assert "--cgroup" in holder
    script = holder[holder.index("-c") + 1]
    for ctrl in localcluster.CGROUP_CONTROLLERS:  # each hierarchy again, rooted at the namespace's root
        assert f"umount /sys/fs/cgroup/{ctrl} && mount -t cgroup -o {ctrl} cgroup /sys/fs/cgroup/{ctrl}" in script
    assert script.index("mount -t cgroup") < script.index("exec sleep infinity")
    enter = localcluster.node_enter(fresh, 42)
    assert enter[:4] == ["nsenter", "--target=42", "--mount", "--cgroup"] and localcluster.JOIN_CGROUPS in enter
    assert [p.parts[-3:] for p in fresh.node_cgroups(node.name)] == [
        (ctrl, f"hai-{fresh.port_base}", node.name) for ctrl in localcluster.CGROUP_CONTROLLERS]

    fresh.cgroup = False  # the linuxproc layout: a mount namespace only
    assert "--cgroup" not in localcluster.holder_argv(fresh, node, Path("/run/x.pid"))
    assert localcluster.node_enter(fresh, 42) == ["nsenter", "--target=42", "--mount", "--"]


def test_down_kills_what_the_nodes_cgroups_still_hold_and_removes_them(fresh, tmp_path, monkeypatch):
    # slurmstepd and its job outlive a stopped slurmd; the nodes' cgroups still hold them
    import subprocess

    monkeypatch.setattr(localcluster, "CGROUP_ROOT", tmp_path / "cgroup")
    left = subprocess.Popen(["sleep", "300"])
    step = tmp_path / "cgroup" / "freezer" / f"hai-{fresh.port_base}" / "n1" / "slurm_n1" / "uid_0" / "job_7"
    step.mkdir(parents=True)
    (step / "cgroup.procs").write_text(f"{left.pid}\n")
    assert localcluster.kill_cgroups(fresh) == 1
    assert left.wait(10) == -9
    (step / "cgroup.procs").unlink()  # the kernel's files go with the directory; here, by hand
    assert localcluster.remove_cgroups(fresh) == [] and not (tmp_path / "cgroup" / "freezer" / f"hai-{fresh.port_base}").exists()
