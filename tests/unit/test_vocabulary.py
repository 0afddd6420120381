"""One owner of the HAI vocabulary: the rendered job_submit.lua and the SPANK plugin's
defaults must say what policy/ says. The Lua runs here under lua5.3 (the interpreter the
local cluster installs) with a stand-in for slurmctld's `slurm` table."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from slurm_hai.jobs.request import JobRequest, RequestError, render_script, validate
from slurm_hai.jobs.submit import prepare
from slurm_hai.policy import tags
from slurm_hai.policy.ladder import template_context
from slurm_hai.policy.levels import level_of_qos
from slurm_hai.policy.limits import MAX_GRACE
from slurm_hai.policy.model import Policy, parse_policy
from slurm_hai.policy.placement import Refused, Request, place
from slurm_hai.policy.rules import auto_level
from slurm_hai.render import render
from slurm_hai.slurm.base import NodeInfo

REPO = Path(__file__).resolve().parents[2]
POLICY = parse_policy({
    "default_level": "NORMAL", "accounts": ["hai", "lab"], "allow_auto": True,
    "quota": {"EXTREME_HIGH": 1, "HIGH": 2, "NORMAL": 4,
              "users": {"bob": {"EXTREME_HIGH": 0, "HIGH": 1, "NORMAL": 2}, "ann": {"HIGH": "unlimited"}},
              "accounts": {"lab": {"HIGH": 3}}},
})
USERS = (("alice", "hai"), ("bob", "hai"), ("ann", "lab"), ("carl", "lab"))


def run_lua(tmp_path: Path, cases: list[dict], policy: Policy = POLICY) -> list[tuple[str, str, str, str]]:
    """Each case through slurm_job_submit; (rc, qos, admin_comment, message) per case."""
    lua = tmp_path / "job_submit.lua"
    lua.write_text(render("slurm/job_submit.lua.j2", **template_context(policy)))

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
    return "0", POLICY.qos_for(level, user, account), f"{tags.LEVEL}={wanted} {tags.GRACE}={POLICY.grace_seconds}"


def test_job_submit_lua_places_every_job_where_policy_says(tmp_path):
    cases, wants = [], []
    for user, account in USERS:
        for wanted in [lvl.name for lvl in POLICY.ladder] + ["AUTO"]:
            for nodes in (1, 2, 3, 5):
                cases.append({"user_name": user, "account": account, "min_nodes": nodes,
                              "tres_per_node": "gres/gpu:8", "spank_job_env": [f"HAI_PRIORITY={wanted.lower()}"]})
                wants.append(expected(user, account, wanted, nodes))
    results = run_lua(tmp_path, cases)
    assert len(results) == len(cases)
    for case, want, (rc, qos, comment, said) in zip(cases, wants, results):
        if want is None:  # in placement.REFUSALS' words
            request = Request(case["user_name"], case["account"], priority=case["spank_job_env"][0].split("=")[1],
                              nodes=case["min_nodes"])
            with pytest.raises(Refused) as refused:
                place(POLICY, request)
            assert rc == "-1" and "quota" in said and said == f"hai: {refused.value}", (case, qos, said)
        else:
            assert (rc, qos, comment) == want, case


def test_job_submit_lua_decodes_a_qos_as_policy_does(tmp_path):
    names = ["high", "HIGH", "normal.u.bob", "high.a.lab", "site_special", "auto"]
    results = run_lua(tmp_path, [{"user_name": "alice", "account": "hai", "min_nodes": 1, "tres_per_node": "gres:gpu:8",
                                  "qos": n} for n in names])
    for name, (rc, qos, comment, _said) in zip(names, results):
        lvl = level_of_qos(name, POLICY.ladder)
        if name == "auto":
            assert comment == f"{tags.LEVEL}=AUTO {tags.GRACE}=5"
        elif lvl is None:  # a site's own QOS is left to Slurm: no level, no tag
            assert (rc, qos, comment) == ("0", name, "nil")
        else:
            assert comment == f"{tags.LEVEL}={lvl.name} {tags.GRACE}=5" and qos == POLICY.qos_for(lvl.name, "alice", "hai"), name


GRACE_POLICY = parse_policy({"grace_seconds": 5, "max_grace_seconds": 60})


def test_job_submit_lua_gives_a_job_the_grace_it_asked_up_to_the_policy_maximum(tmp_path):
    job = {"user_name": "alice", "account": "hai", "min_nodes": 1, "tres_per_node": "gres/gpu:8"}
    asked = [  # (how the job asks, the grace it gets; None: refused)
        ({}, 5), ({"spank_job_env": ["HAI_GRACE=20"]}, 20), ({"spank_job_env": ["HAI_GRACE=60"]}, 60),
        ({"comment": f"{tags.DIR}=/h/alice;{tags.GRACE}=20"}, 20),  # hai-submit's comment
        ({"comment": f"{tags.GRACE}=30", "spank_job_env": ["HAI_GRACE=20"]}, 20),  # --hai-grace wins
        ({"spank_job_env": ["HAI_GRACE=61"]}, None), ({"comment": f"{tags.GRACE}=61"}, None),
        ({"spank_job_env": ["HAI_GRACE=0"]}, None), ({"comment": f"{tags.GRACE}=2x"}, None),
        ({"comment": f"{tags.GRACE}=-1"}, None),
    ]
    results = run_lua(tmp_path, [{**job, **how} for how, _ in asked], GRACE_POLICY)
    for (how, want), (rc, _qos, comment, said) in zip(asked, results):
        if want is None:
            assert rc == "-1" and "from 1 to 60" in said and "max_grace_seconds" in said, how
        else:
            assert rc == "0" and tags.parse(comment)[tags.GRACE] == str(want), how


def test_job_submit_lua_reads_a_megabyte_of_a_users_comment_and_grace_in_linear_time(tmp_path):
    """job_submit.lua runs inside slurmctld: what a user writes into a job's comment or
    --hai-grace is read in one linear pass (no pattern that backtracks), and a grace that is
    a megabyte of digits is refused like any other grace out of range."""
    import time

    job = {"user_name": "alice", "account": "hai", "min_nodes": 1, "tres_per_node": "gres/gpu:8"}
    noise = ";".join(f"{tags.DIR}=/h/{i}{'=' * 7}" for i in range(40_000))[: 1 << 20]
    cases = [{**job, "comment": f"{noise};{tags.GRACE}=20"},
             {**job, "comment": f"{tags.GRACE}={'9' * (1 << 20)}"},
             {**job, "spank_job_env": ["HAI_GRACE=" + "1" * (1 << 20)]}]
    started = time.monotonic()
    results = run_lua(tmp_path, cases, GRACE_POLICY)
    assert time.monotonic() - started < 10
    assert results[0][0] == "0" and tags.parse(results[0][2])[tags.GRACE] == "20"
    assert [rc for rc, *_ in results[1:]] == ["-1", "-1"]


def test_the_qos_grace_time_is_the_policy_maximum_and_the_default_is_unchanged():
    from slurm_hai.policy.ladder import desired_qos

    assert {q.grace_seconds for q in desired_qos(GRACE_POLICY)} == {60}
    assert {q.grace_seconds for q in desired_qos(POLICY)} == {POLICY.grace_seconds}  # no max: as before


def test_hai_submit_asks_its_grace_in_the_comment_and_refuses_more_than_the_policy_allows(tmp_path):
    req = JobRequest(script=str(tmp_path / "t.py"), job_root="/r", grace=20)
    script = render_script(validate(req, GRACE_POLICY), term_is_notice=False)
    assert f"#SBATCH --comment={tags.DIR}=/r;{tags.GRACE}=20\n" in script
    assert "--grace=20 " in script
    default = validate(JobRequest(script="t.py", job_root="/r"), parse_policy({"grace_seconds": 7}))
    assert default["grace"] == 7
    with pytest.raises(RequestError, match="from 1 to 60 .*max_grace_seconds"):
        validate(JobRequest(script="t.py", job_root="/r", grace=61), GRACE_POLICY)


@pytest.mark.parametrize("data,msg", [
    ({"grace_seconds": 10, "max_grace_seconds": 5}, "at least grace_seconds"),
    ({"max_grace_seconds": MAX_GRACE + 1}, f"expected from 1 to {MAX_GRACE} seconds"),
])
def test_a_max_grace_below_the_grace_or_above_the_contract_is_refused(data, msg):
    from slurm_hai.policy.model import PolicyError

    with pytest.raises(PolicyError, match=msg):
        parse_policy(data)


@pytest.mark.parametrize("priority", ["AUTO", "auto", "-1"])
def test_auto_is_left_to_the_cluster_not_decided_by_the_client(tmp_path, priority):
    """hai-submit -p AUTO asks Slurm for the QOS "auto": job_submit.lua places the job and the
    policy daemon moves it every cycle; nothing on the login node picks a level."""
    req = JobRequest(script=str(tmp_path / "train.py"), priority=priority, job_root=str(tmp_path))
    context = validate(req, POLICY)
    assert (context["qos"], context["level"]) == ("auto", "AUTO")
    assert "#SBATCH --qos=auto\n" in render_script(context, term_is_notice=False)


# The 8-GPU rule: HAI's 8 at the top, a test partition that takes anything, a big-node group.
GPU_POLICY = parse_policy({"min_gpus": 8, "groups": {"gpu": {"nodes": "g[1-4]"}, "test": {"nodes": "t1", "min_gpus": 0},
                                                     "big": {"nodes": "b[1-2]", "min_gpus": 16}}})
# What a job's GPUs per node look like to job_submit.lua on each Slurm: 22.05 writes
# "gres:gpu:N" for --gres=gpu:N and --gpus-per-node=N, 23.02 and later "gres/gpu:N"
# (src/common/slurm_opt.c, gres_prepend_tres_type); --gpus=N is tres_per_job over the nodes.
GPU_REQUESTS = [
    ({}, 0),
    ({"tres_per_node": "gres:gpu:8"}, 8),
    ({"tres_per_node": "gres/gpu:8"}, 8),
    ({"tres_per_node": "gres/gpu:4"}, 4),
    ({"tres_per_node": "gres/gpu:a100:16"}, 16),
    ({"tres_per_node": "gres:gpu:a100:2"}, 2),
    ({"tres_per_node": "gres/gpu"}, 1),
    ({"tres_per_node": "gres/gpu:v100"}, 1),
    ({"tres_per_node": "gres/shard:8"}, 0),
    ({"tres_per_node": "gres/gpu:8,gres/shard:2"}, 8),
    ({"tres_per_job": "gres/gpu:16", "min_nodes": 2}, 8),
    ({"tres_per_job": "gres:gpu:12", "min_nodes": 2}, 6),
    ({"tres_per_task": "gres/gpu:1", "ntasks_per_node": 8}, 8),
    ({"tres_per_task": "gres/gpu:2", "num_tasks": 4, "min_nodes": 2}, 4),
]


def test_job_submit_lua_refuses_too_few_gpus_per_node_as_policy_says(tmp_path):
    cases, wants = [], []
    for request, gpus in GPU_REQUESTS:
        for partition in (None, "gpu", "test", "big", "site_own", "test,big"):
            cases.append({"user_name": "alice", "account": "hai", "min_nodes": 1, "partition": partition, **request})
            groups = (partition or GPU_POLICY.default_group.name).split(",")
            wants.append(next((r for g in groups for r in [GPU_POLICY.min_gpus_refusal(g, gpus)] if r), None))
    results = run_lua(tmp_path, cases, GPU_POLICY)
    for case, want, (rc, _qos, _comment, said) in zip(cases, wants, results):
        if want is None:
            assert rc == "0" and said == "", (case, said)
        else:
            assert (rc, said) == ("-1", f"hai: {want}"), case
    assert sum(w is not None for w in wants) > 10 and sum(w is None for w in wants) > 10


def test_min_gpus_defaults_to_hai_and_groups_override_it():
    assert parse_policy({}).min_gpus == 8 and parse_policy({}).min_gpus_for(None) == 8
    assert GPU_POLICY.min_gpus_for("gpu") == 8 and GPU_POLICY.min_gpus_for(None) == 8
    assert GPU_POLICY.min_gpus_for("test") == 0 and GPU_POLICY.min_gpus_for("big") == 16
    assert GPU_POLICY.min_gpus_for("site_own") == 8  # a partition the policy does not name: the top level
    assert parse_policy({"min_gpus": 0}).min_gpus_refusal(None, 0) is None
    assert GPU_POLICY.min_gpus_refusal("gpu", 4) == (
        "node group gpu takes jobs of at least 8 GPUs per node (whole nodes); this job asks for 4 per node: "
        "use --gpus-per-node=8")


class _Nodes:
    """What hai-submit asks Slurm before submitting: partitions and nodes (GPU_POLICY's groups)."""

    name = "fake"

    def partitions(self) -> list[dict[str, str]]:
        return [{"PartitionName": g.name, "Default": "YES" if g.default else "NO"} for g in GPU_POLICY.groups]

    def nodes(self) -> list[NodeInfo]:
        gpus = {"gpu": 8, "test": 8, "big": 16}
        return [NodeInfo(f"{g.name}{i}", gpus[g.name], frozenset([g.name])) for g in GPU_POLICY.groups for i in (1, 2)]


@pytest.mark.parametrize("group,gpus", [(None, 0), (None, 4), (None, None), ("gpu", 2), ("test", 0), ("big", 8),
                                        ("big", None), ("big", 16)])
def test_hai_submit_refuses_too_few_gpus_in_job_submit_luas_words(tmp_path, group, gpus):
    """hai-submit refuses before sbatch what job_submit.lua would refuse, with the same line
    (its default --gpus-per-node is what the group's nodes have)."""
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    req = JobRequest(script=str(script), group=group, gpus_per_node=gpus, job_root=str(tmp_path))
    try:
        prepared = prepare(req, _Nodes(), dry_run=True, policy=GPU_POLICY)  # type: ignore[arg-type]
        python = None
    except RequestError as e:
        python = str(e)
    asked = prepared.context["gpus"] if python is None else req.gpus_per_node
    case = {"user_name": "alice", "account": "hai", "min_nodes": 1, "partition": group}
    if asked:
        case["tres_per_node"] = f"gres/gpu:{asked}"
    [(rc, _, _, said)] = run_lua(tmp_path, [case], GPU_POLICY)
    assert python == (said.removeprefix("hai: ") or None), (python, said)
    assert rc == ("-1" if python else "0")
