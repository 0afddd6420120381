"""Bring a live cluster in line with a policy: read what Slurm has, plan, apply.

`hai-admin plan/apply` and contrib/localcluster (its `up`) both go through `apply_policy`,
so the local cluster is set up by exactly the code an administrator runs. Reading and
writing go through the Slurm access layer (`slurm_hai.slurm`); the plan itself is pure
(`slurm_hai.policy.ladder.plan_changes`).
"""

from __future__ import annotations

from typing import Callable

from ..policy.model import Policy
from ..policy.ladder import ASSOC_FIELDS, SHOW_FIELDS, Change, ClusterState, plan_changes
from ..slurm import Backend, SlurmError


def read_state(backend: Backend, policy: Policy, partitions: bool = True) -> ClusterState:
    """The QOS table, the associations and (if asked) the partitions, as Slurm has them now.

    QOS and associations come from slurmdbd (sacctmgr), partitions from slurmctld
    (scontrol): with partitions=False this works before slurmctld is started.
    """
    state = ClusterState()
    for row in backend.sacctmgr_show("qos", SHOW_FIELDS):
        state.qos[row["Name"].lower()] = {k.lower(): v for k, v in row.items()}
    state.assocs = backend.sacctmgr_show("assoc", ASSOC_FIELDS)
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
    """Run the changes in order; the first failure stops (later ones may depend on it)."""
    for change in changes:
        if report:
            report(change)
        try:
            if change.tool == "sacctmgr":
                backend.sacctmgr(change.args)
            elif change.tool == "scontrol":
                backend.scontrol(change.args)
            else:  # pragma: no cover - plan_changes makes no other kind
                raise SlurmError(f"unknown change tool {change.tool}")
        except SlurmError as e:
            raise SlurmError(f"{e} (while: {' '.join(change.argv())})") from None


def apply_policy(policy: Policy, backend: Backend, partitions: bool = True,
                 report: Callable[[Change], None] | None = None) -> list[Change]:
    """Plan against the live cluster and apply; returns what was done ([]: nothing to change)."""
    changes = plan_policy(policy, backend, partitions)
    apply_changes(backend, changes, report)
    return changes
