"""What hai-submit asks Slurm of the cluster, kept 10 s per user (jobs/clusterview.py): a
sweep of submissions asks once; a kept view never refuses; a dry run, another Slurm, an
edited slurm.conf, an old or a broken file asks again, the notice's signal only after an
hour or with another key; the CLI backend's commands are asked at once."""

from __future__ import annotations

import getpass
import json
import stat
import threading

import pytest
from click.testing import CliRunner

from slurm_hai.cli import submit as submit_cli
from slurm_hai.jobs import clusterview
from slurm_hai.slurm import SlurmError
from slurm_hai.slurm.commands import nodes_from_text


class Cluster:
    """Slurm's answers about the cluster, counted; sbatch takes every job."""

    name = "fake"

    def __init__(self) -> None:
        self.groups = ["gpu"]
        self.asked: list[str] = []
        self.submitted = 0

    def partitions(self):
        self.asked.append("partitions")
        return [{"PartitionName": g, "Default": "YES" if g == "gpu" else "NO"} for g in self.groups]

    def nodes(self):
        self.asked.append("nodes")
        return nodes_from_text("".join(f"NodeName=n{i} Gres=gpu:8 Partitions={','.join(self.groups)} State=IDLE\n"
                                       for i in (1, 2)))

    def preempt_sends_user_signal(self):
        self.asked.append("signal")
        return True

    def jobs(self, job_ids=(), user=None):
        return []

    def submit(self, script, args=()):
        self.submitted += 1
        return 100 + self.submitted


@pytest.fixture
def cluster(monkeypatch, tmp_path):
    slurm = Cluster()
    monkeypatch.setattr(submit_cli, "backend", lambda: slurm)
    monkeypatch.setenv("HAI_HOME", str(tmp_path / "hai"))
    monkeypatch.delenv("SLURM_CONF", raising=False)
    (tmp_path / "policy.toml").write_text("")
    monkeypatch.setenv("HAI_POLICY", str(tmp_path / "policy.toml"))
    (tmp_path / "train.py").write_text("print(1)\n")
    monkeypatch.chdir(tmp_path)
    return slurm


def submit(*argv: str) -> str:
    r = CliRunner().invoke(submit_cli.main, [*argv, "train.py"])
    assert r.exit_code == 0, r.output
    return r.output


def view_file(tmp_path):
    (path,) = (tmp_path / "hai").glob("cluster-view.*.json")
    return path


def test_a_sweep_asks_slurm_about_the_cluster_once_and_keeps_the_answer_private(cluster, tmp_path):
    for _ in range(3):
        submit("-p", "LOW")
    assert cluster.asked == ["partitions", "nodes", "signal"] and cluster.submitted == 3
    assert stat.S_IMODE(view_file(tmp_path).stat().st_mode) == 0o600


def test_a_kept_view_never_refuses_a_group_slurm_has_now(cluster):
    submit("-p", "LOW")
    cluster.groups.append("new")
    out = submit("-p", "LOW", "-g", "new")  # not in the kept view: asked again, and found
    assert "Submitted job" in out and cluster.asked == ["partitions", "nodes", "signal", "partitions", "nodes"]
    submit("-p", "LOW", "-g", "new")  # what was asked again is kept
    assert cluster.asked == ["partitions", "nodes", "signal", "partitions", "nodes"]
    r = CliRunner().invoke(submit_cli.main, ["-p", "LOW", "-g", "nosuch", "train.py"])
    assert r.exit_code == 2 and "no such node group" in r.output


def test_an_old_view_another_slurm_an_edited_conf_or_a_broken_file_asks_again_and_a_dry_run_always_asks(cluster, tmp_path,
                                                                                      monkeypatch):
    submit("-p", "LOW")
    path = view_file(tmp_path)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "taken": data["taken"] - clusterview.VIEW_TTL_S}))
    submit("-p", "LOW")
    assert cluster.asked.count("partitions") == 2
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=other\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))  # another cluster
    submit("-p", "LOW")
    submit("-p", "LOW")
    assert cluster.asked.count("partitions") == 3
    conf.write_text("ClusterName=other\nPreemptParameters=send_user_signal\n")  # edited (then reconfigured)
    submit("-p", "LOW")
    assert cluster.asked.count("partitions") == 4
    for broken in ("{", json.dumps({**json.loads(path.read_text()), "gpus": {"gpu": ["8"]}})):
        path.write_text(broken)
        submit("-p", "LOW")
    assert cluster.asked.count("partitions") == 6 and json.loads(path.read_text())["gpus"] == {"gpu": [8, 8]}
    before = (path.read_text(), path.stat().st_mtime_ns)
    submit("--dry-run", "-p", "LOW")
    assert cluster.asked.count("partitions") == 7 and cluster.asked[-1] == "nodes"  # no notice asked in a dry run
    assert (path.read_text(), path.stat().st_mtime_ns) == before


def test_each_view_is_kept_for_a_share_of_the_ttl_of_its_own_so_users_do_not_ask_again_at_once(cluster, tmp_path):
    submit("-p", "LOW")
    path = view_file(tmp_path)
    data = json.loads(path.read_text())
    low, high = (clusterview.VIEW_TTL_S * share for share in clusterview.FRESH_SHARE)
    assert low <= data["fresh_s"] <= high < clusterview.VIEW_TTL_S + 1e-9
    shares = set()
    for _ in range(5):  # views asked at one moment (by five users) run out at different ones
        path.unlink()
        submit("-p", "LOW")
        shares.add(json.loads(path.read_text())["fresh_s"])
    assert len(shares) == 5
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "fresh_s": 1.0, "taken": data["taken"] - 2.0}))  # past its own share
    asked = len(cluster.asked)
    submit("-p", "LOW")
    assert cluster.asked[asked:] == ["partitions", "nodes"]
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "fresh_s": 1e9, "taken": data["taken"] - clusterview.VIEW_TTL_S}))  # at most the TTL
    submit("-p", "LOW")
    assert cluster.asked[-2:] == ["partitions", "nodes"] and len(cluster.asked) == asked + 4


def test_an_old_view_asks_again_without_the_notice_signal_until_an_hour_has_passed(cluster, tmp_path):
    submit("-p", "LOW")
    path = view_file(tmp_path)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "taken": data["taken"] - clusterview.VIEW_TTL_S}))
    submit("-p", "LOW")
    assert cluster.asked == ["partitions", "nodes", "signal", "partitions", "nodes"]
    data = json.loads(path.read_text())
    assert data["signal_taken"] < data["taken"] and data["user_signal"] is True
    path.write_text(json.dumps({**data, "taken": data["taken"] - clusterview.VIEW_TTL_S,
                                "signal_taken": data["signal_taken"] - clusterview.SIGNAL_TTL_S}))
    submit("-p", "LOW")
    assert cluster.asked[-3:] == ["partitions", "nodes", "signal"]


class AtOnce:
    """A CLI backend's three answers, each given only once all three are being asked."""

    name = "cli"

    def __init__(self, failing: str = "") -> None:
        self.barrier = threading.Barrier(3, timeout=5)
        self.failing = failing

    def _answer(self, what: str, value):
        self.barrier.wait()  # BrokenBarrierError after 5 s when asked one after the other
        if what == self.failing:
            raise SlurmError(f"scontrol: {what} failed")
        return value

    def partitions(self):
        return self._answer("partitions", [{"PartitionName": "gpu", "Default": "YES"}])

    def nodes(self):
        return self._answer("nodes", nodes_from_text("NodeName=n1 Gres=gpu:8 Partitions=gpu State=IDLE\n"))

    def preempt_sends_user_signal(self):
        return self._answer("signal", False)


def test_the_cli_backends_commands_are_asked_at_once_and_one_that_fails_fails_the_view():
    threads = threading.active_count()
    view = clusterview.asked(AtOnce())
    assert view.partitions[0]["PartitionName"] == "gpu" and view.gpus == {"gpu": [8]} and view.user_signal is False
    assert threading.active_count() == threads  # every thread it started has ended
    with pytest.raises(SlurmError, match="nodes failed"):
        clusterview.asked(AtOnce(failing="nodes"))


def test_a_user_without_an_account_is_told_what_the_administrator_does(cluster, monkeypatch):
    def refused(script, args=()):
        raise SlurmError("sbatch: error: Batch job submission failed: Invalid account or account/partition "
                         "combination specified")

    monkeypatch.setattr(cluster, "submit", refused)
    r = CliRunner().invoke(submit_cli.main, ["-g", "gpu", "train.py"])
    me = getpass.getuser()
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output  # refused, as the policy's refusals are
    assert (f"Slurm's accounting has no account for {me} that may use node group gpu: an administrator adds one "
            f"(`sacctmgr add user {me} account=ACCOUNT`") in r.output
