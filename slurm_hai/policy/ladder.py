"""The QOS ladder a policy asks for, and the changes that bring Slurm there (pure).

One QOS per level carries the level's priority, its Preempt= list (every strictly lower
level, never its own), the grace time and the default per-user node quota (MaxTRESPU=node=N,
Flags=DenyOnLimit so a job larger than the whole quota is refused at submission). Slurm's
GraceTime is per QOS, not per job, so it is the most grace a job may ask for
(`Policy.grace_limit`, Slurm's hard bound); each job's own grace (the `hai-grace` tag) is
enforced below it by the job's launcher and the policy daemon.

Per-user and per-account quota overrides: Slurm keeps QOS limits per QOS, and association
limits are not per QOS, so an override is a *variant QOS* of the level, named
``<level>.u.<user>`` or ``<level>.a.<account>``, with the same priority, grace and Preempt
relations as the level and its own MaxTRESPU. job_submit.lua (rendered from the same policy)
puts a job of that user/account at that level into the variant; `hai-admin apply` gives the
user's (account's) associations access to the variant instead of the level's base QOS. The
variants are QOS Slurm itself enforces, so the refusal at submission, the pending reason
(QOSMaxNodePerUserLimit) and preemption all work as for the base QOS.

`desired_qos(policy)` says what each QOS must look like; `plan_changes(policy, state)` turns
the difference with what Slurm has into `Change`s: data (add this QOS, set these fields of
that association, update that partition), which `slurm_hai.slurm` renders to commands and
applies. Nothing here knows a command line.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping, TypedDict

from . import tags
from .levels import LEVEL_STRIDE, VARIANT_SEP, Level, parse_qos, variant_qos
from .model import MIN_GPUS_REFUSAL, Policy
from .placement import lua_tables, spank_arguments

FLAGS = ("DenyOnLimit",)


def qos_weight(policy: Policy) -> int:
    return (max(lvl.value for lvl in policy.ladder) + 1) * LEVEL_STRIDE


@dataclass(frozen=True)
class QosSpec:
    name: str
    priority: int
    preempt: tuple[str, ...]
    grace_seconds: int
    preempt_mode: str = "requeue"
    max_nodes_per_user: int | None = None
    preempt_exempt_seconds: int = 0
    flags: tuple[str, ...] = FLAGS
    level: str = ""
    owner: str = field(default="", compare=False)  # "user hai-bob" / "account research" for a variant

    def settings(self) -> dict[str, tuple[str, str]]:
        """Field -> (as `sacctmgr show qos` prints it, as `sacctmgr modify qos set` takes it)."""
        quota = self.max_nodes_per_user
        exempt = self.preempt_exempt_seconds
        flags = ",".join(sorted(self.flags))
        return {
            "Priority": (str(self.priority), str(self.priority)),
            # an empty Preempt= clears the list (sacctmgr refuses `''` as "an empty qos list")
            "Preempt": (",".join(sorted(self.preempt)), ",".join(sorted(self.preempt))),
            "GraceTime": (_hms(self.grace_seconds), str(self.grace_seconds)),
            "PreemptMode": (self.preempt_mode, self.preempt_mode),
            "MaxTRESPU": (f"node={quota}" if quota is not None else "", f"node={quota if quota is not None else -1}"),
            "PreemptExemptTime": (_hms(exempt) if exempt else "", _hms(exempt) if exempt else "-1"),
            "Flags": (flags, flags or "-1"),
        }


class _LevelFields(TypedDict):
    """The QosSpec fields a level's QOS and its quota variants share."""

    priority: int
    preempt: tuple[str, ...]
    grace_seconds: int
    preempt_exempt_seconds: int
    level: str


def _hms(seconds: int) -> str:
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def desired_qos(policy: Policy) -> list[QosSpec]:
    """Every QOS the policy needs: one per level, then one per quota override."""
    variants: dict[str, list[tuple[str, str, int | None]]] = {lvl.name: [] for lvl in policy.ladder}
    for kind, table in (("u", policy.user_quota), ("a", policy.account_quota)):
        for owner in sorted(table):
            for level, nodes in table[owner].items():
                variants[level].append((kind, owner, nodes))

    def names(lvl: Level) -> list[str]:
        return [lvl.qos] + [variant_qos(lvl, kind, owner) for kind, owner, _ in variants[lvl.name]]

    specs = []
    for lvl in policy.ladder:
        preempt = tuple(sorted(n for other in policy.lower_levels(lvl) for n in names(other)))
        common = _LevelFields(priority=lvl.value + 1, preempt=preempt, grace_seconds=policy.grace_limit,
                              preempt_exempt_seconds=policy.min_run_seconds, level=lvl.name)
        specs.append(QosSpec(name=lvl.qos, max_nodes_per_user=policy.quota.get(lvl.name), **common))
        for kind, owner, nodes in variants[lvl.name]:
            specs.append(QosSpec(name=variant_qos(lvl, kind, owner), max_nodes_per_user=nodes,
                                 owner=f"{'user' if kind == 'u' else 'account'} {owner}", **common))
    return specs


def _normal(field: str, value: str) -> str:
    if field in ("Preempt", "Flags"):
        return ",".join(sorted(filter(None, value.split(","))))
    return value


def qos_changes(desired: list[QosSpec], current: dict[str, dict[str, str]]) -> list[Change]:
    """The QOS changes that make `current` match `desired`, each with its reason.

    `current` maps QOS name to its fields as Slurm shows them (the keys of QosSpec.settings
    and Name; lower-cased keys are fine). [] when nothing needs to change. Every `add` comes
    first: Preempt= may only name QOS that exist.
    """
    adds: list[Change] = []
    modifies: list[Change] = []
    for spec in desired:
        new = spec.name not in current
        have = {k.lower(): v for k, v in current.get(spec.name, {}).items()}
        if new:
            adds.append(Change("add", "qos", name=spec.name, why=f"new QOS: {describe(spec)}"))
        sets: dict[str, str] = {}
        diffs = []
        for key, (shown, value) in spec.settings().items():
            now = _normal(key, have.get(key.lower(), ""))
            if now.lower() != shown.lower():
                sets[key] = value
                diffs.append(_difference(key, now, shown))
        if sets:
            why = f"{spec.name}: settings of the new QOS" if new else f"{spec.name}: " + "; ".join(diffs)
            modifies.append(Change("modify", "qos", where={"name": spec.name}, settings=sets, why=why))
    return adds + modifies


def _difference(key: str, now: str, want: str) -> str:
    """One field's change in words: `Preempt +high -low`, `GraceTime 00:00:10 -> 00:00:05`."""
    if key in ("Preempt", "Flags"):
        added, removed = sorted(name_set(want) - name_set(now)), sorted(name_set(now) - name_set(want))
        return f"{key} " + " ".join([f"+{x}" for x in added] + [f"-{x}" for x in removed])
    return f"{key} {now or '(none)'} -> {want or '(none)'}"


def describe(spec: QosSpec) -> str:
    n = spec.max_nodes_per_user
    quota = "unlimited" if n is None else f"{n} node{'' if n == 1 else 's'}"
    who = f" for {spec.owner}" if spec.owner else ""
    return f"level {spec.level}{who}: quota {quota} per user"


# ------------------------------------------------------------------ the whole plan


@dataclass(frozen=True)
class Change:
    """One step that brings Slurm closer to the policy, as data, and why.

    op "add", "modify" or "delete" of an accounting entity ("cluster", "account", "user",
    "qos"; a user or account with `where` cluster/account/partition is an association), or
    "create", "update" or "delete" of a "partition" (slurmctld). `name` is what add, create and
    update name; `where` selects what modify and delete change; `settings` are the fields
    to set, spelt and valued as Slurm takes them (its field names, `node=4`, `-1`: none).
    `slurm_hai.slurm` renders a Change to a command (`commands.change_argv`) and makes it
    (`Backend.apply`).
    """

    op: str
    entity: str
    name: str = ""
    where: Mapping[str, str] = field(default_factory=dict)
    settings: Mapping[str, str] = field(default_factory=dict)
    why: str = ""


@dataclass
class ClusterState:
    """What Slurm has now, as read by `slurm_hai.controller.apply.read_state` (or empty: a new cluster)."""

    qos: dict[str, dict[str, str]] = field(default_factory=dict)  # name -> Name and QosSpec.settings() fields
    assocs: list[dict[str, str]] = field(default_factory=list)  # Cluster, Account, User, Partition, QOS, DefaultQOS
    partitions: dict[str, dict[str, str]] | None = None  # None: partitions not looked at
    nodes: dict[str, frozenset[str]] = field(default_factory=dict)  # hostlist -> node names (expanded)


def group_allow_qos(policy: Policy, group) -> str:
    """AllowQos= for a node group: ALL, or the QOS (base and variants) of its levels."""
    if not group.levels:
        return "ALL"
    names = [spec.name for spec in desired_qos(policy) if spec.level in group.levels]
    return ",".join(sorted(names))


def name_set(text: str) -> set[str]:
    """A comma-separated list of Slurm names (Preempt, QOS, AllowQos) as a set, lower-cased."""
    return {item.strip().lower() for item in text.split(",") if item.strip()}


def plan_changes(policy: Policy, state: ClusterState) -> list[Change]:
    """Every change, in order, that makes `state` match `policy`.

    Order: new QOS, QOS settings (Preempt= may only name QOS that exist), association
    access (which QOS each user/account may use, default QOS), stale override QOS removal,
    then partitions (AllowQos= may only name QOS that exist). [] when nothing is to change.
    """
    specs = desired_qos(policy)
    changes = qos_changes(specs, state.qos)

    ladder_qos = {lvl.qos for lvl in policy.ladder}
    desired_names = {s.name for s in specs}
    # Associations in the accounts the policy names; when it names none, only those of the
    # users and accounts that have a quota override (they need their variant QOS).
    def in_scope(row: dict[str, str]) -> bool:
        if policy.accounts:
            return row.get("Account", "") in policy.accounts
        return row.get("User", "") in policy.user_quota or row.get("Account", "") in policy.account_quota

    # The users of an account before the account itself: sacctmgr refuses an account's new
    # default QOS while an association below it cannot use it (and says so, exit status 0).
    def order(row: dict[str, str]) -> tuple:
        return row.get("Cluster", ""), row.get("Account", ""), row.get("User", "") == "", row.get("User", "")

    rows = sorted((r for r in state.assocs if in_scope(r)), key=order)
    below: dict[tuple[str, str], list[tuple[dict[str, str], set[str]]]] = defaultdict(list)  # users, their QOS
    for row in rows:
        user, account = row.get("User", ""), row.get("Account", "")
        have = name_set(row.get("QOS", ""))
        # keep the site's own QOS; replace ours (bases and variants) by the ones this owner uses
        site = {q for q in have if parse_qos(q)[0] not in ladder_qos}
        want = site | {policy.qos_for(lvl.name, user, account) for lvl in policy.ladder}
        default = policy.qos_for(policy.default_level, user, account)
        default_now = row.get("DefaultQOS", "").lower()
        key = (row.get("Cluster", ""), account)
        if user:
            below[key].append((user_where(row), want))
        if want == have and default_now == default:
            continue
        if user:
            entity, where, who = "user", user_where(row), f"user {user} in account {account}"
        else:
            entity, where, who = "account", {"cluster": key[0], "name": account}, f"account {account}"
        added, removed = sorted(want - have), sorted(have - want)
        detail = " ".join([f"+{q}" for q in added] + [f"-{q}" for q in removed])
        if default_now != default:
            detail += f"{'; ' if detail else ''}default {default_now or '(none)'} -> {default}"
        # the default only when it changes: sacctmgr checks an account's default against every
        # association below it whenever it is set, also to the value it has
        settings = {"qos": ",".join(sorted(want)), **({"defaultqos": default} if default_now != default else {})}
        change = Change("modify", entity, where=where, settings=settings, why=f"QOS access of {who}: {detail}")
        lacking = [(w, qos) for w, qos in below[key] if default not in qos] if not user and default_now != default else []
        changes.extend(_granted_for_a_moment(lacking, default, change))

    for name in sorted(state.qos):
        base, kind, owner = parse_qos(name)
        if kind and base in ladder_qos and name not in desired_names:
            changes.append(Change("delete", "qos", where={"name": name}, why=f"override gone from the policy: {name}"))

    if state.partitions is not None:
        for group in policy.groups:
            changes.extend(_partition_changes(policy, group, state))
    return changes


def user_where(row: Mapping[str, str]) -> dict[str, str]:
    where = {"cluster": row.get("Cluster", ""), "account": row.get("Account", ""), "name": row.get("User", "")}
    if row.get("Partition"):
        where["partition"] = row["Partition"]
    return where


def _granted_for_a_moment(lacking: list[tuple[dict[str, str], set[str]]], default: str, change: Change) -> list[Change]:
    """`change` of an account's default QOS to `default`, with the users below it that may not
    use it (a user whose quota override replaces that level's QOS) granted it for the moment
    of the change: sacctmgr refuses an account a default QOS that an association below it
    cannot use ("don't have access to their default qos"), though that user's own default is
    their variant. Their access is put back right after."""
    if not lacking:
        return [change]
    def grant(where, qos: set[str], why: str) -> Change:
        return Change("modify", "user", where=where, settings={"qos": ",".join(sorted(qos))}, why=why)
    return ([grant(w, qos | {default}, f"{w['name']} may use {default} while {change.why}") for w, qos in lacking]
            + [change]
            + [grant(w, qos, f"{w['name']} back to their own QOS") for w, qos in lacking])


def partition_setting(shown: Mapping[str, str], key: str) -> str:
    """A partition's setting `key` as `scontrol update` takes it, from `scontrol show partition`.
    Slurm 26.05 shows a whole-node partition as `Exclusive=NODE` (or TOPO) with
    `OverSubscribe=NO`; earlier releases as `OverSubscribe=EXCLUSIVE`."""
    if key == "OverSubscribe" and shown.get("Exclusive", "").upper() in ("NODE", "TOPO"):
        return "EXCLUSIVE"
    return shown.get(key, "")


def _partition_changes(policy: Policy, group, state: ClusterState) -> list[Change]:
    # whole nodes per job, as on HAI: a job never shares a node another job preempts it for
    want = {"PriorityTier": str(group.priority_tier), "AllowQos": group_allow_qos(policy, group),
            "Default": "YES" if group.default else "NO", "OverSubscribe": "EXCLUSIVE"}
    have = state.partitions.get(group.name) if state.partitions is not None else None
    if have is None:
        settings = {"Nodes": group.nodes, **want, "MaxTime": "INFINITE", "State": "UP"}
        return [Change("create", "partition", name=group.name, settings=settings,
                       why=f"new node group {group.name} ({group.nodes})")]
    sets: dict[str, str] = {}
    diffs = []
    for key, value in want.items():
        now = partition_setting(have, key)
        same = name_set(now) == name_set(value) if key == "AllowQos" else now.upper() == value.upper()
        if not same:
            sets[key] = value
            diffs.append(f"{key} {now or '(none)'} -> {value}")
    if group.nodes.upper() != "ALL":
        now_nodes = state.nodes.get(have.get("Nodes", ""), frozenset())
        want_nodes = state.nodes.get(group.nodes)
        if want_nodes is not None and now_nodes != want_nodes:
            sets["Nodes"] = group.nodes
            diffs.append(f"Nodes {have.get('Nodes') or '(none)'} -> {group.nodes}")
    if not sets:
        return []
    return [Change("update", "partition", name=group.name, settings=sets, why=f"node group {group.name}: " + "; ".join(diffs))]


# ------------------------------------------------------------------ what the templates get


def template_context(policy: Policy) -> dict[str, object]:
    """Everything templates/slurm/*.j2 need from a policy, already checked and computed
    (the Slurm version they are written for is render()'s `slurm=`; unless given, the oldest
    supported, whose spellings every later version still accepts): job_submit.lua's
    tables (`placement.lua_tables`), the SPANK plugin's arguments, the QOS and partitions.

    Values are names validated by the policy loader ([A-Z0-9_] levels, [a-z0-9_-] owners,
    partition names) and integers, so they go into Lua strings and config lines as they are.
    """
    groups = [{"name": g.name, "nodes": g.nodes, "priority_tier": g.priority_tier, "default": g.default,
               "allow_qos": group_allow_qos(policy, g)} for g in policy.groups]
    return {
        **lua_tables(policy),
        **spank_arguments(policy),
        "policy": policy,
        "qos_weight": qos_weight(policy),
        "node_groups": groups,
        "level_tag": tags.LEVEL,
        "grace_tag": tags.GRACE,
        "nodes_tag": tags.NODES,
        "parts_tag": tags.PARTS,
        "submission_tag": tags.SUBMISSION,
        "variant_sep": VARIANT_SEP,
        # the 8-GPU rule: GPUs per node by node group (partition), the top-level value for others
        "min_gpus": policy.min_gpus,
        "group_min_gpus": {g.name: policy.min_gpus_for(g.name) for g in policy.groups},
        "min_gpus_refusal": MIN_GPUS_REFUSAL,
    }


def offline_access_changes(policy: Policy) -> list[Change]:
    """QOS access for `hai-admin render`'s script, written without reading the database, so
    that it leaves every association `plan_changes` would touch as `hai-admin apply` sets it
    on a database that has none of our QOS: the associations of the policy's accounts (when
    it names none, of the accounts with a quota override) get the ladder, each user with an
    override their variants (when the policy names no accounts, in every account of theirs);
    the users of an account before the account itself, as `plan_changes` orders them."""
    def grant(user: str, account: str) -> dict[str, str]:
        names = sorted({policy.qos_for(lvl.name, user, account) for lvl in policy.ladder})
        return {"qos": ",".join(names), "defaultqos": policy.qos_for(policy.default_level, user, account)}

    accounts = policy.accounts or tuple(sorted(policy.account_quota))
    changes = []
    if not policy.accounts:
        for user in sorted(policy.user_quota):
            changes.append(Change("modify", "user", where={"name": user}, settings=grant(user, ""),
                                  why=f"user {user} uses their quota override QOS"))
    for account in accounts:
        changes.append(Change("modify", "user", where={"account": account}, settings=grant("", account),
                              why=f"users of account {account} use the ladder"))
        for user in sorted(policy.user_quota):
            changes.append(Change("modify", "user", where={"name": user, "account": account},
                                  settings=grant(user, account),
                                  why=f"user {user} in account {account} uses their quota override QOS"))
        mine = grant("", account)
        lacking = [({"name": user, "account": account}, set(grant(user, account)["qos"].split(",")))
                   for user in sorted(policy.user_quota)]
        changes.extend(_granted_for_a_moment([(w, q) for w, q in lacking if mine["defaultqos"] not in q],
                                             mine["defaultqos"],
                                             Change("modify", "account", where={"name": account}, settings=mine,
                                                    why=f"account {account} uses the ladder")))
    return changes
