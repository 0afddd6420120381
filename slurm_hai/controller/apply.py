"""Bring a live cluster in line with a policy: read what Slurm has, plan, apply.

`hai-admin plan/apply` and contrib/localcluster (its `up`) both go through `apply_policy`,
so the local cluster is set up by exactly the code an administrator runs. Reading and
writing go through the Slurm access layer (`slurm_hai.slurm`: typed reads, `apply(change)`);
the plan itself is pure data (`slurm_hai.policy.ladder.plan_changes`).
"""

from __future__ import annotations

from typing import Callable

from ..policy.model import Policy
from ..policy.ladder import Change, ClusterState, plan_changes
from ..slurm import Backend


def read_state(backend: Backend, policy: Policy, partitions: bool = True) -> ClusterState:
    """The QOS table, the associations and (if asked) the partitions, as Slurm has them now.

    QOS and associations come from slurmdbd (sacctmgr), partitions from slurmctld
    (scontrol): with partitions=False this works before slurmctld is started.
    """
    state = ClusterState()
    for row in backend.qos():
        state.qos[row["Name"].lower()] = {k.lower(): v for k, v in row.items()}
    state.assocs = backend.associations()
    if partitions:
        state.partitions = {p["PartitionName"]: p for p in backend.partitions()}
        lists = {p.get("Nodes", "") for p in state.partitions.values()}
        lists |= {g.nodes for g in policy.groups if g.nodes.upper() != "ALL"}
        for hostlist in filter(None, lists):
            if hostlist != "(null)":
                state.nodes[hostlist] = frozenset(backend.expand_hostlist(hostlist))
    return state


def plan_policy(policy: Policy, backend: Backend, partitions: bool = True) -> list[Change]:
    return plan_changes(policy, read_state(backend, policy, partitions))


def apply_changes(backend: Backend, changes: list[Change], report: Callable[[Change], None] | None = None) -> None:
    """Make the changes in order; the first failure stops (later ones may depend on it)."""
    for change in changes:
        if report:
            report(change)
        backend.apply(change)


def apply_policy(policy: Policy, backend: Backend, partitions: bool = True,
                 report: Callable[[Change], None] | None = None) -> list[Change]:
    """Plan against the live cluster and apply; returns what was done ([]: nothing to change)."""
    changes = plan_policy(policy, backend, partitions)
    apply_changes(backend, changes, report)
    return changes
