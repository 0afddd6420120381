"""The QOS ladder, quota-override variants, the plan against a cluster state, and the
rendered Slurm files (job_submit.lua run under a real Lua with a stub `slurm` table)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from slurm_hai.policy.model import default_policy, load_policy, parse_policy
from slurm_hai.policy.ladder import (ClusterState, desired_qos, offline_access_changes, plan_changes, qos_changes,
                                    qos_weight, template_context)
from slurm_hai.policy.levels import level_of_qos, parse_qos
from slurm_hai.render import render
from slurm_hai.slurm.commands import QOS_FIELDS, change_argv

REPO = Path(__file__).resolve().parents[2]
LOCAL = load_policy(REPO / "contrib" / "localcluster" / "policy.toml")


def shown(policy) -> dict[str, dict[str, str]]:
    """What `sacctmgr show qos` would print once the policy is applied."""
    out = {}
    for spec in desired_qos(policy):
        row = {"name": spec.name}
        row.update({k.lower(): v[0] for k, v in spec.settings().items()})
        out[spec.name] = row
    return out


def assocs_for(policy, users=("root", "hai-alice", "hai-bob"), account="hai", cluster="hai"):
    ladder = ",".join(sorted(lvl.qos for lvl in policy.ladder))
    return [{"Cluster": cluster, "Account": account, "User": u, "Partition": "", "QOS": ladder, "DefaultQOS": "normal"}
            for u in ("", *users)]


def applied(policy, changes_state: ClusterState) -> ClusterState:
    """The state after the plan's association changes (QOS as desired)."""
    state = ClusterState(qos=shown(policy), assocs=[dict(r) for r in changes_state.assocs],
                         partitions=changes_state.partitions, nodes=changes_state.nodes)
    for c in plan_changes(policy, changes_state):
        if c.op == "modify" and c.entity in ("user", "account"):
            for row in state.assocs:
                user_match = row["User"] == c.where.get("name") if c.entity == "user" else row["User"] == ""
                acct = c.where.get("account") if c.entity == "user" else c.where.get("name")
                if user_match and row["Account"] == acct:
                    row["QOS"], row["DefaultQOS"] = c.settings["qos"], c.settings["defaultqos"]
    return state


def test_one_qos_per_level_preempts_only_lower_levels():
    specs = {s.name: s for s in desired_qos(default_policy())}
    assert list(specs) == ["extreme_high", "very_high", "high", "above_normal", "normal", "under_normal",
                           "below_normal", "low"]
    assert specs["high"].priority == 31
    assert specs["high"].preempt == ("above_normal", "below_normal", "low", "normal", "under_normal")
    assert specs["low"].preempt == ()
    for spec in specs.values():
        assert spec.name not in spec.preempt  # the same level never preempts
        assert spec.flags == ("DenyOnLimit",)
        assert spec.grace_seconds == 5


def test_quota_overrides_are_variant_qos_with_the_level_relations():
    specs = {s.name: s for s in desired_qos(LOCAL)}
    bob = specs["normal.u.hai-bob"]
    assert bob.max_nodes_per_user == 2 and bob.priority == specs["normal"].priority
    assert bob.preempt == specs["normal"].preempt
    # every higher level preempts the variant, the same level does not
    assert "normal.u.hai-bob" in specs["above_normal"].preempt
    assert "normal.u.hai-bob" in specs["high.u.hai-bob"].preempt
    assert "normal.u.hai-bob" not in specs["normal"].preempt
    assert "high.u.hai-bob" not in specs["high"].preempt
    assert specs["very_high.u.hai-bob"].max_nodes_per_user == 0
    assert specs["normal"].max_nodes_per_user == 4 and specs["low"].max_nodes_per_user is None


def test_qos_names_map_back_to_levels():
    assert LOCAL.qos_for("NORMAL", "hai-bob", "hai") == "normal.u.hai-bob"
    assert LOCAL.qos_for("NORMAL", "hai-alice", "hai") == "normal"
    assert LOCAL.qos_for("LOW", "hai-bob", "hai") == "low"
    assert level_of_qos("normal.u.hai-bob", LOCAL.ladder).name == "NORMAL"
    assert level_of_qos("above_normal.a.lab", LOCAL.ladder).name == "ABOVE_NORMAL"
    assert level_of_qos("site_special", LOCAL.ladder) is None
    assert parse_qos("high.u.a.b") == ("high", "u", "a.b")
    assert parse_qos("high") == ("high", "", "")
    p = parse_policy({"quota": {"accounts": {"lab": {"HIGH": 3}}, "users": {"ann": {"HIGH": 1}}}})
    assert p.qos_for("HIGH", "bob", "lab") == "high.a.lab"
    assert p.qos_for("HIGH", "ann", "lab") == "high.u.ann"


def test_priority_weight_gives_each_level_its_band():
    assert qos_weight(default_policy()) == 51_000_000


def test_plan_creates_everything_on_an_empty_database():
    changes = qos_changes(desired_qos(default_policy()), {})
    adds = [c for c in changes if c.op == "add"]
    assert len(adds) == 8 and changes[:8] == adds  # Preempt= may only name QOS that exist
    assert adds[0].why == "new QOS: level EXTREME_HIGH: quota unlimited per user"
    high = next(c for c in changes if c.op == "modify" and c.where == {"name": "high"})
    assert high.settings["Preempt"] == "above_normal,below_normal,low,normal,under_normal"
    assert high.settings["Flags"] == "DenyOnLimit" and high.settings["GraceTime"] == "5"
    assert "MaxTRESPU" not in high.settings  # no quota in the default policy: none to set
    assert high.why == "high: settings of the new QOS"
    low = next(c for c in changes if c.op == "modify" and c.where == {"name": "low"})
    assert "Preempt" not in low.settings  # LOW preempts nothing: nothing to set


def test_plan_is_empty_when_the_cluster_matches():
    assert qos_changes(desired_qos(LOCAL), shown(LOCAL)) == []
    state = ClusterState(qos=shown(LOCAL), assocs=assocs_for(LOCAL))
    after = applied(LOCAL, state)
    assert plan_changes(LOCAL, after) == []


def test_plan_changes_only_what_differs():
    current = shown(LOCAL)
    current["high"]["gracetime"] = "00:00:10"
    current["normal"]["maxtrespu"] = ""
    current["low"]["preempt"] = "normal"
    changes = plan_changes(LOCAL, ClusterState(qos=current))
    assert [(c.op, c.entity, c.where, c.settings) for c in changes] == [
        ("modify", "qos", {"name": "high"}, {"GraceTime": "60"}),  # max_grace_seconds: Slurm's bound
        ("modify", "qos", {"name": "normal"}, {"MaxTRESPU": "node=4"}),
        ("modify", "qos", {"name": "low"}, {"Preempt": ""}),
    ]
    assert changes[0].why == "high: GraceTime 00:00:10 -> 00:01:00"
    assert changes[1].why == "normal: MaxTRESPU (none) -> node=4"
    assert changes[2].why == "low: Preempt -normal"


def test_association_access_uses_variants_and_keeps_site_qos():
    rows = assocs_for(LOCAL)
    rows[2]["QOS"] += ",site_special"  # hai-alice has a QOS of the site's own
    changes = plan_changes(LOCAL, ClusterState(qos=shown(LOCAL), assocs=rows))
    assert len(changes) == 1  # only hai-bob needs his variants; the account and others match
    (bob,) = changes
    assert (bob.op, bob.entity, bob.where) == ("modify", "user", {"cluster": "hai", "account": "hai", "name": "hai-bob"})
    assert list(bob.settings) == ["qos", "defaultqos"]
    qos = set(bob.settings["qos"].split(","))
    assert {"normal.u.hai-bob", "high.u.hai-bob", "low", "under_normal"} <= qos
    assert "normal" not in qos and "high" not in qos
    assert bob.settings["defaultqos"] == "normal.u.hai-bob"
    assert "+normal.u.hai-bob" in bob.why.split() and "-normal" in bob.why.split()
    assert bob.why.endswith("; default normal -> normal.u.hai-bob")


def test_stale_override_qos_is_removed_after_access_changes():
    state = ClusterState(qos=shown(LOCAL), assocs=assocs_for(LOCAL))
    state = applied(LOCAL, state)
    without_bob = parse_policy({**_local_dict(), "quota": {"NORMAL": 4}})
    changes = plan_changes(without_bob, state)
    kinds = [(c.op, c.entity) for c in changes]
    deletes = [c.where for c in changes if c.op == "delete"]
    assert sorted(d["name"] for d in deletes) == sorted(f"{lvl}.u.hai-bob" for lvl in
                                                        ("extreme_high", "very_high", "high", "above_normal", "normal"))
    assert all(list(d) == ["name"] for d in deletes)
    assert kinds.index(("modify", "user")) < kinds.index(("delete", "qos"))
    # the site's own QOS are never deleted
    state.qos["site_special"] = {"name": "site_special"}
    assert not any("site_special" in repr(c) for c in plan_changes(without_bob, state))


def _local_dict() -> dict:
    import tomllib

    return tomllib.loads((REPO / "contrib" / "localcluster" / "policy.toml").read_text())


def test_partitions_are_compared_and_created():
    p = parse_policy({"groups": {"gpu": {"nodes": "n[1-4]", "priority_tier": 2, "levels": ["HIGH", "LOW"]},
                                 "cpu": {"nodes": "c1"}}})
    have = {"gpu": {"PartitionName": "gpu", "PriorityTier": "1", "AllowQos": "ALL", "Default": "YES",
                    "Nodes": "n[1-4]", "OverSubscribe": "EXCLUSIVE"}}
    state = ClusterState(qos=shown(p), partitions=have, nodes={"n[1-4]": frozenset({"n1", "n2", "n3", "n4"}),
                                                                "c1": frozenset({"c1"})})
    changes = plan_changes(p, state)
    assert [(c.op, c.entity, c.name) for c in changes] == [("update", "partition", "gpu"), ("create", "partition", "cpu")]
    assert changes[0].settings == {"PriorityTier": "2", "AllowQos": "high,low"}
    assert changes[0].why == "node group gpu: PriorityTier 1 -> 2; AllowQos ALL -> high,low"
    assert changes[1].settings == {"Nodes": "c1", "PriorityTier": "1", "AllowQos": "ALL", "Default": "NO",
                                   "OverSubscribe": "EXCLUSIVE", "MaxTime": "INFINITE", "State": "UP"}
    have["gpu"].update(PriorityTier="2", AllowQos="low,high")
    have["cpu"] = {"PartitionName": "cpu", "PriorityTier": "1", "AllowQos": "ALL", "Default": "NO", "Nodes": "c1",
                   "OverSubscribe": "EXCLUSIVE"}
    assert plan_changes(p, state) == []
    have["cpu"]["OverSubscribe"] = "NO"  # a partition of the site's that shares nodes: whole nodes per job
    assert plan_changes(p, state)[0].settings == {"OverSubscribe": "EXCLUSIVE"}
    have["cpu"]["Exclusive"] = "NODE"  # 26.05's words for a whole-node partition (OverSubscribe=NO beside)
    assert plan_changes(p, state) == []
    have["cpu"]["Exclusive"] = "NO"
    assert plan_changes(p, state)[0].settings == {"OverSubscribe": "EXCLUSIVE"}
    have["cpu"].update(OverSubscribe="EXCLUSIVE", Exclusive="")
    have["gpu"]["Nodes"] = "n[1-2]"
    state.nodes["n[1-2]"] = frozenset({"n1", "n2"})
    assert plan_changes(p, state)[0].settings == {"Nodes": "n[1-4]"}


def test_partitions_not_read_are_left_alone():
    assert all(c.entity != "partition" for c in plan_changes(LOCAL, ClusterState()))


def test_the_qos_read_covers_every_setting_the_plan_compares():
    spec = desired_qos(LOCAL)[0]
    assert set(spec.settings()) | {"Name"} == set(QOS_FIELDS)


# ------------------------------------------------------------------ rendered files


def test_rendered_slurm_conf_fragments():
    ctx = template_context(LOCAL)
    conf = render("slurm/hai-policy.conf.j2", **ctx)
    assert "PreemptType=preempt/qos" in conf and "PriorityWeightQOS=51000000" in conf
    assert "KillWait=5" in conf
    parts = render("slurm/partitions.conf.j2", **ctx)
    assert "PartitionName=gpu Nodes=n[1-4] Default=YES PriorityTier=1 AllowQos=ALL OverSubscribe=EXCLUSIVE" in parts
    p = parse_policy({"groups": {"big": {"nodes": "b[1-8]", "levels": ["HIGH"]}},
                      "quota": {"users": {"ann": {"HIGH": 1}}}})
    parts = render("slurm/partitions.conf.j2", **template_context(p))
    assert "AllowQos=high,high.u.ann" in parts


def test_qos_script_is_valid_shell_and_idempotent_on_adds(tmp_path):
    ctx = template_context(LOCAL)
    text = render("slurm/qos-ladder.sh.j2", changes=[(c, change_argv(c)) for c in plan_changes(LOCAL, ClusterState())],
                  access=[(c, change_argv(c)) for c in offline_access_changes(LOCAL)], **ctx)
    path = tmp_path / "qos.sh"
    path.write_text(text)
    assert subprocess.run(["sh", "-n", str(path)]).returncode == 0
    assert "grep -qxF normal.u.hai-bob || sacctmgr -i add qos normal.u.hai-bob" in text
    assert "sacctmgr -i modify account where name=hai set" in text
    # a user with an override gets their variants in each account of the policy
    assert "sacctmgr -i modify user where name=hai-bob account=hai set" in text
    # sacctmgr fails a modify that matches nothing (an account without users yet): not the script's failure
    access = [line for line in text.splitlines() if " modify account " in line or " modify user " in line]
    assert len(access) == 5 and all(line.endswith(' || echo "  (no association to change)"') for line in access)
    # hai-bob's override replaces normal, the account's default: sacctmgr sets that default only
    # while every user below the account may use it, so he may, for the moment of the change
    assert [line.split(" set ")[0] for line in access] == [
        "sacctmgr -i modify user where account=hai", "sacctmgr -i modify user where name=hai-bob account=hai",
        "sacctmgr -i modify user where name=hai-bob account=hai", "sacctmgr -i modify account where name=hai",
        "sacctmgr -i modify user where name=hai-bob account=hai"]
    assert ",normal," in access[2] and ",normal," not in access[4]


LUA = shutil.which("lua5.3") or shutil.which("lua")

LUA_HARNESS = r"""
local results = {}
slurm = { SUCCESS = 0, ERROR = -1,
          log_user = function(fmt, ...) results.msg = string.format(fmt, ...) end,
          log_info = function() end }
dofile(arg[1])
local cases = %s
local out = {}
for i, c in ipairs(cases) do
  results.msg = nil
  local job = { user_name = c.user, account = c.account, default_account = "hai", min_nodes = c.nodes,
                max_nodes = c.max_nodes, comment = c.comment, qos = c.qos, spank_job_env = c.env }
  local rc = slurm_job_submit(job, {}, 1000)
  out[i] = string.format('{"rc": %%d, "qos": "%%s", "comment": "%%s", "msg": "%%s"}', rc, job.qos or "",
                         job.admin_comment or "", results.msg or "")
end
print("[" .. table.concat(out, ",") .. "]")
"""


def run_lua(tmp_path: Path, policy, cases: list[dict]) -> list[dict]:
    script = tmp_path / "job_submit.lua"
    script.write_text(render("slurm/job_submit.lua.j2", **template_context(policy)))
    lua_cases = "{" + ",".join(
        "{" + ",".join(f"{k} = {_lua(v)}" for k, v in c.items()) + "}" for c in cases) + "}"
    harness = tmp_path / "harness.lua"
    harness.write_text(LUA_HARNESS % lua_cases)
    p = subprocess.run([LUA, str(harness), str(script)], text=True, capture_output=True, check=True)
    return json.loads(p.stdout)


def _lua(v) -> str:
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "{" + ",".join(_lua(x) for x in v) + "}"
    return str(v)


@pytest.mark.skipif(LUA is None, reason="no lua interpreter (apt-get install lua5.3)")
def test_job_submit_lua_maps_levels_quotas_and_auto(tmp_path):
    no_val = 4294967294
    got = run_lua(tmp_path, LOCAL, [
        {"user": "hai-alice", "nodes": 2, "qos": "high"},                        # 1 --qos=level
        {"user": "hai-bob", "nodes": 1, "qos": "high"},                          # 2 -> bob's variant
        {"user": "hai-bob", "nodes": 2, "qos": "high"},                          # 3 over bob's whole quota
        {"user": "hai-bob", "nodes": 1, "qos": "very_high"},                     # 4 quota 0
        {"user": "hai-alice", "nodes": no_val},                                   # 5 default level
        {"user": "hai-bob", "nodes": 1, "env": ["HAI_PRIORITY=ABOVE_NORMAL"]},   # 6 SPANK option
        {"user": "hai-bob", "nodes": 1, "qos": "auto"},                          # 7 AUTO -> HIGH for bob
        {"user": "hai-alice", "nodes": 2, "env": ["HAI_PRIORITY=AUTO"]},         # 8 AUTO 2 nodes -> VERY_HIGH
        {"user": "hai-bob", "nodes": 3, "qos": "auto"},                          # 9 AUTO 3 nodes -> UNDER_NORMAL
        {"user": "hai-alice", "nodes": 1, "qos": "site_special"},                # 10 not ours
        {"user": "hai-alice", "nodes": 1, "env": ["HAI_PRIORITY=BOGUS"]},        # 11 unknown level
        {"user": "hai-alice", "nodes": 5, "qos": "normal"},                      # 12 over quota 4
    ])
    assert got[0] == {"rc": 0, "qos": "high", "comment": "hai-level=HIGH hai-grace=5", "msg": ""}
    assert got[1] == {"rc": 0, "qos": "high.u.hai-bob", "comment": "hai-level=HIGH hai-grace=5", "msg": ""}
    assert got[2]["rc"] == -1
    assert got[2]["msg"] == ("hai: 2 nodes at HIGH exceed your quota of 1 nodes at that level; ask for at most 1 "
                             "or use a lower level")
    assert got[3]["rc"] == -1 and "your quota at VERY_HIGH is 0 nodes" in got[3]["msg"]
    assert got[4] == {"rc": 0, "qos": "normal", "comment": "hai-level=NORMAL hai-grace=5", "msg": ""}
    assert got[5]["qos"] == "above_normal.u.hai-bob" and got[5]["comment"] == "hai-level=ABOVE_NORMAL hai-grace=5"
    assert got[6] == {"rc": 0, "qos": "high.u.hai-bob", "comment": "hai-level=AUTO hai-grace=5", "msg": ""}
    assert got[7]["qos"] == "very_high" and got[7]["comment"] == "hai-level=AUTO hai-grace=5"
    assert got[8]["qos"] == "under_normal"
    assert got[9] == {"rc": 0, "qos": "site_special", "comment": "", "msg": ""}
    assert got[10]["rc"] == -1 and got[10]["msg"].startswith("hai: unknown priority level 'BOGUS'; use one of ")
    assert got[10]["msg"].endswith("or AUTO")
    assert got[11]["rc"] == -1 and "5 nodes at NORMAL exceed your quota of 4 nodes" in got[11]["msg"]


@pytest.mark.skipif(LUA is None, reason="no lua interpreter (apt-get install lua5.3)")
def test_job_submit_lua_account_override_and_auto_off(tmp_path):
    p = parse_policy({"allow_auto": False, "min_gpus": 0,  # these jobs ask for no GPUs
                      "quota": {"NORMAL": 2, "accounts": {"lab": {"NORMAL": "unlimited"}}}})
    got = run_lua(tmp_path, p, [
        {"user": "ann", "account": "lab", "nodes": 9, "qos": "normal"},
        {"user": "ann", "nodes": 3, "qos": "normal"},
        {"user": "ann", "nodes": 1, "qos": "auto"},
    ])
    assert got[0]["rc"] == 0 and got[0]["qos"] == "normal.a.lab"
    assert got[1]["rc"] == -1
    assert got[2]["rc"] == -1 and "AUTO is not allowed" in got[2]["msg"]


@pytest.mark.skipif(LUA is None, reason="no lua interpreter (apt-get install lua5.3)")
def test_job_submit_lua_stamps_an_elastic_jobs_range_and_the_step_hai_submit_asked(tmp_path):
    no_val = 4294967294
    got = run_lua(tmp_path, LOCAL, [
        {"user": "hai-alice", "nodes": 2, "max_nodes": 4, "qos": "low"},                            # sbatch -N 2-4
        {"user": "hai-alice", "nodes": 2, "max_nodes": 4, "qos": "low", "comment": "hai-nodes=2:4:2"},  # hai-submit
        {"user": "hai-alice", "nodes": 2, "max_nodes": 4, "qos": "low", "comment": "hai-nodes=1:4:3"},  # not its own
        {"user": "hai-alice", "nodes": 2, "max_nodes": 4, "qos": "low", "comment": "hai-nodes=2:4:3"},  # misses MAX
        {"user": "hai-alice", "nodes": 2, "max_nodes": 2, "qos": "low", "comment": "hai-nodes=2:4:2"},  # -N 2
        {"user": "hai-alice", "nodes": 2, "max_nodes": no_val, "qos": "low"},                        # no max
        {"user": "hai-alice", "nodes": 3, "max_nodes": 8, "qos": "normal"},                          # MIN in quota 4
        {"user": "hai-alice", "nodes": 5, "max_nodes": 8, "qos": "normal"},                          # MIN over quota
    ])
    comments = [g["comment"] for g in got]
    assert comments[:7] == ["hai-level=LOW hai-grace=5 hai-nodes=2:4:1", "hai-level=LOW hai-grace=5 hai-nodes=2:4:2",
                            "hai-level=LOW hai-grace=5 hai-nodes=2:4:1", "hai-level=LOW hai-grace=5 hai-nodes=2:4:1",
                            "hai-level=LOW hai-grace=5", "hai-level=LOW hai-grace=5",
                            "hai-level=NORMAL hai-grace=5 hai-nodes=3:8:1"]
    assert got[7]["rc"] == -1 and "5 nodes at NORMAL exceed your quota of 4 nodes" in got[7]["msg"]
