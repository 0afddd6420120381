"""Adding slurm-hai to a cluster that has a configuration of its own, and taking it out
again (slurm_hai.policy.install): the site's QOS are changed only when adopted, apply never
deletes what it did not create, and removal after install gives back the cluster as it was.

The plans are applied to a ClusterState by `SlurmModel`, a model of what sacctmgr and
scontrol do with each change (the fields slurm-hai reads, as Slurm prints them); the live
test (tests/cluster/test_site_install.py) proves the same against real daemons.
"""

from __future__ import annotations

import copy
import re
import tomllib

import pytest

from slurm_hai.controller.apply import InstallError, apply_policy, load_record, remove_policy, save_record
from slurm_hai.policy.install import (InstallRecord, config_warnings, qos_conflicts, recorded, removal_changes)
from slurm_hai.policy.ladder import Change, ClusterState, plan_changes
from slurm_hai.policy.model import default_policy, parse_policy

STOCK_NORMAL = {"name": "normal", "priority": "0", "preempt": "", "gracetime": "00:00:00", "preemptmode": "cluster",
                "maxtrespu": "", "preemptexempttime": "", "flags": ""}
SITE_POLICY = """
default_level = "BRONZE"
accounts = ["lab"]
[levels]
GOLD = 30
SILVER = 10
BRONZE = 0
[quota]
SILVER = 2
[quota.accounts.lab]
GOLD = 1
[groups.hai]
nodes = "n[1-4]"
priority_tier = 2
default = false
"""


def policy_of(text: str):
    return parse_policy(tomllib.loads(text))


def _shown(key: str, value: str) -> str:
    """A value as `modify qos set` takes it -> as `show qos` prints it."""
    if value in ("", "-1", "node=-1"):
        return ""
    if key == "gracetime":
        s = int(value)
        return f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return value


class SlurmModel:
    """sacctmgr's and scontrol's effect of each Change on a ClusterState.

    Preempt lists as slurmdbd 22.05 keeps them (seen on the live cluster): a deleted QOS
    stays in the lists that name it, unseen in `show qos`; a list made empty is kept stale,
    and the loop check of a later Preempt change that reaches a stale or deleted QOS fails.
    """

    def __init__(self, state: ClusterState):
        self.state = state
        self.lists = {n: [x for x in q["preempt"].split(",") if x] for n, q in state.qos.items()}
        self.stale: set[str] = set()
        self.deleted: set[str] = set()

    def _loop_check(self, name: str, new: list[str]) -> None:
        seen, todo = set(), list(new)
        while todo:
            other = todo.pop()
            assert other != name and other not in self.stale | self.deleted, \
                f"sacctmgr: QOS Preemption loop detected ({name} -> ... {other})"
            if other not in seen:
                seen.add(other)
                todo.extend(self.lists.get(other, []))

    def _show_lists(self) -> None:
        for n, q in self.state.qos.items():
            q["preempt"] = ",".join(sorted(x for x in self.lists[n] if x not in self.deleted))

    def apply(self, c: Change) -> None:
        s = self.state
        if c.entity == "qos":
            if c.op == "add":
                assert c.name not in s.qos, f"sacctmgr: QOS {c.name} exists"
                s.qos[c.name] = {**STOCK_NORMAL, "name": c.name, "preemptmode": "cluster"}
                self.lists[c.name] = []
            elif c.op == "modify":
                name = c.where["name"]
                s.qos[name].update({k.lower(): _shown(k.lower(), v) for k, v in c.settings.items() if k != "Preempt"})
                if "Preempt" in c.settings:
                    new = [x for x in c.settings["Preempt"].split(",") if x]
                    assert all(x in s.qos for x in new), f"Preempt names a QOS that is not there: {new}"
                    self._loop_check(name, new)
                    self.lists[name] = new
                    (self.stale.add if not new else self.stale.discard)(name)
            elif c.op == "delete":
                name = c.where["name"]
                assert not any(a["DefaultQOS"] == name for a in s.assocs), f"{name} is a default QOS"
                del s.qos[name]
                self.deleted.add(name)
                for a in s.assocs:
                    a["QOS"] = ",".join(q for q in a["QOS"].split(",") if q != name)
            self._show_lists()
        elif c.entity in ("user", "account"):
            rows = [a for a in s.assocs if (a["User"] == c.where["name"] and a["Account"] == c.where["account"]
                                            if c.entity == "user" else a["User"] == "" and a["Account"] == c.where["name"])]
            assert rows, c
            for a in rows:
                if "qos" in c.settings:
                    names = [q for q in c.settings["qos"].split(",") if q]
                    assert all(q in s.qos for q in names), c
                    a["QOS"] = ",".join(sorted(names))
                if "defaultqos" in c.settings:
                    a["DefaultQOS"] = "" if c.settings["defaultqos"] == "-1" else c.settings["defaultqos"]
        elif c.entity == "partition":
            assert s.partitions is not None
            if c.op == "create":
                s.partitions[c.name] = {"PartitionName": c.name, **c.settings}
            elif c.op == "update":
                s.partitions[c.name].update(c.settings)
            else:
                del s.partitions[c.name]
        else:
            raise AssertionError(c)


def site_cluster() -> ClusterState:
    """A cluster as the site has it: its own normal and high, an account lab, two partitions."""
    qos = {"normal": {**STOCK_NORMAL, "priority": "10"},
           "high": {**STOCK_NORMAL, "name": "high", "priority": "100", "preempt": "normal", "gracetime": "00:01:00"}}
    assocs = [{"Cluster": "hai", "Account": acct, "User": user, "Partition": "", "QOS": "high,normal" if acct == "lab"
               else "normal", "DefaultQOS": ""} for acct in ("lab", "root") for user in ("", "hai-alice", "hai-bob")]
    partitions = {"batch": {"PartitionName": "batch", "Nodes": "n[1-4]", "Default": "YES", "PriorityTier": "1",
                            "AllowQos": "ALL", "OverSubscribe": "NO"},
                  "debug": {"PartitionName": "debug", "Nodes": "n[1-2]", "Default": "NO", "PriorityTier": "5",
                            "AllowQos": "ALL", "OverSubscribe": "NO"}}
    return ClusterState(qos=qos, assocs=assocs, partitions=partitions,
                        nodes={"n[1-4]": frozenset({"n1", "n2", "n3", "n4"}), "n[1-2]": frozenset({"n1", "n2"})})


class Backend:
    """The slice of slurm_hai.slurm.Backend that controller/apply.py uses, over a SlurmModel."""

    def __init__(self, state: ClusterState):
        self.model = SlurmModel(state)

    def qos(self):
        return [{"Name": n, **{k.capitalize(): v for k, v in q.items() if k != "name"}} for n, q in
                self.model.state.qos.items()]

    def associations(self):
        return copy.deepcopy(self.model.state.assocs)

    def partitions(self):
        return list(copy.deepcopy(self.model.state.partitions or {}).values())

    def expand_hostlist(self, hostlist):
        return sorted(self.model.state.nodes.get(hostlist, ()))

    def apply(self, change):
        self.model.apply(change)


def comparable(state: ClusterState) -> tuple:
    return (state.qos, sorted(tuple(sorted(a.items())) for a in state.assocs), state.partitions)


def test_the_sites_qos_of_other_settings_are_conflicts_until_adopted():
    state = site_cluster()
    changes = plan_changes(default_policy(), state)
    assert qos_conflicts(changes, state, InstallRecord()) == ["high", "normal"]
    assert qos_conflicts(changes, state, InstallRecord(qos_before={"high": {}, "normal": {}})) == []
    # a site ladder of other names needs none of them
    site = policy_of(SITE_POLICY)
    assert qos_conflicts(plan_changes(site, state), state, InstallRecord()) == []


def test_apply_refuses_to_change_a_sites_qos_and_changes_nothing(tmp_path):
    backend = Backend(site_cluster())
    before = copy.deepcopy(comparable(backend.model.state))
    with pytest.raises(InstallError, match=r"QOS high, normal of the site .*--adopt high,normal"):
        apply_policy(default_policy(), backend, record=tmp_path / "rec.json")
    assert comparable(backend.model.state) == before
    assert not (tmp_path / "rec.json").exists()


ON_THE_SITES_PARTITION = SITE_POLICY.replace("[groups.hai]", "[groups.batch]")


@pytest.mark.parametrize("policy_text, adopt", [("", ["high", "normal"]), (SITE_POLICY, []),
                                                (ON_THE_SITES_PARTITION, [])])
def test_remove_after_install_gives_back_the_cluster_as_it_was(tmp_path, policy_text, adopt):
    policy = policy_of(policy_text)
    backend = Backend(site_cluster())
    before = copy.deepcopy(comparable(backend.model.state))
    record = tmp_path / "hai-install.json"
    done = apply_policy(policy, backend, record=record, adopt=adopt)
    assert done and record.exists()
    state = backend.model.state
    assert all(lvl.qos in state.qos for lvl in policy.ladder)
    assert plan_changes(policy, state) == []  # the cluster matches the policy
    # a second apply changes nothing and keeps what the first one found
    first = load_record(record).to_json()
    assert apply_policy(policy, backend, record=record, adopt=adopt) == []
    assert load_record(record).to_json() == first
    if "[groups.batch]" in policy_text:  # the site's partition, changed, and its settings as they were
        assert state.partitions["batch"]["PriorityTier"] == "2"
        assert load_record(record).partitions_before == {"batch": {"PriorityTier": "1", "OverSubscribe": "NO"}}
    removal = remove_policy(backend, record)
    assert removal
    assert comparable(backend.model.state) == before
    assert not record.exists()
    assert remove_policy(backend, record) == []  # nothing left to take out


def test_apply_never_deletes_a_qos_it_did_not_create(tmp_path):
    state = site_cluster()
    state.qos["gold.u.hai-carol"] = {**STOCK_NORMAL, "name": "gold.u.hai-carol"}  # the site's, by its name a variant
    backend = Backend(state)
    apply_policy(policy_of(SITE_POLICY), backend, record=tmp_path / "r.json")
    assert "gold.u.hai-carol" in backend.model.state.qos
    assert "gold.u.hai-carol" not in load_record(tmp_path / "r.json").created_qos


def test_a_record_keeps_the_first_settings_it_saw():
    state = site_cluster()
    record = recorded(InstallRecord(), [Change("modify", "qos", where={"name": "high"}, settings={"Priority": "31"})],
                      state)
    assert record.qos_before == {"high": {"Priority": "100"}}
    state.qos["high"]["priority"] = "31"
    again = recorded(record, [Change("modify", "qos", where={"name": "high"}, settings={"Priority": "32",
                                                                                        "GraceTime": "5"})], state)
    assert again.qos_before == {"high": {"Priority": "100", "GraceTime": "60"}}


def test_an_unreadable_record_is_one_line_that_says_what_to_do(tmp_path):
    path = tmp_path / "rec.json"
    path.write_text("{not json")
    with pytest.raises(InstallError, match=r"rec.json: .*move it away only if nothing of slurm-hai is installed"):
        load_record(path)
    path.write_text('{"version": 1}')
    with pytest.raises(InstallError, match="malformed install record"):
        load_record(path)
    save_record(path, InstallRecord(created_qos=["gold"]))
    assert load_record(path).created_qos == ["gold"]


def test_removal_takes_out_only_what_the_record_names():
    state = site_cluster()
    assert removal_changes(InstallRecord(), state) == []
    record = InstallRecord(created_qos=["gone"], created_partitions=["gone"])
    assert removal_changes(record, state) == []  # made once, already gone


@pytest.mark.parametrize("config, said", [
    ({"PreemptMode": "CANCEL", "PreemptType": "preempt/qos"}, [r"PreemptMode=CANCEL cancels a preempted job"]),
    ({"PreemptMode": "OFF", "PreemptType": "preempt/none"}, [r"PreemptMode=OFF turns preemption off",
                                                            r"PreemptType=preempt/none: the levels are QOS"]),
    ({"PreemptMode": "REQUEUE", "PreemptType": "preempt/qos", "JobRequeue": "0"}, [r"JobRequeue=0: a job submitted"]),
    ({"PreemptMode": "REQUEUE", "PreemptType": "preempt/qos", "JobRequeue": "1"}, []),
    ({"PreemptMode": "GANG,SUSPEND", "PreemptType": "preempt/qos"}, [r"PreemptMode=GANG,SUSPEND suspends"]),
])
def test_plan_warns_in_one_line_about_what_would_defeat_slurm_hai(config, said):
    warnings = config_warnings(config)
    assert len(warnings) == len(said)
    for line, pattern in zip(warnings, said):
        assert "\n" not in line and line.startswith("warning: ") and re.search(pattern, line), line


def test_removal_gives_back_a_shared_partition_that_26_05_shows_as_exclusive_node():
    state = site_cluster()
    state.partitions["batch"].update(OverSubscribe="NO", Exclusive="NODE")  # 26.05: whole nodes, in its words
    record = InstallRecord(partitions_before={"batch": {"OverSubscribe": "NO"}})
    assert [(c.op, c.name, dict(c.settings)) for c in removal_changes(record, state)] == [
        ("update", "batch", {"OverSubscribe": "NO"})]
    state.partitions["batch"]["Exclusive"] = "NO"
    assert removal_changes(record, state) == []
