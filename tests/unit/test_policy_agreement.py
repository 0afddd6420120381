"""A site's policy, honoured the same everywhere (differential tests on generated policies).

Every rule of a policy is decided once, in slurm_hai/policy/ (`placement.place` is the whole
submit decision), and rendered for each component. Here hypothesis generates policies that
differ from HAI's in every section (ladder, default level, AUTO, grace and its bound, quotas
with user/account/default precedence, accounts, node groups) and requests of every kind, and
checks that the components decide alike:

a. job_submit.lua (rendered from the policy, run under lua5.3 with a stand-in for slurmctld's
   `slurm` table) == `place()`: QOS, admin comment, refusal text;
b. hai-submit's sbatch script, read by job_submit.lua, lands where `place()` says; what
   hai-submit refuses in the policy's words, `place()` refuses in the same words;
c. AUTO: the policy daemon's `rules.auto_level` with nothing running == the Lua's choice;
d. `hai-admin render`'s qos-ladder.sh == `hai-admin apply`'s plan, run against a model of
   sacctmgr on a fresh accounting database: the same QOS, every association the same access.

One lua5.3 process per generated policy runs all of its requests. Then regression tests for
each rule a site's policy used to lose on the way to one component.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from slurm_hai.jobs.request import JobRequest, RequestError, render_script, validate
from slurm_hai.policy import tags
from slurm_hai.policy.job import job_of
from slurm_hai.policy.ladder import ClusterState, desired_qos, offline_access_changes, plan_changes, template_context
from slurm_hai.policy.levels import AUTO, level_of_qos
from slurm_hai.policy.model import Policy, parse_policy
from slurm_hai.policy.placement import REFUSALS, Refused, Request, group_of, place, spank_arguments
from slurm_hai.policy.rules import auto_level
from slurm_hai.render import render
from slurm_hai.slurm.commands import change_argv

LUA = shutil.which("lua5.3")
needs_lua = pytest.mark.skipif(LUA is None, reason="no lua5.3 interpreter (apt-get install lua5.3)")
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

USERS = ("alice", "bob", "carl", "dana")  # overrides are drawn for the first three: dana never has one
ACCOUNTS = ("hai", "lab", "ops")  # overrides for the first two
GROUPS = ("gpu", "debug", "big-mem", "A100")
GPUS = "gres/gpu:64"  # every job asks for enough GPUs: the min_gpus rule is tested in test_vocabulary.py


# ------------------------------------------------------------------ running job_submit.lua


def _lua(value: object) -> str:
    """A Lua literal; strings byte by byte (\\ddd), so any text goes through unchanged."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "{" + ", ".join(_lua(v) for v in value) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_lua(v)}" for k, v in value.items()) + "}"
    text = str(value).encode()
    return '"' + "".join(chr(b) if 32 <= b < 127 and b not in b'"\\' else f"\\{b:03d}" for b in text) + '"'


DRIVER = r"""
local said = nil
slurm = {SUCCESS = 0, ERROR = -1, log_info = function() end,
         log_user = function(fmt, ...) said = string.format(fmt, ...) end}
dofile(arg[1])
local function hex(s)
  if s == nil then return "-" end
  return "x" .. string.gsub(s, ".", function(c) return string.format("%02x", string.byte(c)) end)
end
for _, desc in ipairs(dofile(arg[2])) do
  said = nil
  local rc = slurm_job_submit(desc, {}, 1000)
  print(rc .. " " .. hex(desc.qos) .. " " .. hex(desc.admin_comment) .. " " .. hex(said))
end
"""

Outcome = tuple  # (rc, qos, admin comment, what the user is told): None where Lua has nil


def run_lua(policy: Policy, descs: list[dict]) -> list[Outcome]:
    """Each job description through the policy's job_submit.lua, in one lua5.3 process."""
    def text(field: str) -> str | None:
        return None if field == "-" else bytes.fromhex(field[1:]).decode()

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "job_submit.lua").write_text(render("slurm/job_submit.lua.j2", **template_context(policy)))
        (d / "jobs.lua").write_text("return {\n" + ",\n".join(_lua(desc) for desc in descs) + "\n}\n")
        (d / "driver.lua").write_text(DRIVER)
        out = subprocess.run([LUA, str(d / "driver.lua"), str(d / "job_submit.lua"), str(d / "jobs.lua")],
                             capture_output=True, text=True, check=True).stdout
    rows = [line.split(" ") for line in out.splitlines()]
    assert len(rows) == len(descs), out
    return [(int(rc), text(qos), text(comment), text(said)) for rc, qos, comment, said in rows]


def placed(policy: Policy, req: Request, qos_in: str | None) -> Outcome:
    """What job_submit.lua must do with a job, by `place()`: its QOS and admin comment, or
    the refusal (the job's QOS untouched), or nothing for a QOS of the site's own."""
    try:
        p = place(policy, req)
    except Refused as e:
        return (-1, qos_in, None, f"hai: {e}")
    if p is None:
        return (0, qos_in, None, None)
    return (0, p.qos, f"{tags.LEVEL}={p.asked} {tags.GRACE}={p.grace}", None)


# ------------------------------------------------------------------ generated policies


def mixed_case(words) -> st.SearchStrategy[str]:
    """A word of `words` (a strategy or a list) in random case."""
    base = words if isinstance(words, st.SearchStrategy) else st.sampled_from(list(words))
    return base.flatmap(lambda w: st.lists(st.booleans(), min_size=len(w), max_size=len(w)).map(
        lambda ups: "".join(c.upper() if u else c.lower() for c, u in zip(w, ups))))


# USERS/ACCOUNTS as level names would clash with [quota.users]/[quota.accounts] (names are one
# name in any case): the loader refuses that, which is not what these tests are about.
LEVEL_NAME = st.from_regex(r"\A[A-Z][A-Z0-9_]{0,12}\Z").filter(lambda s: s not in ("AUTO", "USERS", "ACCOUNTS"))


@st.composite
def policy_data(draw) -> dict:
    """A valid policy file (as TOML's data) unlike HAI's in every section."""
    n = draw(st.integers(1, 8))
    names = draw(st.lists(LEVEL_NAME, min_size=n, max_size=n, unique=True))
    values = draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n, unique=True))
    data: dict = {"levels": dict(zip(names, values)), "demotion": False, "min_gpus": draw(st.sampled_from([0, 8]))}
    if "NORMAL" not in names or draw(st.booleans()):
        data["default_level"] = draw(mixed_case(names))
    if draw(st.booleans()):
        data["allow_auto"] = draw(st.booleans())
    grace = draw(st.integers(1, 3600))
    data["grace_seconds"] = draw(st.sampled_from([grace, f"{grace}s"] + ([f"{grace // 60}m"] if grace % 60 == 0 else [])))
    if draw(st.booleans()):
        data["max_grace_seconds"] = draw(st.integers(grace, 3600))
    quota = {draw(mixed_case([k])): v for k, v in draw(st.dictionaries(st.sampled_from(names), st.integers(0, 5))).items()}
    level_quota = st.dictionaries(st.sampled_from(names), st.integers(0, 5) | st.just("unlimited"), min_size=1)
    users = draw(st.dictionaries(st.sampled_from(USERS[:3]), level_quota, max_size=3))
    accounts = draw(st.dictionaries(st.sampled_from(ACCOUNTS[:2]), level_quota, max_size=2))
    data["quota"] = {**quota, **({"users": users} if users else {}), **({"accounts": accounts} if accounts else {})}
    data["accounts"] = draw(st.lists(st.sampled_from(ACCOUNTS), unique=True, max_size=3))
    groups = {}
    for g in draw(st.lists(st.sampled_from(GROUPS), min_size=1, max_size=3, unique=True)):
        groups[g] = {"nodes": "ALL"}
        if draw(st.booleans()):
            groups[g]["levels"] = draw(st.lists(mixed_case(names), min_size=1, max_size=n))
    default = draw(st.sampled_from([None, *groups]))
    if default:
        groups[default]["default"] = True
    data["groups"] = groups
    return data


policies = policy_data().map(parse_policy)


@dataclass(frozen=True)
class Case:
    """A submission: what place() is asked (`request`), and how the job reaches job_submit.lua."""

    request: Request
    priority_kind: str  # none, name, number, auto, junk
    grace_in_comment: bool  # hai-grace=N in the job's comment (hai-submit), else HAI_GRACE (--hai-grace)


# what the SPANK plugin makes of --hai-priority (spank/hai_spank.c, _canonical_level): it
# strips white space and passes a level's name, or AUTO, to job_submit.lua; it refuses
# anything else itself (so the Lua sees junk only from a job that bypasses the plugin)
def spank_priority(policy: Policy, text: str) -> str:
    word = text.strip()
    if word.upper() == AUTO or word == "-1":
        return AUTO
    for lvl in policy.ladder:
        if word.upper() == lvl.name:
            return word if word == text else lvl.name  # a bare name in its own case: the Lua upper-cases it
    if re.fullmatch(r"-?[0-9]+", word):
        for lvl in policy.ladder:
            if lvl.value == int(word):
                return lvl.name
    return text


def names_a_level(policy: Policy, text: str) -> bool:
    word = text.strip()
    return (word.upper() in {AUTO, *(lvl.name for lvl in policy.ladder)} or word == "-1"
            or re.fullmatch(r"-?[0-9]+", word) is not None and int(word) in {lvl.value for lvl in policy.ladder})


JUNK = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=0, max_size=8)


@st.composite
def cases(draw, policy: Policy) -> Case:
    names = [lvl.name for lvl in policy.ladder]
    qoses = [lvl.qos for lvl in policy.ladder]
    kind = draw(st.sampled_from(["none", "none", "name", "number", "auto", "junk"]))
    priority = {
        "none": st.none(),
        "name": mixed_case(names) | st.sampled_from(names).map(lambda n: f" {n.lower()} "),
        "number": st.sampled_from([str(lvl.value) for lvl in policy.ladder]),
        "auto": mixed_case([AUTO]) | st.just("-1"),
        "junk": JUNK.filter(lambda t: not names_a_level(policy, t)),
    }[kind]
    qos = draw(st.one_of(
        st.none(), mixed_case(qoses), mixed_case(["auto"]),
        st.tuples(st.sampled_from(qoses), st.sampled_from(["u", "a"]), st.sampled_from(USERS + ACCOUNTS)).map(".".join),
        st.tuples(st.sampled_from(qoses), st.sampled_from(["-x", ".u.bob.y", ".A.lab"])).map("".join),
        st.sampled_from(["site_special", "normal", "scavenger"])))
    limit = policy.grace_limit
    grace = draw(st.one_of(
        st.none(), st.none(), st.none(), st.integers(1, limit).map(str), st.integers(1, limit).map(str),
        st.sampled_from([0, limit + 1, 3601, 10 ** 12]).map(str),
        st.sampled_from(["", "2x", "-1", "1e3", " 5", "0x10", "\uff15", "10s", "05"])))
    partition = draw(st.sampled_from(["", *(g.name for g in policy.groups), "nowhere",
                                      f"nowhere,{policy.groups[-1].name}", ",".join(g.name for g in policy.groups)]))
    in_comment = grace is not None and re.fullmatch(r"[!-:<-~]*", grace) is not None and draw(st.booleans())
    req = Request(user=draw(st.sampled_from(USERS)), account=draw(st.sampled_from(ACCOUNTS)),
                  priority=draw(priority), qos=qos, nodes=draw(st.integers(1, 6)), partition=partition, grace=grace)
    return Case(req, kind, in_comment)


def job_desc(policy: Policy, case: Case) -> dict:
    """The job description slurmctld hands job_submit.lua for `case` (sbatch with the plugin)."""
    req = case.request
    desc: dict = {"user_name": req.user, "account": req.account, "min_nodes": req.nodes, "tres_per_node": GPUS}
    env = []
    if req.priority is not None:
        env.append(f"HAI_PRIORITY={spank_priority(policy, req.priority)}")
    if req.grace is not None and not case.grace_in_comment:
        env.append(f"HAI_GRACE={req.grace}")
    if env:
        desc["spank_job_env"] = env
    if req.grace is not None and case.grace_in_comment:
        desc["comment"] = f"{tags.DIR}=/home/x;{tags.GRACE}={req.grace}"
    if req.qos is not None:
        desc["qos"] = req.qos
    if req.partition:
        desc["partition"] = req.partition
    return desc


def check_auto(policy: Policy, req: Request, got: Outcome) -> bool:
    """c. where the Lua accepted AUTO, the policy daemon's AUTO (nothing running) agrees."""
    rc, qos, comment, _ = got
    if rc != 0 or comment is None or tags.parse(comment).get(tags.LEVEL) != AUTO:
        return False
    daemon = auto_level(policy, req.user, req.account, req.nodes, used={}, group=group_of(policy, req.partition))
    lua = level_of_qos(qos, policy.ladder)
    assert lua is not None and lua.name == daemon, (policy, req, got, daemon)
    return True


STATS = {"policies": 0, "requests": 0, "auto": 0, "refused": 0, "hai_submit": 0, "hai_submit_refused": 0}


# ------------------------------------------------------------------ a. and c.


@needs_lua
@SETTINGS
@given(st.data())
def test_job_submit_lua_decides_every_request_as_place_does(data):
    policy = data.draw(policies, label="policy")
    batch = data.draw(st.lists(cases(policy), min_size=30, max_size=60), label="cases")
    results = run_lua(policy, [job_desc(policy, c) for c in batch])
    STATS["policies"] += 1
    for case, got in zip(batch, results):
        req = case.request
        want = placed(policy, req, req.qos)
        STATS["requests"] += 1
        STATS["refused"] += want[0] != 0
        if case.priority_kind == "junk" and want[0] != 0 and got[0] != 0:
            # only a job without the SPANK plugin brings junk here: the Lua upper-cases what it
            # names; the words are the same
            assert got[:3] == want[:3] and got[3].upper() == want[3].upper(), (policy, case, got, want)
        else:
            assert got == want, (policy, case, got, want)
        STATS["auto"] += check_auto(policy, req, got)


@needs_lua
def test_job_submit_lua_leaves_a_site_qos_that_looks_like_a_variant_alone():
    p = parse_policy({})
    for name in ("high.x.bob", "high.", "high.u.", "high.u"):
        assert level_of_qos(name, p.ladder) is None and place(p, Request("alice", qos=name)) is None
    got = run_lua(p, [{"user_name": "alice", "account": "hai", "min_nodes": 1, "tres_per_node": GPUS, "qos": name}
                      for name in ("high.x.bob", "high.", "high.u.", "high.u")])
    assert got == [(0, name, None, None) for name in ("high.x.bob", "high.", "high.u.", "high.u")]


# ------------------------------------------------------------------ b. and c.


def sbatch_options(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([a-z-]+)=(\S*)$", script, re.M))


POLICY_WORDS = [re.compile(re.escape(text).replace("%s", ".*").replace("%d", "-?[0-9]+")) for text in REFUSALS.values()]


@needs_lua
@SETTINGS
@given(st.data())
def test_hai_submit_scripts_land_where_place_says(data):
    policy = data.draw(policies, label="policy")
    batch = [c for c in data.draw(st.lists(cases(policy), min_size=30, max_size=60), label="cases")
             if c.request.grace is None or re.fullmatch(r"-?[0-9]+", c.request.grace)]  # --grace is an integer
    descs, asked = [], []
    for case in batch:
        r = case.request
        grace = None if r.grace is None else int(r.grace)
        # what place() is asked: hai-submit's own request (its --grace as the integer it is)
        req = Request(user=r.user, account=r.account, priority=r.priority, nodes=r.nodes, partition=r.partition,
                      grace=None if grace is None else str(grace))
        job = JobRequest(script="/home/x/train.py", nodes=r.nodes, priority=r.priority, group=r.partition or None,
                         grace=grace, workdir="/tmp", job_root="/home/x/.hai")
        STATS["hai_submit"] += 1
        try:
            script = render_script(validate(job, policy), term_is_notice=False)
        except RequestError as e:
            if not any(words.fullmatch(str(e)) for words in POLICY_WORDS):
                continue  # not the policy's to decide (a node group name sbatch could not take)
            STATS["hai_submit_refused"] += 1
            with pytest.raises(Refused) as refused:
                place(policy, req)
            assert str(refused.value) == str(e), (policy, req)
            continue
        options = sbatch_options(script)
        desc = {"user_name": r.user, "account": r.account, "min_nodes": int(options["nodes"]), "tres_per_node": GPUS,
                "qos": options["qos"], "comment": options["comment"]}
        if "partition" in options:
            desc["partition"] = options["partition"]
        descs.append(desc)
        asked.append((req, options["qos"]))
    if not descs:
        return
    for (req, qos), got in zip(asked, run_lua(policy, descs)):
        want = placed(policy, req, qos)
        assert want[0] != 0 or want[1] != qos or want[2] is not None, "hai-submit's QOS is always the policy's"
        assert got == want, (policy, req, got, want)
        STATS["auto"] += check_auto(policy, req, got)


def test_a_request_wrong_twice_is_told_the_same_first():
    p = parse_policy({})
    with pytest.raises(RequestError) as told:
        validate(JobRequest(script="/home/x/train.py", priority="bogus", grace=0, workdir="/tmp", job_root="/r"), p)
    with pytest.raises(Refused) as refused:
        place(p, Request("alice", priority="bogus", grace="0"))
    assert str(told.value) == str(refused.value)


# ------------------------------------------------------------------ d. render == apply


@dataclass
class Accounting:
    """A model of slurmdbd as sacctmgr changes it: QOS names, associations (Cluster, Account,
    User, Partition, QOS as a set, DefaultQOS)."""

    qos: set[str]
    assocs: list[dict]

    def run(self, argv: list[str]) -> bool:
        """One sacctmgr command; False where it matched nothing (sacctmgr exits 1)."""
        assert argv[:2] == ["sacctmgr", "-i"], argv
        op, entity = argv[2], argv[3]
        if (op, entity) == ("add", "qos"):
            self.qos.add(argv[4])
            return True
        if (op, entity) == ("modify", "qos"):
            assert argv[5].removeprefix("name=") in self.qos, argv
            return True
        assert op == "modify" and entity in ("user", "account") and argv[4] == "where", argv
        at = argv.index("set")
        where = dict(kv.split("=", 1) for kv in argv[5:at])
        sets = dict(kv.split("=", 1) for kv in argv[at + 1:])
        assert set(sets) in ({"qos", "defaultqos"}, {"qos"}), argv
        names = set(sets["qos"].split(","))
        assert names <= self.qos, f"{argv}: no such QOS {names - self.qos}"  # sacctmgr refuses an unknown QOS
        column = {"name": "User" if entity == "user" else "Account", "account": "Account", "cluster": "Cluster",
                  "partition": "Partition"}
        matched = False
        for row in self.assocs:
            if (row["User"] != "") != (entity == "user"):
                continue
            if all(row[column[k]] == v for k, v in where.items()):
                default = sets.get("defaultqos", row["DefaultQOS"])
                # sacctmgr refuses a default QOS the association may not use, and an account a
                # default that a user below it may not use (seen on 22.05: "These associations
                # don't have access to their default qos", exit status 0, nothing changed)
                assert not default or default in names, argv
                if entity == "account" and "defaultqos" in sets:
                    for user in self.assocs:
                        if user["User"] and (user["Cluster"], user["Account"]) == (row["Cluster"], row["Account"]):
                            assert default in user["QOS"], (argv, user)
                row["QOS"], row["DefaultQOS"] = names, default
                matched = True
        return matched


def script_commands(text: str) -> list[list[str]]:
    """The sacctmgr commands a rendered qos-ladder.sh runs on a database without our QOS."""
    out = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("#") or line == "set -e":
            continue
        words = shlex.split(line)
        segments, now = [], []
        for w in words:
            if w in ("|", "||"):
                segments.append(now)
                now = []
            else:
                now.append(w)
        segments.append(now)
        if segments[0][:3] == ["sacctmgr", "-n", "-P"]:  # `show qos | grep -qxF X || add qos X`: X is new
            out.append(segments[-1])
        else:
            assert len(segments) == 1 or segments[1][:1] == ["echo"], line
            out.append(segments[0])
    return out


def fresh_database(draw, policy: Policy) -> list[dict]:
    """A new cluster's associations: some accounts (those the policy names among them), users
    in them (some in several, some with a partition's own association); no QOS yet."""
    accounts = draw(st.lists(st.sampled_from(ACCOUNTS + ("misc",)), min_size=1, max_size=4, unique=True))
    rows = []
    for account in accounts:
        rows.append({"Cluster": "hai", "Account": account, "User": "", "Partition": ""})
        for user in draw(st.lists(st.sampled_from(USERS), unique=True, max_size=4)):
            rows.append({"Cluster": "hai", "Account": account, "User": user, "Partition": ""})
            if draw(st.integers(0, 4)) == 0:
                rows.append({"Cluster": "hai", "Account": account, "User": user, "Partition": policy.groups[0].name})
    for row in rows:
        row.update(QOS=set(), DefaultQOS="")
    return rows


@SETTINGS
@given(st.data())
def test_rendered_qos_ladder_does_what_apply_does_on_a_fresh_database(data):
    policy = data.draw(policies, label="policy")
    rows = fresh_database(data.draw, policy)

    applied = Accounting(set(), [dict(r, QOS=set(r["QOS"])) for r in rows])
    state = ClusterState(assocs=[dict(r, QOS="") for r in rows])
    for change in plan_changes(policy, state):
        assert applied.run(change_argv(change)), change  # apply changes what it read: it always matches

    rendered = Accounting(set(), [dict(r, QOS=set(r["QOS"])) for r in rows])
    script = render("slurm/qos-ladder.sh.j2", changes=[(c, change_argv(c)) for c in plan_changes(policy, ClusterState())],
                    access=[(c, change_argv(c)) for c in offline_access_changes(policy)], **template_context(policy))
    for argv in script_commands(script):
        rendered.run(argv)

    assert rendered.qos == applied.qos == {spec.name for spec in desired_qos(policy)}
    adds = [c.name for c in plan_changes(policy, ClusterState()) if c.op == "add"]
    assert adds == [spec.name for spec in desired_qos(policy)]
    assert rendered.assocs == applied.assocs, policy


# ------------------------------------------------------------------ regressions: one per rule of the issue


def lua_one(policy: Policy, **desc) -> Outcome:
    return run_lua(policy, [{"account": "hai", "min_nodes": 1, "tres_per_node": GPUS, **desc}])[0]


def hai_submit(policy: Policy, **fields) -> dict[str, str]:
    """The #SBATCH options of hai-submit's script for a request."""
    job = JobRequest(script="/home/x/train.py", workdir="/tmp", job_root="/home/x/.hai", **fields)
    return sbatch_options(render_script(validate(job, policy), term_is_notice=False))


METALS = parse_policy({"levels": {"GOLD": 30, "SILVER": 10, "BRONZE": 0}, "default_level": "SILVER"})


@needs_lua
def test_a_site_ladder_is_taken_by_hai_submit_and_job_submit_lua():
    for asked in ("gold", "GOLD", "30", "Bronze"):
        options = hai_submit(METALS, priority=asked)
        level = place(METALS, Request("alice", priority=asked)).level
        assert options["qos"] == level.lower()
        got = lua_one(METALS, user_name="alice", qos=options["qos"], comment=options["comment"])
        assert got == (0, level.lower(), f"{tags.LEVEL}={level} {tags.GRACE}=5", None)
    assert lua_one(METALS, user_name="alice", spank_job_env=["HAI_PRIORITY=GOLD"])[:2] == (0, "gold")
    with pytest.raises(RequestError, match=r"unknown priority level 'HIGH'; use one of GOLD\(30\), SILVER\(10\), "
                                           r"BRONZE\(0\) or AUTO"):
        hai_submit(METALS, priority="HIGH")


@needs_lua
def test_a_job_in_place_has_its_parts_tag_in_the_admin_comment_a_malformed_one_is_left_out():
    """Accounting keeps the admin comment, not the job's: the timeline finds the parts by it."""
    metals = parse_policy({"levels": {"GOLD": 30, "SILVER": 10, "BRONZE": 0}, "default_level": "SILVER",
                           "elastic": {"lighthouse_service": "http://head:29600"}})
    options = hai_submit(metals, nodes="2:4", in_place=True)
    assert options["array"] == "0-3"
    got = lua_one(metals, user_name="alice", qos=options["qos"], comment=options["comment"])
    stamped, submission = got[2].rsplit(" ", 1)
    assert got[:2] == (0, "silver") and stamped == f"{tags.LEVEL}=SILVER {tags.GRACE}=5 {tags.PARTS}=2:4"
    # the mark of the submission its parts claim the job's directory with (part_task.py)
    assert re.fullmatch(rf"{tags.SUBMISSION}=\d{{10}}\.1\.\d{{1,6}}", submission), submission
    again = run_lua(metals, [{"account": "hai", "min_nodes": 1, "tres_per_node": GPUS, "user_name": "alice",
                              "comment": options["comment"]}] * 2)
    assert again[0][2] != again[1][2]  # each submission its own
    task = SimpleNamespace(job_id=12, array_job_id=10, comment="")  # as accounting has it: no job comment
    assert job_of(SimpleNamespace(**vars(task), admin_comment=got[2])) == 10
    for bad in ("4:2", "0:2", "2", "a:b", "2:4:1"):
        got = lua_one(metals, user_name="alice", comment=f"{tags.PARTS}={bad}")
        assert got[2] == f"{tags.LEVEL}=SILVER {tags.GRACE}=5", bad
    assert job_of(SimpleNamespace(**vars(task), admin_comment=got[2])) == 12  # a task of a plain array


@needs_lua
def test_the_default_level_is_the_policys_for_hai_submit_and_plain_sbatch():
    low = parse_policy({"default_level": "LOW"})
    assert hai_submit(low)["qos"] == "low"
    assert lua_one(low, user_name="alice") == (0, "low", f"{tags.LEVEL}=LOW {tags.GRACE}=5", None)  # plain sbatch
    assert place(low, Request("alice")).qos == "low"


@needs_lua
def test_a_grace_in_minutes_is_the_default_and_the_bound_everywhere():
    ten = parse_policy({"grace_seconds": "10m"})
    assert ten.grace_seconds == ten.grace_limit == 600
    options = hai_submit(ten)  # no --grace: the policy's
    assert options["comment"].endswith(f";{tags.GRACE}=600")
    assert lua_one(ten, user_name="alice", comment=options["comment"])[2] == f"{tags.LEVEL}=NORMAL {tags.GRACE}=600"
    assert lua_one(ten, user_name="alice")[2] == f"{tags.LEVEL}=NORMAL {tags.GRACE}=600"
    assert lua_one(ten, user_name="alice", spank_job_env=["HAI_GRACE=600"])[0] == 0
    rc, _, _, said = lua_one(ten, user_name="alice", spank_job_env=["HAI_GRACE=601"])
    assert (rc, said) == (-1, "hai: " + REFUSALS["grace"] % ("601", 1, 600))
    with pytest.raises(RequestError, match="from 1 to 600"):
        hai_submit(ten, grace=601)
    assert spank_arguments(ten)["max_grace"] == 600
    conf = render("slurm/plugstack.conf.j2", spank_so="/usr/lib/hai_spank.so", **template_context(ten))
    assert " max_grace=600 " in conf
    assert {spec.grace_seconds for spec in desired_qos(ten)} == {600}


def test_an_account_override_reaches_the_rendered_qos_ladder():
    p = parse_policy({"accounts": ["hai", "lab"], "quota": {"HIGH": 2, "accounts": {"lab": {"HIGH": 4}},
                                                              "users": {"ann": {"NORMAL": 1}}}})
    script = render("slurm/qos-ladder.sh.j2", changes=[(c, change_argv(c)) for c in plan_changes(p, ClusterState())],
                    access=[(c, change_argv(c)) for c in offline_access_changes(p)], **template_context(p))
    lines = script.splitlines()

    def access(entity: str, where: str) -> set[str]:
        line = next(x for x in lines if x.startswith(f"sacctmgr -i modify {entity} where {where} set "))
        assert line.endswith(' || echo "  (no association to change)"')
        return set(re.search(r" qos=(\S+)", line).group(1).split(","))

    assert "high.a.lab" in access("account", "name=lab") and "high" not in access("account", "name=lab")
    assert "high.a.lab" in access("user", "account=lab")
    assert "high" in access("account", "name=hai") and "high.a.lab" not in access("account", "name=hai")
    assert {"normal.u.ann", "high.a.lab"} <= access("user", "name=ann account=lab")
    assert {"normal.u.ann", "high"} <= access("user", "name=ann account=hai")
    assert any(line.endswith("sacctmgr -i add qos high.a.lab") for line in lines)


@needs_lua
def test_auto_in_a_group_of_some_levels_is_the_same_in_the_lua_and_the_daemon():
    p = parse_policy({"groups": {"gpu": {"nodes": "ALL", "default": True},
                                 "debug": {"nodes": "ALL", "levels": ["LOW", "NORMAL"]}}})
    debug = group_of(p, "debug")
    assert auto_level(p, "alice", "hai", 1, used={}, group=debug) == "NORMAL"
    assert lua_one(p, user_name="alice", partition="debug", qos="auto")[:3] == (
        0, "normal", f"{tags.LEVEL}=AUTO {tags.GRACE}=5")
    assert lua_one(p, user_name="alice", partition="debug", spank_job_env=["HAI_PRIORITY=AUTO"])[1] == "normal"
    assert lua_one(p, user_name="alice", qos="auto")[1] == "extreme_high"  # the default group takes every level
    rc, _, _, said = lua_one(p, user_name="alice", partition="debug", qos="high")
    assert (rc, said) == (-1, "hai: node group debug takes jobs at LOW, NORMAL only; use one of those levels or AUTO")
