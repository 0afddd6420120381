"""Bring a live cluster in line with a policy: read what Slurm has, plan, apply.

`hai-admin plan/apply` and contrib/localcluster (its `up`) both go through `apply_policy`,
so the local cluster is set up by exactly the code an administrator runs. Reading and
writing go through the Slurm access layer (`slurm_hai.slurm`: typed reads, `apply(change)`);
the plan itself is pure data (`slurm_hai.policy.ladder.plan_changes`); what was made of a
site's cluster, and how to take it out again, is `slurm_hai.policy.install`'s, kept in the
install record this module reads and writes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable

from ..policy.install import InstallRecord, qos_conflicts, recorded, removal_changes
from ..policy.ladder import Change, ClusterState, plan_changes
from ..policy.model import Policy
from ..slurm import Backend


def read_state(backend: Backend, policy: Policy | None = None, partitions: bool = True) -> ClusterState:
    """The QOS table, the associations and (if asked) the partitions, as Slurm has them now
    (with the nodes of each partition's and, given a policy, each node group's hostlist).

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
        if policy is not None:
            lists |= {g.nodes for g in policy.groups if g.nodes.upper() != "ALL"}
        for hostlist in filter(None, lists):
            if hostlist != "(null)":
                state.nodes[hostlist] = frozenset(backend.expand_hostlist(hostlist))
    return state


def record_path() -> Path:
    """The install record: $HAI_INSTALL_RECORD, else hai-install.json beside slurm.conf
    ($SLURM_CONF's directory, /etc/slurm by default): one per cluster, where its admin writes."""
    if os.environ.get("HAI_INSTALL_RECORD"):
        return Path(os.environ["HAI_INSTALL_RECORD"])
    return Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")).parent / "hai-install.json"


def load_record(path: Path) -> InstallRecord:
    """The record at `path`; an empty one where there is none yet (nothing installed)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return InstallRecord()
    except OSError as e:
        raise InstallError(f"cannot read the install record {path}: {e.strerror}") from None
    try:
        return InstallRecord.from_json(json.loads(text))
    except ValueError as e:
        raise InstallError(f"{path}: {e}; move it away only if nothing of slurm-hai is installed") from None


def save_record(path: Path, record: InstallRecord) -> None:
    """Written whole or not at all (a temp file renamed over it), before the changes it records."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record.to_json(), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


class InstallError(ValueError):
    """apply cannot go on without the admin's word (a site's QOS to adopt, an unreadable record)."""


def plan_policy(policy: Policy, backend: Backend, partitions: bool = True) -> tuple[list[Change], ClusterState]:
    state = read_state(backend, policy, partitions)
    return plan_changes(policy, state), state


def apply_changes(backend: Backend, changes: list[Change], report: Callable[[Change], None] | None = None) -> None:
    """Make the changes in order, `report` each once it is made; the first failure stops
    (later ones may depend on it), and what was reported is what was made."""
    for change in changes:
        backend.apply(change)
        if report:
            report(change)


def apply_policy(policy: Policy, backend: Backend, partitions: bool = True,
                 report: Callable[[Change], None] | None = None, record: Path | None = None,
                 adopt: Iterable[str] = ()) -> list[Change]:
    """Plan against the live cluster and apply; returns what was done ([]: nothing to change).

    The install record (`record`, default `record_path()`) says which QOS are slurm-hai's;
    a site's QOS the plan would change must be in `adopt` ("*": every one), else nothing is
    changed and InstallError names them. The record is saved with what the changes create
    and what they find before they are made, so that `remove_policy` can undo them.
    """
    path = record or record_path()
    installed = load_record(path)
    changes, state = plan_policy(policy, backend, partitions)
    adopt = set(adopt)
    refused = [q for q in qos_conflicts(changes, state, installed) if q not in adopt and "*" not in adopt]
    if refused:
        raise InstallError(f"QOS {', '.join(refused)} of the site would be changed: `hai-admin plan` shows how; "
                           f"rerun with --adopt {','.join(refused)} (remove puts their settings back) "
                           "or name the levels otherwise in [levels]")
    changes = [c for c in changes if not _deletes_what_it_did_not_create(c, installed)]
    if changes:
        save_record(path, recorded(installed, changes, state))
    apply_changes(backend, changes, report)
    return changes


def _deletes_what_it_did_not_create(change: Change, installed: InstallRecord) -> bool:
    return (change.op, change.entity) == ("delete", "qos") and change.where.get("name") not in installed.created_qos


def remove_policy(backend: Backend, record: Path | None = None, report: Callable[[Change], None] | None = None,
                  dry_run: bool = False) -> list[Change]:
    """Take out what the install record says slurm-hai made; the record goes once it is done."""
    path = record or record_path()
    installed = load_record(path)
    changes = removal_changes(installed, read_state(backend))
    if not dry_run:
        apply_changes(backend, changes, report)
        path.unlink(missing_ok=True)
    return changes

