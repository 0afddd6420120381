"""Which Slurm a local cluster's state directory accepts at `up` (contrib/localcluster):
the Slurm it was set up with, or the same build found under another cache; never another."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "contrib" / "localcluster"))
import localcluster  # noqa: E402


def fake_build(cache: Path, name: str, version: str = "25.11.7") -> Path:
    """A prefix as slurm_build leaves it: sbin/slurmctld (here one that prints its version)
    and the .hai-built marker."""
    prefix = cache / name
    (prefix / "sbin").mkdir(parents=True)
    ctld = prefix / "sbin" / "slurmctld"
    ctld.write_text(f"#!/bin/sh\necho slurm {version}\n")
    ctld.chmod(0o755)
    (prefix / ".hai-built").write_text(f"{name}.tar.gz 0\n")
    return prefix


def state_set_up_with(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefix: Path) -> localcluster.Cluster:
    monkeypatch.setenv("HAI_CLUSTER_DIR", str(tmp_path / "state"))
    c = localcluster.cluster_from_env()
    c.prefix_file.parent.mkdir(parents=True)
    c.prefix_file.write_text(f"{prefix}\n")
    return localcluster.cluster_from_env()


def test_the_same_build_under_another_cache_is_taken(tmp_path, monkeypatch, capsys):
    recorded = tmp_path / "old-cache" / "slurm-25.11.7-479047d58717"  # that cache is gone
    moved = fake_build(tmp_path / "new-cache", "slurm-25.11.7-479047d58717")
    c = state_set_up_with(tmp_path, monkeypatch, recorded)
    localcluster.choose_slurm(c, None, str(moved))
    assert c.prefix == moved
    assert str(c.version).startswith("25.11")
    assert "the same Slurm build as before" in capsys.readouterr().out


@pytest.mark.parametrize("other", ["slurm-25.11.7-aaaaaaaaaaaa", "slurm-26.05.3-479047d58717"])
def test_another_build_is_refused(tmp_path, monkeypatch, other):
    recorded = fake_build(tmp_path / "cache", "slurm-25.11.7-479047d58717")
    c = state_set_up_with(tmp_path, monkeypatch, recorded)
    with pytest.raises(localcluster.ClusterError, match="use another HAI_CLUSTER_DIR"):
        localcluster.choose_slurm(c, None, str(fake_build(tmp_path / "cache2", other)))
    assert c.prefix == recorded


def test_a_site_install_of_the_same_name_is_not_taken_for_a_build(tmp_path, monkeypatch):
    """Only a finished slurm-hai build (its marker) can stand in: /opt/slurm and
    /usr/local/slurm share a name but need not be the same Slurm."""
    recorded = fake_build(tmp_path / "opt", "slurm")
    site = fake_build(tmp_path / "usr-local", "slurm")
    (site / ".hai-built").unlink()
    c = state_set_up_with(tmp_path, monkeypatch, recorded)
    with pytest.raises(localcluster.ClusterError):
        localcluster.choose_slurm(c, None, str(site))
