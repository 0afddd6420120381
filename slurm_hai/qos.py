"""The QOS ladder a policy asks for, and the changes that bring Slurm there (pure).

One QOS per level carries the level's priority, its Preempt= list (every strictly lower
level, never its own), the grace time and the default per-user node quota (MaxTRESPU=node=N,
Flags=DenyOnLimit so a job larger than the whole quota is refused at submission).

Per-user and per-account quota overrides: Slurm keeps QOS limits per QOS, and association
limits are not per QOS, so an override is a *variant QOS* of the level, named
``<level>.u.<user>`` or ``<level>.a.<account>``, with the same priority, grace and Preempt
relations as the level and its own MaxTRESPU. job_submit.lua (rendered from the same policy)
puts a job of that user/account at that level into the variant; `hai-admin apply` gives the
user's (account's) associations access to the variant instead of the level's base QOS. The
variants are QOS Slurm itself enforces, so the refusal at submission, the pending reason
(QOSMaxNodePerUserLimit) and preemption all work as for the base QOS.

`desired_qos(policy)` says what each QOS must look like; `plan(desired, current)` turns the
difference with what sacctmgr shows into sacctmgr argument lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .levels import Level
from .policy import Policy

# Multifactor priority = PriorityWeightQOS * qos.Priority / max(qos.Priority). QOS priority
# is level value + 1 (never 0), so a job's priority is (value + 1) * LEVEL_STRIDE and the
# policy daemon can order jobs inside one level with offsets below LEVEL_STRIDE.
LEVEL_STRIDE = 1_000_000
VARIANT_SEP = "."
FLAGS = ("DenyOnLimit",)


def qos_weight(policy: Policy) -> int:
    return (max(lvl.value for lvl in policy.ladder) + 1) * LEVEL_STRIDE


def level_base(lvl: Level) -> int:
    """The multifactor priority every job of `lvl` gets from Slurm (before the daemon's offsets)."""
    return (lvl.value + 1) * LEVEL_STRIDE


def variant_qos(lvl: Level, kind: str, owner: str) -> str:
    """The QOS of an override: kind "u" (user) or "a" (account)."""
    return VARIANT_SEP.join((lvl.qos, kind, owner))


def parse_qos(name: str) -> tuple[str, str, str]:
    """QOS name -> (base qos, kind, owner); kind and owner are "" for a base QOS."""
    parts = name.lower().split(VARIANT_SEP, 2)
    if len(parts) == 3 and parts[1] in ("u", "a") and parts[2]:
        return parts[0], parts[1], parts[2]
    return name.lower(), "", ""


def level_of_qos(policy: Policy, qos: str) -> Level | None:
    """The level a QOS (base or variant) belongs to; None for a QOS outside the ladder."""
    base = parse_qos(qos)[0]
    for lvl in policy.ladder:
        if lvl.qos == base:
            return lvl
    return None


def qos_for(policy: Policy, level: str, user: str = "", account: str = "") -> str:
    """The QOS a job of `user` (in `account`) at `level` runs in."""
    lvl = policy.level(level)
    owner = policy.override_owner(level, user, account)
    return variant_qos(lvl, *owner) if owner else lvl.qos


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
            "Preempt": (",".join(sorted(self.preempt)), ",".join(sorted(self.preempt)) or "''"),
            "GraceTime": (_hms(self.grace_seconds), str(self.grace_seconds)),
            "PreemptMode": (self.preempt_mode, self.preempt_mode),
            "MaxTRESPU": (f"node={quota}" if quota is not None else "", f"node={quota if quota is not None else -1}"),
            "PreemptExemptTime": (_hms(exempt) if exempt else "", _hms(exempt) if exempt else "-1"),
            "Flags": (flags, flags or "-1"),
        }


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
        common = dict(priority=lvl.value + 1, preempt=preempt, grace_seconds=policy.grace_seconds,
                      preempt_exempt_seconds=policy.min_run_seconds, level=lvl.name)
        specs.append(QosSpec(name=lvl.qos, max_nodes_per_user=policy.quota.get(lvl.name), **common))
        for kind, owner, nodes in variants[lvl.name]:
            specs.append(QosSpec(name=variant_qos(lvl, kind, owner), max_nodes_per_user=nodes,
                                 owner=f"{'user' if kind == 'u' else 'account'} {owner}", **common))
    return specs


SHOW_FIELDS = ("Name", "Priority", "Preempt", "GraceTime", "PreemptMode", "MaxTRESPU", "PreemptExemptTime", "Flags")


def _normal(field: str, value: str) -> str:
    if field in ("Preempt", "Flags"):
        return ",".join(sorted(filter(None, value.split(","))))
    return value


def plan(desired: list[QosSpec], current: dict[str, dict[str, str]]) -> list[list[str]]:
    """sacctmgr argument lists (without `sacctmgr -i`) that make `current` match `desired`.

    `current` maps QOS name to the fields of `sacctmgr show qos` (SHOW_FIELDS, lower-cased
    names as keys are fine). Returns [] when nothing needs to change. All `add` lists come
    first: Preempt= may only name QOS that exist.
    """
    adds: list[list[str]] = []
    modifies: list[list[str]] = []
    for spec in desired:
        have = {k.lower(): v for k, v in current.get(spec.name, {}).items()}
        if spec.name not in current:
            adds.append(["add", "qos", spec.name])
        sets = []
        for field, (shown, set_arg) in spec.settings().items():
            now = _normal(field, have.get(field.lower(), ""))
            if now.lower() != shown.lower():
                sets.append(f"{field}={set_arg}")
        if sets:
            modifies.append(["modify", "qos", "where", f"name={spec.name}", "set", *sets])
    return adds + modifies


def describe(spec: QosSpec) -> str:
    quota = "unlimited" if spec.max_nodes_per_user is None else f"{spec.max_nodes_per_user} nodes"
    who = f" for {spec.owner}" if spec.owner else ""
    return f"level {spec.level}{who}: quota {quota} per user"
