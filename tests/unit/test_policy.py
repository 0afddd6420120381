"""The policy file: every field, defaults, and errors that name their place."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_hai.policy.levels import DEFAULT_LADDER
from slurm_hai.policy.model import (Demotion, NodeGroup, Policy, PolicyError, default_policy, find_policy, load_policy,
                              parse_policy)

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "contrib" / "localcluster" / "policy.toml"


def load_text(tmp_path: Path, text: str) -> Policy:
    path = tmp_path / "policy.toml"
    path.write_text(text)
    return load_policy(path)


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(PolicyError) as e:
        load_text(tmp_path, text)
    return str(e.value)


def test_empty_file_is_hai_default(tmp_path):
    p = load_text(tmp_path, "")
    assert p.ladder == DEFAULT_LADDER
    assert [lvl.value for lvl in p.ladder] == [50, 40, 30, 20, 10, 8, 5, 0]
    assert p.default_level == "NORMAL" and p.grace_seconds == 5 and p.min_run_seconds == 0
    assert p.demotion == Demotion("ABOVE_NORMAL", "NORMAL", 1800)
    assert p.quota == {} and p.user_quota == {} and p.account_quota == {}
    assert p.groups == (NodeGroup("gpu", "ALL", default=True),)
    assert p.allow_auto and p.notice_signal == "USR2"
    assert p == default_policy()


def test_local_cluster_policy_has_all_levels_and_quota_rules():
    p = load_policy(LOCAL)
    assert [lvl.name for lvl in p.levels_high_to_low] == [lvl.name for lvl in DEFAULT_LADDER]
    assert p.quota_for("NORMAL", "hai-alice") == 4
    assert p.quota_for("NORMAL", "hai-bob") == 2
    assert p.quota_for("VERY_HIGH", "hai-bob") == 0
    assert p.quota_for("LOW", "hai-bob") is None
    assert p.accounts == ("hai",)
    assert p.groups[0].nodes == "n[1-4]" and p.groups[0].default


def test_every_field(tmp_path):
    p = load_text(tmp_path, """
default_level = "LOW"
grace_seconds = "1m"
min_run_seconds = 30
accounts = ["research", "ops"]
allow_auto = false
notice_signal = "SIGUSR1"
[levels]
TOP = 9
MID = 5
LOW = 0
[demotion]
from = "MID"
to = "LOW"
after_seconds = "2h"
[quota]
TOP = 1
mid = 3
[quota.users.alice]
TOP = 0
MID = "unlimited"
[quota.accounts.research]
MID = 8
[groups.big]
nodes = "g[001-064]"
priority_tier = 2
levels = ["TOP", "mid"]
[groups.small]
nodes = "s[1-4]"
default = true
""")
    assert [(lvl.name, lvl.value) for lvl in p.ladder] == [("TOP", 9), ("MID", 5), ("LOW", 0)]
    assert p.default_level == "LOW" and p.grace_seconds == 60 and p.min_run_seconds == 30
    assert p.accounts == ("research", "ops") and not p.allow_auto and p.notice_signal == "USR1"
    assert p.demotion == Demotion("MID", "LOW", 7200)
    assert p.quota == {"TOP": 1, "MID": 3}
    assert p.user_quota == {"alice": {"TOP": 0, "MID": None}}
    assert p.account_quota == {"research": {"MID": 8}}
    assert p.groups == (NodeGroup("big", "g[001-064]", 2, ("TOP", "MID"), False),
                        NodeGroup("small", "s[1-4]", 1, (), True))
    assert p.default_group.name == "small"
    assert p.source.endswith("policy.toml")


def test_min_gpus_is_hai_8_unless_the_policy_or_a_group_says_otherwise(tmp_path):
    assert load_text(tmp_path, "").min_gpus == 8
    p = load_text(tmp_path, """
min_gpus = 4
[groups.train]
nodes = "g[1-8]"
[groups.test]
nodes = "t1"
min_gpus = 0
""")
    assert p.min_gpus == 4 and [g.min_gpus for g in p.groups] == [None, 0]
    assert (p.min_gpus_for("train"), p.min_gpus_for("test"), p.min_gpus_for(None), p.min_gpus_for("other")) == \
        (4, 0, 4, 4)
    assert p.min_gpus_refusal("test", 0) is None and p.min_gpus_refusal("train", 4) is None
    assert p.min_gpus_refusal(None, 2) == ("node group train takes jobs of at least 4 GPUs per node (whole nodes); "
                                           "this job asks for 2 per node: use --gpus-per-node=4")


def test_quota_precedence_user_then_account_then_default():
    p = parse_policy({"quota": {"NORMAL": 4, "HIGH": 2, "users": {"alice": {"NORMAL": 1, "HIGH": "unlimited"}},
                                "accounts": {"lab": {"NORMAL": 6, "LOW": 3}}}})
    assert p.quota_for("NORMAL", "alice", "lab") == 1
    assert p.quota_for("HIGH", "alice", "lab") is None  # unlimited overrides the default 2
    assert p.quota_for("NORMAL", "bob", "lab") == 6
    assert p.quota_for("LOW", "bob", "lab") == 3
    assert p.quota_for("NORMAL", "bob", "other") == 4
    assert p.quota_for("LOW", "bob", "other") is None
    assert p.override_owner("NORMAL", "alice", "lab") == ("u", "alice")
    assert p.override_owner("NORMAL", "bob", "lab") == ("a", "lab")
    assert p.override_owner("NORMAL", "bob", "x") is None


def test_first_group_is_default_when_none_says_so():
    p = parse_policy({"groups": {"a": {"nodes": "a[1-2]"}, "b": {"nodes": "b1"}}})
    assert [g.default for g in p.groups] == [True, False]


def test_demotion_can_be_turned_off():
    assert parse_policy({"demotion": {"enabled": False}}).demotion is None
    assert parse_policy({"levels": {"A": 2, "B": 1}, "default_level": "A"}).demotion is None


def test_lower_levels_never_include_own():
    p = default_policy()
    high = p.level("HIGH")
    assert [lvl.name for lvl in p.lower_levels(high)] == ["ABOVE_NORMAL", "NORMAL", "UNDER_NORMAL",
                                                          "BELOW_NORMAL", "LOW"]


@pytest.mark.parametrize("text,message", [
    ('[quota.users.alice]\nHIGH = "x"', "[quota.users.alice] HIGH: expected a non-negative integer, got 'x'"),
    ("[quota]\nNORMAL = -1", "[quota] NORMAL: expected a non-negative integer, got -1"),
    ("[quota]\nNORMAL = 1.5", "[quota] NORMAL: expected a non-negative integer, got 1.5"),
    ("[quota]\nNORMAL = true", "[quota] NORMAL: expected a non-negative integer, got True"),
    ("[quota]\nMEDIUM = 1", "[quota] MEDIUM: unknown level"),
    ("[quota.users.Alice]\nHIGH = 1", "[quota.users] Alice: expected a user or account name"),
    ("[quota.accounts.lab]\nFOO = 1", "[quota.accounts.lab] FOO: unknown level"),
    ("grace_seconds = -5", "grace_seconds: expected seconds (a non-negative integer) or a duration"),
    ('grace_seconds = "5 minutes"', "grace_seconds: expected seconds"),
    ("grace_seconds = 100000", "grace_seconds: expected from 1 to 3600 seconds, got 100000"),
    # a notice the job cannot answer is no notice: Slurm's GraceTime 0 sends no signal at all
    ("grace_seconds = 0", "grace_seconds: expected from 1 to 3600 seconds, got 0"),
    ('grace_seconds = "2h"', "grace_seconds: expected from 1 to 3600 seconds, got 7200"),
    ('max_grace_seconds = "1d"', "max_grace_seconds: expected from 1 to 3600 seconds, got 86400"),
    ('default_level = "MEDIUM"', "default_level: unknown level 'MEDIUM'"),
    ("colour = 1", "colour: unknown key (expected one of: default_level, "),
    ("accounts = \"hai\"", "accounts: expected a list of names, got 'hai'"),
    ("allow_auto = 1", "allow_auto: expected true or false, got 1"),
    ('notice_signal = "KILL"', "notice_signal: expected one of USR1, USR2, TERM"),
    ('notice_signal = "USR9"', "notice_signal: expected one of USR1, USR2, TERM"),
    # signals scancel and sbatch --signal do not take (RTMIN, WINCH), or that are no notice
    # (CHLD is ignored by default and raised by every child that ends)
    ('notice_signal = "CHLD"', "notice_signal: expected one of USR1, USR2, TERM"),
    ('notice_signal = "RTMIN"', "notice_signal: expected one of USR1, USR2, TERM"),
    ('notice_signal = "WINCH"', "notice_signal: expected one of USR1, USR2, TERM"),
    # keys that differ only in case are one name to Slurm (QOS, partitions) or to a reader
    ("[quota]\nHIGH = 1\nhigh = 2", "[quota] high: the same name as 'HIGH' but for case; keep one"),
    ("[quota.users.bob]\nHIGH = 1\nHigh = 2", "[quota.users.bob] High: the same name as 'HIGH' but for case"),
    ('[groups.gpu]\nnodes = "a"\n[groups.GPU]\nnodes = "b"', "[groups] GPU: the same name as 'gpu' but for case"),
    # PartitionName=DEFAULT sets the defaults of every partition in slurm.conf
    ('[groups.DEFAULT]\nnodes = "a"', "[groups] DEFAULT: DEFAULT is not a partition to Slurm"),
    ('[groups.default]\nnodes = "a"', "[groups] default: DEFAULT is not a partition to Slurm"),
    # hostlists Slurm cannot read
    ('[groups.gpu]\nnodes = "gpu[1-"', "[groups.gpu] nodes: hostlist 'gpu[1-': unbalanced brackets"),
    ('[groups.gpu]\nnodes = "gpu[5-2]"', "[groups.gpu] nodes: hostlist 'gpu[5-2]': '5-2' is not a range"),
    ('[groups.gpu]\nnodes = "gpu[a-b]"', "[groups.gpu] nodes: hostlist 'gpu[a-b]': 'a-b' is not a range"),
    ('[groups.gpu]\nnodes = "gpu/1"', "[groups.gpu] nodes: 'gpu/1' is not a node name"),
    ('[groups.gpu]\nnodes = ","', "[groups.gpu] nodes: ',' is not a node name"),
    ("[levels]\nNORMAL = 1001", "[levels] NORMAL: expected an integer from 0 to 1000, got 1001"),
    ("[levels]\nhigh = 3", "[levels] high: a level name is upper-case"),
    ("[levels]\nA = 3\nB = 3", "[levels] B: value 3 is already used by A"),
    ("[levels]\nAUTO = -1", "[levels] AUTO: AUTO is not a level"),
    ("[levels]\nA = 3", "default_level: required when the ladder has no NORMAL level"),
    ("levels = {}", "[levels] the ladder needs at least one level"),
    ('[demotion]\nfrom = "NORMAL"\nto = "HIGH"', "[demotion] to: HIGH is not below NORMAL"),
    ("[demotion]\nafter_seconds = 0", "[demotion] after_seconds: must be at least 1 second"),
    ("[demotion]\nafter = 5", "[demotion] after: unknown key"),
    ("[groups.gpu]\npriority_tier = 1", "[groups.gpu] nodes: required"),
    ('[groups.gpu]\nnodes = "a b"', "[groups.gpu] nodes: a hostlist has no spaces"),
    ('[groups.gpu]\nnodes = "a"\npriority_tier = 70000', "[groups.gpu] priority_tier: expected an integer from 0"),
    ('[groups.gpu]\nnodes = "a"\nlevels = ["HUGE"]', "[groups.gpu] levels: unknown level 'HUGE'"),
    ('[groups.gpu]\nnodes = "a"\nlevels = "HIGH"', "[groups.gpu] levels: expected a list of level names"),
    ('[groups.a]\nnodes = "a"\ndefault = true\n[groups.b]\nnodes = "b"\ndefault = true',
     "[groups] only one group can be the default, got a, b"),
    ('[groups."a b"]\nnodes = "a"', "[groups] a b: a group (partition) name is"),
    ("quota = 3", "quota: expected a table, got 3"),
    ("min_gpus = -1", "min_gpus: expected an integer from 0 to 64, got -1"),
    ('min_gpus = "8"', "min_gpus: expected an integer from 0 to 64, got '8'"),
    ('[groups.gpu]\nnodes = "a"\nmin_gpus = 65', "[groups.gpu] min_gpus: expected an integer from 0 to 64, got 65"),
    ('[elastic]\nlighthouse_service = "ctl:29510"', "[elastic] lighthouse_service: expected http://HOST:PORT"),
    ('[elastic]\nlighthouse_service = "http://ctl:0"', "[elastic] lighthouse_service: expected http://HOST:PORT"),
    ('[elastic]\nlighthouse_service = "http://ctl:29510/v1"', "[elastic] lighthouse_service: expected http://HOST"),
    ('[elastic]\nlighthouse_service = "https://ctl:29510"', "[elastic] lighthouse_service: expected http://HOST"),
    ('[daemon]\nservice = "ctl:6830"', "[daemon] service: expected http://HOST:PORT (where the policy daemon listens)"),
    ('[daemon]\nport = 6830', "[daemon] port: unknown key (expected one of: service)"),
    ('daemon = "http://ctl:6830"', "daemon: expected a table"),
])
def test_bad_field_is_one_located_error(tmp_path, text, message):
    got = error_of(tmp_path, text)
    assert got.startswith(str(tmp_path / "policy.toml") + ": "), got
    assert message in got, got
    assert "\n" not in got


def test_the_daemon_service_is_named_by_its_url(tmp_path):
    (tmp_path / "policy.toml").write_text('[daemon]\nservice = "http://ctl1.example.org:6830/"\n')
    assert load_policy(tmp_path / "policy.toml").daemon_service == "http://ctl1.example.org:6830"
    assert default_policy().daemon_service is None


def test_invalid_toml_names_the_file_and_line(tmp_path):
    got = error_of(tmp_path, "[quota\nHIGH = 1")
    assert got.startswith(f"{tmp_path / 'policy.toml'}: invalid TOML: ") and "line 1" in got


def test_missing_file(tmp_path):
    with pytest.raises(PolicyError, match="no such policy file"):
        load_policy(tmp_path / "nope.toml")


def test_find_policy_order(tmp_path, monkeypatch):
    beside = tmp_path / "etc" / "policy.toml"
    beside.parent.mkdir()
    beside.write_text("grace_seconds = 7\n")
    monkeypatch.delenv("HAI_POLICY", raising=False)
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "etc" / "slurm.conf"))
    assert find_policy().grace_seconds == 7
    explicit = tmp_path / "mine.toml"
    explicit.write_text("grace_seconds = 9\n")
    monkeypatch.setenv("HAI_POLICY", str(explicit))
    assert find_policy().grace_seconds == 9
    monkeypatch.delenv("HAI_POLICY")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "none" / "slurm.conf"))
    monkeypatch.setattr("slurm_hai.policy.model.SYSTEM_POLICY", tmp_path / "absent.toml")
    assert find_policy() == default_policy()


