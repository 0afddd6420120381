"""Typed Slurm operations -> the commands that make them, and the commands' text read back
(slurm_hai/slurm/commands.py), and the CLI backend running them (Slurm faked on PATH)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_hai.policy.ladder import Change, ClusterState, offline_access_changes, plan_changes
from slurm_hai.policy.model import load_policy, parse_policy
from slurm_hai.slurm import SlurmError
from slurm_hai.slurm.base import NodeInfo
from slurm_hai.slurm.cli import CliBackend
from slurm_hai.slurm.commands import (ASSOC_FIELDS, QOS_FIELDS, change_argv, last_run_ends, nodes_from_text,
                                      parsable_rows, run_ends_argv, show_argv, step_argv)

REPO = Path(__file__).resolve().parents[2]
LOCAL = load_policy(REPO / "contrib" / "localcluster" / "policy.toml")


@pytest.mark.parametrize("change,argv", [
    # the QOS ladder
    (Change("add", "qos", name="normal.u.hai-bob"), "sacctmgr -i add qos normal.u.hai-bob"),
    (Change("modify", "qos", where={"name": "low"}, settings={"Preempt": "", "MaxTRESPU": "node=-1", "Flags": "-1"}),
     "sacctmgr -i modify qos where name=low set Preempt= MaxTRESPU=node=-1 Flags=-1"),
    (Change("delete", "qos", where={"name": "high.u.bob"}), "sacctmgr -i delete qos where name=high.u.bob"),
    # QOS access of associations (hai-admin apply) and of whole accounts (hai-admin render)
    (Change("modify", "user", where={"cluster": "hai", "account": "hai", "name": "bob", "partition": "gpu"},
            settings={"qos": "high,low", "defaultqos": "low"}),
     "sacctmgr -i modify user where cluster=hai account=hai name=bob partition=gpu set qos=high,low defaultqos=low"),
    (Change("modify", "account", where={"cluster": "hai", "name": "hai"}, settings={"qos": "low", "defaultqos": "low"}),
     "sacctmgr -i modify account where cluster=hai name=hai set qos=low defaultqos=low"),
    (Change("modify", "user", where={"account": "hai"}, settings={"qos": "low", "defaultqos": "low"}),
     "sacctmgr -i modify user where account=hai set qos=low defaultqos=low"),
    # node groups
    (Change("create", "partition", name="cpu", settings={"Nodes": "c[1-2]", "State": "UP"}),
     "scontrol create PartitionName=cpu Nodes=c[1-2] State=UP"),
    (Change("update", "partition", name="gpu", settings={"AllowQos": "high,low"}),
     "scontrol update PartitionName=gpu AllowQos=high,low"),
    # what the local cluster adds for its tests
    (Change("add", "cluster", name="hai"), "sacctmgr -i add cluster hai"),
    (Change("add", "account", name="hai", settings={"cluster": "hai", "description": "slurm-hai"}),
     "sacctmgr -i add account hai cluster=hai description=slurm-hai"),
    (Change("add", "user", name="bob", settings={"account": "hai", "cluster": "hai", "defaultaccount": "hai"}),
     "sacctmgr -i add user bob account=hai cluster=hai defaultaccount=hai"),
])
def test_each_change_is_one_command(change, argv):
    assert change_argv(change) == argv.split()


@pytest.mark.parametrize("change,refusal", [
    (Change("create", "qos", name="x"), "no Slurm command to create a qos"),
    (Change("add", "partition", name="x"), "no Slurm command to add a partition"),
    (Change("modify", "user", settings={"qos": "low"}), "without `where` would change every user"),
    (Change("delete", "qos"), "without `where`"),
    (Change("modify", "qos", where={"name": "low"}), "nothing to set"),
    (Change("add", "qos"), "needs a name"),
    (Change("update", "partition", name="a b", settings={"State": "UP"}), "needs a name"),
    (Change("modify", "qos", where={"name": "low"}, settings={"Priority": "1 Preempt=x"}), "not a Slurm setting"),
    (Change("modify", "qos", where={"name low": "x"}, settings={"Priority": "1"}), "not a Slurm setting"),
])
def test_a_change_slurm_cannot_take_is_refused(change, refusal):
    with pytest.raises(ValueError, match=refusal):
        change_argv(change)


def test_every_change_the_planner_makes_renders():
    """Each op/entity plan_changes and offline_access_changes produce, over a new and a
    drifted cluster, is one sacctmgr or scontrol command."""
    p = parse_policy({"groups": {"gpu": {"nodes": "n[1-4]", "levels": ["HIGH", "LOW"]}, "cpu": {"nodes": "c1"}},
                      "quota": {"users": {"ann": {"HIGH": 1}}}, "accounts": ["hai"]})
    assocs = [{"Cluster": "hai", "Account": "hai", "User": u, "Partition": "", "QOS": "normal", "DefaultQOS": ""}
              for u in ("", "ann")]
    states = [ClusterState(partitions={}),
              ClusterState(qos={"high.u.gone": {"name": "high.u.gone"}}, assocs=assocs,
                           partitions={"gpu": {"PartitionName": "gpu", "PriorityTier": "9", "Nodes": "n1"}},
                           nodes={"n1": frozenset({"n1"}), "n[1-4]": frozenset({"n1", "n2", "n3", "n4"})})]
    changes = [c for s in states for c in plan_changes(p, s)] + offline_access_changes(p) + offline_access_changes(LOCAL)
    kinds = {(c.op, c.entity) for c in changes}
    assert kinds == {("add", "qos"), ("modify", "qos"), ("delete", "qos"), ("modify", "user"), ("modify", "account"),
                     ("create", "partition"), ("update", "partition")}
    for c in changes:
        argv = change_argv(c)
        assert argv[:3] in (["sacctmgr", "-i", c.op], ["scontrol", c.op, f"PartitionName={c.name}"])


def test_sacctmgr_rows_are_read_by_field():
    assert show_argv("assoc", ASSOC_FIELDS)[-1] == "format=Cluster,Account,User,Partition,QOS,DefaultQOS"
    text = "hai|hai|||low,normal|normal\nhai|hai|bob||low|low\n\n"
    rows = parsable_rows(text, ASSOC_FIELDS)
    assert rows[1] == {"Cluster": "hai", "Account": "hai", "User": "bob", "Partition": "", "QOS": "low",
                       "DefaultQOS": "low"}
    assert len(rows) == 2


def test_nodes_count_every_gpu_gres_and_know_their_partitions():
    text = ("NodeName=n1 Arch=x86_64 NodeAddr=10.0.0.1 Gres=gpu:a100:4(S:0-1),gpu:v100:2 Partitions=gpu,all\n"
            "NodeName=c1 NodeAddr=c1 Gres=(null) Partitions=cpu State=IDLE\n"
            "NodeName=n2 Gres=gpu:8 Partitions=\n"
            "not a node line\n")
    assert nodes_from_text(text) == [NodeInfo("n1", 6, frozenset({"gpu", "all"}), "10.0.0.1"),
                                     NodeInfo("c1", 0, frozenset({"cpu"}), "c1"),
                                     NodeInfo("n2", 8, frozenset(), "")]


def test_the_job_step_runs_one_task_per_node():
    assert step_argv(["python", "-m", "x", "--", "a b"], 2, 4, "train") == [
        "srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--unbuffered", "--job-name=train",
        "--gres=gpu:4", "python", "-m", "x", "--", "a b"]
    assert "--gres" not in " ".join(step_argv(["true"], "1"))


# ------------------------------------------------------------------ the CLI backend, Slurm faked


def fake_commands(tmp_path: Path, monkeypatch, **bodies: str) -> Path:
    """Commands on PATH that log their argv (one line each) to tmp_path/calls and run `body`."""
    calls = tmp_path / "calls"
    for name, body in bodies.items():
        (tmp_path / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n{body}\n')
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    return calls


def test_apply_runs_the_rendered_command(tmp_path, monkeypatch):
    calls = fake_commands(tmp_path, monkeypatch, sacctmgr="true", scontrol="true")
    CliBackend().apply(Change("modify", "qos", where={"name": "low"}, settings={"GraceTime": "5"}))
    CliBackend().apply(Change("update", "partition", name="gpu", settings={"Default": "YES"}))
    assert calls.read_text().splitlines() == ["sacctmgr -i modify qos where name=low set GraceTime=5",
                                              "scontrol update PartitionName=gpu Default=YES"]


def test_a_failed_change_names_its_command(tmp_path, monkeypatch):
    fake_commands(tmp_path, monkeypatch, sacctmgr="echo ' Unknown option: GraceTme=5' >&2; exit 1")
    with pytest.raises(SlurmError) as e:
        CliBackend().apply(Change("modify", "qos", where={"name": "low"}, settings={"GraceTme": "5"}))
    assert str(e.value) == ("sacctmgr: Unknown option: GraceTme=5 "
                            "(while: sacctmgr -i modify qos where name=low set GraceTme=5)")


def test_typed_reads_ask_sacctmgr_for_their_fields(tmp_path, monkeypatch):
    calls = fake_commands(tmp_path, monkeypatch, sacctmgr="echo 'low|1||00:00:05|requeue|||DenyOnLimit'")
    (row,) = CliBackend().qos()
    assert row == dict(zip(QOS_FIELDS, ["low", "1", "", "00:00:05", "requeue", "", "", "DenyOnLimit"]))
    assert calls.read_text().split() == ["sacctmgr", *show_argv("qos", QOS_FIELDS)[1:]]


def test_nodes_and_node_addr_read_scontrol(tmp_path, monkeypatch):
    fake_commands(tmp_path, monkeypatch, scontrol="echo 'NodeName=n1 NodeAddr=127.0.0.1 Gres=gpu:8 Partitions=gpu'")
    assert CliBackend().nodes() == [NodeInfo("n1", 8, frozenset({"gpu"}), "127.0.0.1")]
    assert CliBackend().node_addr("n1") == "127.0.0.1"


def test_run_step_waits_for_srun_and_gives_its_status(tmp_path, monkeypatch):
    calls = fake_commands(tmp_path, monkeypatch, srun="exit 3")
    assert CliBackend().run_step(["python", "-m", "x"], "2", 0, "job") == 3
    assert calls.read_text().split() == step_argv(["python", "-m", "x"], "2", 0, "job")


def test_run_step_calls_its_watch_while_the_step_runs(tmp_path, monkeypatch):
    fake_commands(tmp_path, monkeypatch, srun=f"while [ ! -e {tmp_path}/go ]; do sleep 0.05; done; exit 4")
    seen: list[int] = []

    def watch() -> None:
        seen.append(1)
        if len(seen) == 3:
            (tmp_path / "go").touch()  # the step ends once watched three times

    assert CliBackend().run_step(["x"], 2, watch=watch) == 4
    assert len(seen) >= 3, seen


def test_how_the_last_run_of_a_requeued_job_ended_is_read_from_its_accounting_rows():
    rows = "\n".join(["11|NODE_FAIL", "11|PENDING",  # requeued by a node failure, waits
                      "12|REQUEUED", "12|REQUEUED", "12|RUNNING", "12|PENDING",  # run 2 not recorded as ended yet
                      "13|PREEMPTED", "13|CANCELLED by 0",  # its newest run ended: cancelled
                      "14|PENDING", "x|y", ""])
    assert last_run_ends(rows) == {11: "NODE_FAIL", 13: "CANCELLED"}
    assert run_ends_argv([11, 12])[-1] == "--jobs=11,12"
