"""Where a job lands when it is submitted: its level, QOS, quota and grace (pure; no I/O).

One decision, many renderings. Every rule a submission meets is decided here, once:

- the level a request names (`request_level`: a name or number of the policy's ladder, or
  AUTO), and the policy's default level when it names none;
- AUTO at submission (`auto_at_submit`): the highest level of the job's node group whose
  quota can hold the job; the policy daemon walks the same `auto_levels` each cycle
  (policy/rules.py), counting what runs;
- the QOS and the quota of a level for a user in an account (`Policy.qos_for`,
  `Policy.quota_for`: user, then account, then the default);
- the node group of a job (`group_of`) and the levels it takes;
- the grace a job gets (`grace_of`: what it asked, from MIN_GRACE to the policy's limit,
  else grace_seconds).

`place(policy, request)` is the whole decision, as job_submit.lua makes it inside slurmctld.
The other parts do not decide again: job_submit.lua is rendered from `lua_tables(policy)`
(the tables below, and the refusal texts of REFUSALS, printf formats that Python's `%` and
Lua's string.format read alike); the SPANK plugin is started with `spank_arguments(policy)`;
hai-submit calls `request_level` and `grace_of`; both tell a mistyped level the nearest name
(`level_hint`, which the plugin counts alike). tests/unit/test_policy_agreement.py checks, on
generated policies and requests, that they all decide alike (tests/unit/test_spank_policy.py,
the plugin).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable

from .levels import AUTO, Level, LevelError, level_of_qos, parse_level
from .limits import MASTER_PORT_BASE, MASTER_PORT_SPAN, MIN_GRACE
from .model import NodeGroup, Policy

# What a refused submission is told (after "hai: "): printf formats, the same words from
# hai-submit and from job_submit.lua.
REFUSALS = {
    "unknown_level": "unknown priority level '%s'; use one of %s or AUTO",
    "no_auto": "priority AUTO is not allowed on this cluster; use one of %s",
    "group_levels": "node group %s takes jobs at %s only; use one of those levels or AUTO",
    "no_level_fits": "%d nodes exceed your quota at every level of node group %s; ask for fewer nodes",
    "quota_zero": "your quota at %s is 0 nodes: that level is not open to you; use a lower level or AUTO",
    "over_quota": "%d nodes at %s exceed your quota of %d nodes at that level; ask for at most %d or use a lower level",
    "grace": "grace '%s' is not allowed on this cluster; ask for whole seconds from %d to %d (the policy's "
             "max_grace_seconds)",
}


# How near a mistyped name must come to one it is told (difflib's ratio, `closest`)
NEAR_MISS = 0.6


class Refused(ValueError):
    """A submission the policy refuses; the message is one of REFUSALS, filled in."""


@dataclass(frozen=True)
class Request:
    """What a submission asks of the policy. `priority`: a level name or number, or AUTO
    (hai-submit -p, sbatch --hai-priority); `qos`: sbatch --qos, read when `priority` is None
    (a level's QOS, a variant of it, or "auto"); neither: the policy's default level.
    `partition`: Slurm's partition list ("" for the default group). `grace`: what the job
    asked, as text (None: the policy's grace_seconds)."""

    user: str
    account: str = ""
    priority: str | None = None
    qos: str | None = None
    nodes: int = 1
    partition: str = ""
    grace: str | None = None


@dataclass(frozen=True)
class Placement:
    asked: str  # the submit-time level stamped on the job (AUTO for AUTO)
    level: str  # the level it starts at
    qos: str
    quota: int | None  # nodes at once for this user at `level`; None: unlimited
    grace: int


def choices(policy: Policy) -> str:
    """The ladder as users may name it: `GOLD(30), SILVER(10), BRONZE(0)`."""
    return ", ".join(f"{lvl.name}({lvl.value})" for lvl in policy.levels_high_to_low)


def request_level(policy: Policy, text: str | int | None) -> Level | str:
    """The level (or AUTO) a request names, by name (any case) or number; None: the policy's
    default level. Refused for a name outside the ladder, or AUTO where the policy forbids it."""
    if text is None:
        return policy.level(policy.default_level)
    try:
        level = parse_level(text, policy.ladder)
    except LevelError:
        raise Refused(REFUSALS["unknown_level"] % (str(text).strip(), choices(policy))) from None
    if level == AUTO and not policy.allow_auto:
        raise Refused(REFUSALS["no_auto"] % choices(policy))
    return level


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The one of `choices` that `word` comes nearest, in any case, as difflib's
    get_close_matches(n=1) finds it: the highest ratio (twice the characters its matching
    blocks hold, over both lengths) of at least NEAR_MISS, of equal ones the last in order of
    the upper-case names; None when none comes that near. The SPANK plugin's `_closest` counts
    alike, without difflib's autojunk: that takes a word of 200 characters or more, which
    comes near no level's name (at most 31) anyway."""
    by_upper = {c.upper(): c for c in choices}
    found = difflib.get_close_matches(word.upper(), list(by_upper), n=1, cutoff=NEAR_MISS)
    return by_upper[found[0]] if found else None


def level_hint(policy: Policy, text: str) -> str:
    """What a refusal of `text` by request_level adds for the user who typed it (hai-submit
    -p, sbatch --hai-priority): "; did you mean HIGH?" where `text`, stripped, names no level
    but comes near one (or AUTO, where the policy allows it), else "" (also for text outside
    ASCII: a level's name is ASCII, and the plugin compares bytes). job_submit.lua is not
    asked: the plugin hands it only levels it took."""
    try:
        parse_level(text, policy.ladder)
        return ""  # a level, or AUTO: refused for another reason
    except LevelError:
        pass
    names = [lvl.name for lvl in policy.ladder] + ([AUTO] if policy.allow_auto else [])
    near = closest(text.strip(), names) if text.isascii() else None
    return f"; did you mean {near}?" if near else ""


def grace_of(policy: Policy, asked: str | int | None) -> int:
    """The grace a job gets: what it asked (whole seconds, MIN_GRACE to the policy's
    `grace_limit`), else grace_seconds."""
    if asked is None:
        return policy.grace_seconds
    text = str(asked)
    if not (text.isascii() and text.isdigit()) or not MIN_GRACE <= int(text) <= policy.grace_limit:
        raise Refused(REFUSALS["grace"] % (text, MIN_GRACE, policy.grace_limit))
    return int(text)


def stamped_grace(policy: Policy, stamp: str | None) -> int:
    """A submitted job's grace: job_submit.lua's `hai-grace` stamp (what it asked, checked
    against the policy at submission), else grace_seconds (a job of before, or one stamped
    under another policy: not this one's to honour)."""
    try:
        return grace_of(policy, stamp)
    except Refused:
        return policy.grace_seconds


def group_of(policy: Policy, partition: str) -> NodeGroup | None:
    """The node group whose rules a job in `partition` (Slurm's comma list) follows: the
    first one the policy names; the default group when it names none; None for a job only
    in partitions the policy does not know (the site's own)."""
    if not partition:
        return policy.default_group
    for name in partition.split(","):
        g = policy.group(name)
        if g is not None:
            return g
    return None


def auto_levels(policy: Policy, group: NodeGroup | None) -> list[Level]:
    """The levels AUTO may choose in `group`, highest first."""
    return [lvl for lvl in policy.levels_high_to_low if group is None or group.accepts(lvl.name)]


def auto_at_submit(policy: Policy, user: str, account: str, nodes: int, group: NodeGroup | None) -> str | None:
    """AUTO at submission: the highest level of `group` whose quota can ever hold `nodes`
    (nothing of the user's is counted yet); None when none can."""
    for lvl in auto_levels(policy, group):
        q = policy.quota_for(lvl.name, user, account)
        if q is None or nodes <= q:
            return lvl.name
    return None


def place(policy: Policy, req: Request) -> Placement | None:
    """Where the job of `req` runs, or Refused with the words the user reads. None: the job
    asks for a QOS outside the ladder (the site's own), which the policy leaves to Slurm."""
    text = req.priority
    if text is None and req.qos:
        if req.qos.lower() == "auto":
            text = AUTO
        else:
            lvl = level_of_qos(req.qos, policy.ladder)
            if lvl is None:
                return None
            text = lvl.name
    wanted = request_level(policy, text)  # the level named first, then the grace, then where it fits
    grace = grace_of(policy, req.grace)
    group = group_of(policy, req.partition)
    if isinstance(wanted, str):  # AUTO
        level = auto_at_submit(policy, req.user, req.account, req.nodes, group)
        if level is None:
            raise Refused(REFUSALS["no_level_fits"] % (req.nodes, group.name if group else "-"))
        asked = AUTO
    else:
        level = asked = wanted.name
        if group is not None and not group.accepts(level):
            raise Refused(REFUSALS["group_levels"] % (group.name, ", ".join(group.levels)))
    quota = policy.quota_for(level, req.user, req.account)
    if quota is not None and req.nodes > quota:
        if quota == 0:
            raise Refused(REFUSALS["quota_zero"] % level)
        raise Refused(REFUSALS["over_quota"] % (req.nodes, level, quota, quota))
    return Placement(asked=asked, level=level, qos=policy.qos_for(level, req.user, req.account), quota=quota,
                     grace=grace)


# ------------------------------------------------------------------ renderings


def lua_tables(policy: Policy) -> dict[str, object]:
    """What job_submit.lua (templates/slurm/job_submit.lua.j2) knows of the policy: tables
    computed here, which its code only looks up. Names are validated by the policy loader
    ([A-Z0-9_] levels, [a-z0-9_-] owners, [A-Za-z0-9_-] groups), so they go into Lua strings
    as they are."""
    def quota(value: int | None) -> int:
        return -1 if value is None else value  # -1: unlimited (an override of a limited default)

    overrides = {}
    for kind, table in (("u", policy.user_quota), ("a", policy.account_quota)):
        overrides[kind] = {owner: [(lvl, policy.qos_for(lvl, *((owner, "") if kind == "u" else ("", owner))),
                                    quota(n)) for lvl, n in sorted(levels.items())]
                           for owner, levels in sorted(table.items())}
    default = policy.default_group
    return {
        "default_level": policy.default_level,
        "allow_auto": policy.allow_auto,
        "default_grace": policy.grace_seconds,
        "min_grace": MIN_GRACE,
        "max_grace": policy.grace_limit,
        "order": [lvl.name for lvl in policy.levels_high_to_low],
        "level_qos": {lvl.name: lvl.qos for lvl in policy.ladder},
        "default_quota": {lvl.name: policy.quota[lvl.name] for lvl in policy.ladder if lvl.name in policy.quota},
        "user_overrides": overrides["u"],
        "account_overrides": overrides["a"],
        "group_levels": {g.name: [lvl.name for lvl in auto_levels(policy, g)] for g in policy.groups},
        "group_names": {g.name: ", ".join(g.levels) for g in policy.groups if g.levels},
        "default_group": default.name if default else "",
        "choices": choices(policy),
        "refusals": REFUSALS,
    }


def spank_arguments(policy: Policy) -> dict[str, object]:
    """What plugstack.conf passes to hai_spank.so (templates/slurm/plugstack.conf.j2): the
    ladder, the most grace a job may ask, the rendezvous ports."""
    return {"levels_arg": ",".join(f"{lvl.name}:{lvl.value}" for lvl in policy.ladder),
            "max_grace": policy.grace_limit, "allow_auto_arg": "yes" if policy.allow_auto else "no",
            "master_port_base": MASTER_PORT_BASE,
            "master_port_span": MASTER_PORT_SPAN}

