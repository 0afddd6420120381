"""A site's own policy as `hai` and `hai-admin` show it: its level names, its account quotas,
and every value in force (`hai-admin check`), never HAI's built-in ladder or defaults."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from click.testing import CliRunner

from slurm_hai.cli import admin, common, user
from slurm_hai.policy.model import Policy, load_policy
from slurm_hai.slurm import SlurmError
from slurm_hai.slurm.records import JobInfo

ME = common.current_user()
SITE = """
default_level = "BRONZE"
grace_seconds = "10m"
max_grace_seconds = "20m"
min_run_seconds = 120
accounts = ["hai", "research"]
allow_auto = false
notice_signal = "TERM"
min_gpus = 4
fcfs_preempt_levels = ["SILVER"]

[levels]
GOLD = 30
SILVER = 10
BRONZE = 0

[demotion]
from = "GOLD"
to = "SILVER"
after_seconds = "1h"

[elastic]
grow_after = "5m"
lighthouse_service = "http://ctl.example.org:29510/"

[daemon]
service = "http://ctl.example.org:6830"

[quota]
GOLD = 2
SILVER = 4

[quota.accounts.research]
GOLD = 8
SILVER = "unlimited"

[quota.users.hai-bob]
GOLD = 0

[groups.main]
nodes = "n[1-4]"
priority_tier = 2

[groups.debug]
nodes = "n4"
levels = ["SILVER", "BRONZE"]
min_gpus = 1
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    path = tmp_path / "policy.toml"
    path.write_text(SITE)
    monkeypatch.setenv("HAI_POLICY", str(path))
    monkeypatch.setenv("HAI_HOME", str(tmp_path / "home"))
    return path


def job(job_id: int, state: str, qos: str, *, owner: str = ME, account: str = "hai", nodes: int = 1,
        reason: str = "None", partition: str = "main") -> JobInfo:
    now = int(time.time())
    running = state == "RUNNING"
    return JobInfo(job_id=job_id, name=f"j{job_id}", user=owner, state=state, reason=reason, qos=qos,
                   partition=partition, num_nodes=nodes, node_list="n1" if running else "", restart_count=0,
                   submit_time=now - 600, start_time=now - 300 if running else 0, eligible_time=0, priority=1,
                   account=account, end_time=now + 3600 if running else 0)


class Site:
    """The Slurm of a site: its queue, and what its accounting says of the user's accounts."""

    name = "fake"

    def __init__(self, queue: list[JobInfo], accounts: list[str] | None = ("hai", "research"),
                 default: str = "hai") -> None:
        self.queue, self.accounts, self.default = queue, accounts, default

    def jobs(self, job_ids=(), user=None):
        return [j for j in self.queue if (not job_ids or j.job_id in job_ids) and (user is None or j.user == user)]

    def job(self, job_id):
        return next(iter(self.jobs([job_id])), None)

    def users(self):
        if self.accounts is None:
            raise SlurmError("sacctmgr: Slurm's accounting (slurmdbd) does not answer")
        return [{"User": "someone-else", "DefaultAccount": "research"}, {"User": ME, "DefaultAccount": self.default}]

    def associations(self):
        self.users()
        return [{"Account": "physics", "User": "someone-else"}, {"Account": "research", "User": ""},
                *({"Account": a, "User": ME} for a in self.accounts)]


@pytest.fixture
def slurm(site, monkeypatch):
    def install(fake: Site) -> Site:
        monkeypatch.setattr(user, "backend", lambda: fake)
        monkeypatch.setattr(common, "backend", lambda: fake)
        monkeypatch.setattr(admin, "backend", lambda **_: fake)
        return fake
    return install


def hai(*argv: str):
    r = CliRunner().invoke(user.main, list(argv))
    assert r.exit_code == 0, r.output
    return r.output


# ------------------------------------------------------------------ hai quota


def test_quota_shows_each_account_when_their_quotas_differ_the_default_first(slurm):
    slurm(Site([job(1, "RUNNING", "gold.a.research", account="research", nodes=3), job(2, "PENDING", "silver")]))
    lines = hai("quota").splitlines()
    assert lines[0].split() == ["LEVEL", "VALUE", "IN", "USE", "QUOTA", "hai", "(default)", "QUOTA", "research"]
    assert [line.split() for line in lines[1:]] == [["GOLD", "30", "3", "2", "8"],
                                                    ["SILVER", "10", "0", "4", "no", "limit"],
                                                    ["BRONZE", "0", "0", "no", "limit", "no", "limit"]]
    rows = json.loads(hai("quota", "--json"))
    assert rows[0] == {"level": "GOLD", "value": 30, "in_use": 3, "account": "hai", "quota": 2,
                       "accounts": {"hai": 2, "research": 8}}
    assert [r["level"] for r in rows] == ["GOLD", "SILVER", "BRONZE"]


def test_quota_of_a_user_in_one_account_is_that_accounts(slurm):
    slurm(Site([], accounts=["research"], default="research"))
    out = hai("quota")
    assert out.splitlines()[1].split() == ["GOLD", "30", "0", "8"] and "quota in your account research" in out
    assert "default" not in out


def test_a_user_override_wins_over_every_account(slurm, monkeypatch):
    monkeypatch.setattr(user, "current_user", lambda: "hai-bob")
    slurm(Site([]))  # hai-bob's accounts are unknown to this accounting: the override decides anyway
    assert json.loads(hai("quota", "--json"))[0]["quota"] == 0


def test_quota_without_accounting_uses_the_accounts_of_your_jobs(slurm):
    slurm(Site([job(1, "PENDING", "gold.a.research", account="research")], accounts=None))
    rows = json.loads(hai("quota", "--json"))
    assert rows[0]["account"] == "research" and rows[0]["quota"] == 8


def test_quota_with_no_account_known_says_an_accounts_quota_may_differ(slurm):
    slurm(Site([], accounts=None))
    out = hai("quota")
    assert out.splitlines()[1].split() == ["GOLD", "30", "0", "2"] and "an account's own quota may differ" in out
    assert json.loads(hai("quota", "--json"))[0]["account"] is None


# ------------------------------------------------------------------ hai list, status, explain


def test_list_status_and_explain_speak_the_sites_level_names(slurm):
    slurm(Site([job(1, "RUNNING", "gold.a.research", account="research", nodes=2),
                job(2, "PENDING", "gold.a.research", account="research", nodes=7, reason="QOSMaxNodePerUserLimit"),
                job(3, "PENDING", "silver", reason="Resources"),
                job(4, "PENDING", "bronze", reason="Resources", owner="someone-else")]))
    rows = {r["job_id"]: r for r in json.loads(hai("list", "--all", "--json"))}
    assert {i: r["level"] for i, r in rows.items()} == {1: "GOLD", 2: "GOLD", 3: "SILVER", 4: "BRONZE"}
    # the account's quota (8), not the default one (2)
    assert rows[2]["reason"] == "over quota at GOLD: 2/8 nodes in use"
    assert rows[3]["reason"] == "waiting for 1 node at SILVER (position 2 in line, behind job 2 at GOLD)"
    assert rows[4]["reason"] == ("waiting for 1 node at BRONZE (position 3 in line, behind job 2 at GOLD and job 3 "
                                 "at SILVER)")
    status = hai("status", "3")
    assert "SILVER" in status and "grace" in status
    r = CliRunner().invoke(admin.main, ["explain", "--json"])
    assert r.exit_code == 0, r.output
    assert {row["job_id"]: row["why"] for row in json.loads(r.output)}[1].startswith("running at GOLD on 2 nodes")


def test_run_local_gives_the_grace_of_the_sites_jobs_unless_told(site, monkeypatch, tmp_path):
    got = []
    monkeypatch.setattr("slurm_hai.runtime.simulate.simulate", lambda cmd, **kw: got.append(kw["grace"]) or 0)
    for argv in ([], ["--grace", "2"]):
        r = CliRunner().invoke(user.main, ["run-local", str(tmp_path / "train.py"), *argv])
        assert r.exit_code == 0, r.output
    assert got == [600, 2]


# ------------------------------------------------------------------ hai-admin check

# Where `hai-admin check --json` puts each field of Policy: a new field fails here until
# check prints it.
CHECKED = {"ladder": "levels", "default_level": "default_level", "grace_seconds": "grace_seconds",
           "max_grace_seconds": "max_grace_seconds", "min_run_seconds": "min_run_seconds", "demotion": "demotion",
           "quota": "levels", "groups": "groups", "user_quota": "quota_overrides", "account_quota": "quota_overrides",
           "accounts": "accounts", "allow_auto": "allow_auto", "notice_signal": "notice_signal",
           "fcfs_preempt_levels": "fcfs_preempt_levels", "min_gpus": "min_gpus", "grow_after_seconds": "elastic",
           "lighthouse_service": "elastic", "daemon_service": "daemon", "source": "source"}


def check(path, *argv: str):
    r = CliRunner().invoke(admin.main, ["check", "--policy", str(path), *argv])
    assert r.exit_code == 0, r.output
    return r.output


def test_check_json_has_every_value_of_a_sites_policy(site):
    assert {f.name for f in dataclasses.fields(Policy)} == set(CHECKED)
    p = json.loads(check(site, "--json"))
    assert set(p) == set(CHECKED.values())
    assert p["levels"] == [{"name": "GOLD", "value": 30, "qos": "gold", "quota": 2},
                           {"name": "SILVER", "value": 10, "qos": "silver", "quota": 4},
                           {"name": "BRONZE", "value": 0, "qos": "bronze", "quota": None}]
    assert (p["default_level"], p["allow_auto"], p["notice_signal"]) == ("BRONZE", False, "TERM")
    assert (p["grace_seconds"], p["max_grace_seconds"], p["min_run_seconds"]) == (600, 1200, 120)
    assert p["demotion"] == {"from": "GOLD", "to": "SILVER", "after_seconds": 3600}
    assert p["fcfs_preempt_levels"] == ["SILVER"] and p["min_gpus"] == 4
    assert p["elastic"] == {"grow": True, "grow_after_seconds": 300, "lighthouse_service": "http://ctl.example.org:29510"}
    assert p["daemon"] == {"service": "http://ctl.example.org:6830"}
    assert p["accounts"] == ["hai", "research"]
    assert p["quota_overrides"] == {
        "users": {"hai-bob": {"GOLD": {"quota": 0, "qos": "gold.u.hai-bob"}}},
        "accounts": {"research": {"GOLD": {"quota": 8, "qos": "gold.a.research"},
                                  "SILVER": {"quota": None, "qos": "silver.a.research"}}}}
    assert p["groups"] == [
        {"name": "main", "nodes": "n[1-4]", "priority_tier": 2, "default": True, "levels": ["GOLD", "SILVER", "BRONZE"],
         "min_gpus": 4},
        {"name": "debug", "nodes": "n4", "priority_tier": 1, "default": False, "levels": ["SILVER", "BRONZE"],
         "min_gpus": 1}]


def test_check_json_spells_out_the_defaults_a_file_leaves_out(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text('default_level = "LOW"\n[levels]\nTOP = 9\nLOW = 1\n')
    p = json.loads(check(path, "--json"))
    assert p == {"source": str(path),
                 "levels": [{"name": "TOP", "value": 9, "qos": "top", "quota": None},
                            {"name": "LOW", "value": 1, "qos": "low", "quota": None}],
                 "default_level": "LOW", "allow_auto": True, "grace_seconds": 5, "max_grace_seconds": 5,
                 "min_run_seconds": 0, "notice_signal": "USR2", "demotion": None,
                 "fcfs_preempt_levels": ["TOP", "LOW"], "min_gpus": 8,
                 "elastic": {"grow": True, "grow_after_seconds": 60, "lighthouse_service": None},
                 "daemon": {"service": None}, "accounts": [],
                 "quota_overrides": {"users": {}, "accounts": {}},
                 "groups": [{"name": "gpu", "nodes": "ALL", "priority_tier": 1, "default": True,
                             "levels": ["TOP", "LOW"], "min_gpus": 8}]}
    assert p == json.loads(json.dumps(admin._policy_json(load_policy(path))))


def test_check_prints_every_value_in_force_in_words(site):
    out = check(site)
    lines = out.splitlines()
    assert lines[0] == f"{site}: valid"
    for needle in ("GOLD             30  qos gold           quota 2 node(s)",
                   "BRONZE            0  qos bronze         quota unlimited  (default level)",
                   "override for user hai-bob (QOS <level>.u.hai-bob), nodes at once: GOLD 0",
                   "override for account research (QOS <level>.a.research), nodes at once: GOLD 8, SILVER unlimited",
                   "default level BRONZE; AUTO not allowed",
                   "grace 600 s; a job may ask for up to 1200 s (max_grace_seconds); suspend notice SIGTERM",
                   "minimum run 120 s; demotion GOLD -> SILVER after 3600 s",
                   "place in line from later jobs of other users at SILVER",
                   "at least 4 GPU(s) per node; an elastic job grows into nodes idle 300 s",
                   "elastic jobs in place (hai-submit --in-place): lighthouse service http://ctl.example.org:29510",
                   "why jobs wait: the policy daemon answers at http://ctl.example.org:6830",
                   "accounts given the ladder by apply: hai, research",
                   "node group main (default): nodes n[1-4]; PriorityTier 2; takes every level; "
                   "at least 4 GPU(s) per node",
                   "node group debug: nodes n4; PriorityTier 1; takes SILVER, BRONZE; at least 1 GPU(s) per node"):
        assert needle in out, needle
    for hai_word in ("NORMAL", "HIGH", "USR2"):
        assert hai_word not in out


def test_check_of_a_quiet_policy_says_what_is_off(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text('fcfs_preempt_levels = []\n[demotion]\nenabled = false\n[elastic]\ngrow = false\n')
    out = check(path)
    assert "no demotion" in out and "at no level" in out and "elastic jobs never grow" in out
    assert "accounts given the ladder by apply: none" in out
    assert "elastic jobs in place (hai-submit --in-place): none (no lighthouse_service)" in out
    assert "why jobs wait: each command reads the whole queue (no [daemon] service)" in out


# ------------------------------------------------------------------ hai-admin timeline


def test_admin_timeline_colours_the_levels_of_the_policy_it_is_given(site, monkeypatch):
    class Accounting:
        def accounting_since(self, since, user=None):
            return [dataclasses.replace(job(1, "COMPLETED", "silver.a.research", account="research"),
                                        node_list="n1", start_time=int(time.time()) - 60,
                                        end_time=int(time.time()) - 30)]

        def nodes(self):
            return []

    monkeypatch.setattr(admin, "backend", Accounting)
    r = CliRunner().invoke(admin.main, ["timeline", "--policy", str(site), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert [name for name, _ in data["levels"]] == ["GOLD", "SILVER", "BRONZE", "other"]
    assert [i["level"] for i in data["intervals"]] == ["SILVER"]
