"""One owner of the HAI vocabulary: the rendered job_submit.lua and the SPANK plugin's
defaults must say what policy/ says. The Lua runs here under lua5.3 (the interpreter the
local cluster installs) with a stand-in for slurmctld's `slurm` table."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from slurm_hai.jobs.request import JobRequest, render_script, validate
from slurm_hai.policy import tags
from slurm_hai.policy.ladder import template_context
from slurm_hai.policy.levels import DEFAULT_LADDER, ladder_arg, level_of_qos
from slurm_hai.policy.limits import MASTER_PORT_BASE, MASTER_PORT_SPAN, MAX_GRACE
from slurm_hai.policy.model import parse_policy
from slurm_hai.policy.rules import auto_level
from slurm_hai.render import render

REPO = Path(__file__).resolve().parents[2]
POLICY = parse_policy({
    "default_level": "NORMAL", "accounts": ["hai", "lab"], "allow_auto": True,
    "quota": {"EXTREME_HIGH": 1, "HIGH": 2, "NORMAL": 4,
              "users": {"bob": {"EXTREME_HIGH": 0, "HIGH": 1, "NORMAL": 2}, "ann": {"HIGH": "unlimited"}},
              "accounts": {"lab": {"HIGH": 3}}},
})
USERS = (("alice", "hai"), ("bob", "hai"), ("ann", "lab"), ("carl", "lab"))


def run_lua(tmp_path: Path, cases: list[dict]) -> list[tuple[str, str, str, str]]:
    """Each case through slurm_job_submit; (rc, qos, admin_comment, message) per case."""
    lua = tmp_path / "job_submit.lua"
    lua.write_text(render("slurm/job_submit.lua.j2", **template_context(POLICY)))

    def literal(value: object) -> str:
        if value is None:
            return "nil"
        if isinstance(value, int):
            return str(value)
        if isinstance(value, list):
            return "{" + ", ".join(literal(v) for v in value) + "}"
        return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'

    rows = ",\n".join("{" + ", ".join(f"{k} = {literal(v)}" for k, v in case.items()) + "}" for case in cases)
    driver = tmp_path / "driver.lua"
    driver.write_text(f"""
local said = ""
slurm = {{SUCCESS = 0, ERROR = -1, log_info = function() end,
         log_user = function(fmt, ...) said = string.format(fmt, ...) end}}
dofile({literal(str(lua))})
for _, desc in ipairs({{ {rows} }}) do
  said = ""
  local rc = slurm_job_submit(desc, {{}}, 0)
  print(rc .. "|" .. tostring(desc.qos) .. "|" .. tostring(desc.admin_comment) .. "|" .. said)
end
""")
    out = subprocess.run(["lua5.3", str(driver)], capture_output=True, text=True, check=True).stdout
    return [tuple(line.split("|", 3)) for line in out.splitlines()]  # type: ignore[misc]


def expected(user: str, account: str, wanted: str, nodes: int) -> tuple[str, str, str] | None:
    """(rc, qos, admin comment) by policy/'s rules, None where the job must be refused."""
    level = wanted
    if wanted == "AUTO":
        can_ever = [lvl.name for lvl in POLICY.levels_high_to_low
                    if POLICY.quota_for(lvl.name, user, account) is None
                    or nodes <= POLICY.quota_for(lvl.name, user, account)]
        if not can_ever:
            return None
        level = auto_level(POLICY, user, account, nodes, used={})  # nothing running yet
    quota = POLICY.quota_for(level, user, account)
    if quota is not None and nodes > quota:
        return None
    return "0", POLICY.qos_for(level, user, account), f"{tags.LEVEL}={wanted}"


def test_job_submit_lua_places_every_job_where_policy_says(tmp_path):
    cases, wants = [], []
    for user, account in USERS:
        for wanted in [lvl.name for lvl in POLICY.ladder] + ["AUTO"]:
            for nodes in (1, 2, 3, 5):
                cases.append({"user_name": user, "account": account, "min_nodes": nodes,
                              "spank_job_env": [f"HAI_PRIORITY={wanted.lower()}"]})
                wants.append(expected(user, account, wanted, nodes))
    results = run_lua(tmp_path, cases)
    assert len(results) == len(cases)
    for case, want, (rc, qos, comment, said) in zip(cases, wants, results):
        if want is None:
            assert rc == "-1" and "quota" in said, (case, qos, said)
        else:
            assert (rc, qos, comment) == want, case


def test_job_submit_lua_decodes_a_qos_as_policy_does(tmp_path):
    names = ["high", "HIGH", "normal.u.bob", "high.a.lab", "site_special", "auto"]
    results = run_lua(tmp_path, [{"user_name": "alice", "account": "hai", "min_nodes": 1, "qos": n} for n in names])
    for name, (rc, qos, comment, said) in zip(names, results):
        lvl = level_of_qos(name, POLICY.ladder)
        if name == "auto":
            assert comment == f"{tags.LEVEL}=AUTO"
        elif lvl is None:  # a site's own QOS is left to Slurm: no level, no tag
            assert (rc, qos, comment) == ("0", name, "nil")
        else:
            assert comment == f"{tags.LEVEL}={lvl.name}" and qos == POLICY.qos_for(lvl.name, "alice", "hai"), name


def test_the_spank_plugin_defaults_are_the_policy_limits():
    source = (REPO / "spank" / "hai_spank.c").read_text()
    defines = dict(re.findall(r"#define (HAI_DEFAULT_\w+) (\d+)L", source))
    assert int(defines["HAI_DEFAULT_MAX_GRACE"]) == MAX_GRACE
    assert int(defines["HAI_DEFAULT_PORT_BASE"]) == MASTER_PORT_BASE
    assert int(defines["HAI_DEFAULT_PORT_SPAN"]) == MASTER_PORT_SPAN
    levels = re.search(r'#define HAI_DEFAULT_LEVELS \\\n((?:\s*"[^"]*"\s*\\?\n)+)', source)
    assert levels, "HAI_DEFAULT_LEVELS not found in hai_spank.c"
    assert "".join(re.findall(r'"([^"]*)"', levels.group(1))) == ladder_arg(DEFAULT_LADDER)


@pytest.mark.parametrize("priority", ["AUTO", "auto", "-1"])
def test_auto_is_left_to_the_cluster_not_decided_by_the_client(tmp_path, priority):
    """hai-submit -p AUTO asks Slurm for the QOS "auto": job_submit.lua places the job and the
    policy daemon moves it every cycle; nothing on the login node picks a level."""
    req = JobRequest(script=str(tmp_path / "train.py"), priority=priority, job_root=str(tmp_path))
    context = validate(req)
    assert (context["qos"], context["level"]) == ("auto", "AUTO")
    assert "#SBATCH --qos=auto\n" in render_script(context, term_is_notice=False)
