"""The QOS ladder a policy asks for, and the changes that bring Slurm there (pure).

`desired_qos(policy)` says what each level's QOS must look like; `plan(desired, current)`
turns the difference with what sacctmgr shows into sacctmgr argument lists.
"""

from __future__ import annotations

from dataclasses import dataclass

from .policy import Policy

# Multifactor priority = PriorityWeightQOS * qos.Priority / max(qos.Priority). QOS priority
# is level value + 1 (never 0), so a job's priority is (value + 1) * LEVEL_STRIDE and the
# policy daemon can order jobs inside one level with offsets below LEVEL_STRIDE.
LEVEL_STRIDE = 1_000_000


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

    def settings(self) -> dict[str, tuple[str, str]]:
        """Field -> (as `sacctmgr show qos` prints it, as `sacctmgr modify qos set` takes it)."""
        quota = self.max_nodes_per_user
        exempt = self.preempt_exempt_seconds
        return {
            "Priority": (str(self.priority), str(self.priority)),
            "Preempt": (",".join(sorted(self.preempt)), ",".join(sorted(self.preempt)) or "''"),
            "GraceTime": (_hms(self.grace_seconds), str(self.grace_seconds)),
            "PreemptMode": (self.preempt_mode, self.preempt_mode),
            "MaxTRESPU": (f"node={quota}" if quota is not None else "", f"node={quota if quota is not None else -1}"),
            "PreemptExemptTime": (_hms(exempt) if exempt else "", _hms(exempt) if exempt else "-1"),
        }


def _hms(seconds: int) -> str:
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def desired_qos(policy: Policy) -> list[QosSpec]:
    return [
        QosSpec(
            name=lvl.qos,
            priority=lvl.value + 1,
            preempt=tuple(other.qos for other in policy.lower_levels(lvl)),
            grace_seconds=policy.grace_seconds,
            max_nodes_per_user=policy.quota.get(lvl.name),
            preempt_exempt_seconds=policy.min_run_seconds,
        )
        for lvl in policy.ladder
    ]


SHOW_FIELDS = ("Name", "Priority", "Preempt", "GraceTime", "PreemptMode", "MaxTRESPU", "PreemptExemptTime")


def plan(desired: list[QosSpec], current: dict[str, dict[str, str]]) -> list[list[str]]:
    """sacctmgr argument lists (without `sacctmgr -i`) that make `current` match `desired`.

    `current` maps QOS name to the fields of `sacctmgr show qos` (SHOW_FIELDS, lower-cased
    names as keys are fine). Returns [] when nothing needs to change.
    """
    changes: list[list[str]] = []
    for spec in desired:
        have = {k.lower(): v for k, v in current.get(spec.name, {}).items()}
        if spec.name not in current:
            changes.append(["add", "qos", spec.name])
        sets = []
        for field, (shown, set_arg) in spec.settings().items():
            now = have.get(field.lower(), "")
            if field == "Preempt":
                now = ",".join(sorted(filter(None, now.split(","))))
            if now.lower() != shown.lower():
                sets.append(f"{field}={set_arg}")
        if sets:
            changes.append(["modify", "qos", "where", f"name={spec.name}", "set", *sets])
    return changes
