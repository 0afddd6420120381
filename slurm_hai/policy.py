"""The HAI scheduling policy: levels, quotas, grace, demotion, node groups (pure).

Loaded from one TOML file (see docs/policy.md); `default_policy()` is HAI's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .levels import DEFAULT_LADDER, Level


@dataclass(frozen=True)
class NodeGroup:
    """A node group is a Slurm partition."""

    name: str
    nodes: str
    priority_tier: int = 1
    levels: tuple[str, ...] = ()  # empty: every level
    default: bool = False


@dataclass(frozen=True)
class Demotion:
    source: str = "ABOVE_NORMAL"
    target: str = "NORMAL"
    after_seconds: int = 30 * 60


@dataclass(frozen=True)
class Policy:
    ladder: tuple[Level, ...] = DEFAULT_LADDER
    default_level: str = "NORMAL"
    grace_seconds: int = 5
    min_run_seconds: int = 0
    demotion: Demotion | None = field(default_factory=Demotion)
    # level name -> default per-user node quota (missing: unlimited)
    quota: dict[str, int] = field(default_factory=dict)
    groups: tuple[NodeGroup, ...] = ()

    def level(self, name: str) -> Level:
        for lvl in self.ladder:
            if lvl.name == name:
                return lvl
        raise KeyError(name)

    def lower_levels(self, lvl: Level) -> list[Level]:
        """Levels that `lvl` may preempt: every strictly lower one, never its own."""
        return [other for other in self.ladder if other.value < lvl.value]


def default_policy(nodes: str = "ALL") -> Policy:
    return Policy(groups=(NodeGroup(name="gpu", nodes=nodes, default=True),))
