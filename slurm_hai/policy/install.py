"""What slurm-hai made of a site's cluster, and how to take it out again (pure; no I/O).

A cluster slurm-hai is added to already has QOS, associations, partitions and a preemption
mode of its own. `hai-admin apply` keeps an *install record* (`InstallRecord`, a JSON file:
`controller/apply.py` reads and writes it) of what it made and of what it found before its
first change to each thing of the site's:

- QOS: those it added (`created`); those of the site it was allowed to change
  (`apply --adopt NAME`), with their settings as they were (`qos_before`). A QOS the
  ladder needs that the site already has with other settings is a *conflict*: apply refuses
  to change it until the admin adopts it (or names the levels otherwise), because a QOS's
  name follows from a level's name and the site's jobs may be using it.
- Partitions: those it created; a partition a node group names that existed, with the
  settings apply changed as they were (`partitions_before`). A node group names its
  partition on purpose, so no adoption is asked; plan says whose it was.
- Associations: the QOS list and default QOS of each association before apply first
  changed it (`assocs_before`).

`removal_changes(record, state)` undoes exactly that: the QOS slurm-hai added come out of
every association and the default QOS goes back, the partitions it created go and those it
changed get their settings back, the QOS it created go and the adopted ones get their
settings back. `apply` never deletes a QOS it did not create.

`config_warnings(config)` names, in one line each, what of the site's slurm.conf would
defeat slurm-hai (a preempted job cancelled instead of requeued, and the like).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from .ladder import Change, ClusterState, name_set, partition_setting, user_where
from .levels import parse_qos

RECORD_VERSION = 1


@dataclass
class InstallRecord:
    created_qos: list[str] = field(default_factory=list)
    created_partitions: list[str] = field(default_factory=list)
    qos_before: dict[str, dict[str, str]] = field(default_factory=dict)  # adopted QOS -> settings (as set)
    partitions_before: dict[str, dict[str, str]] = field(default_factory=dict)
    assocs_before: list[dict[str, str]] = field(default_factory=list)  # where + qos, defaultqos

    def owns_qos(self, name: str) -> bool:
        return name in self.created_qos or name in self.qos_before

    def to_json(self) -> dict:
        return {"version": RECORD_VERSION, "created_qos": sorted(self.created_qos),
                "created_partitions": sorted(self.created_partitions), "qos_before": self.qos_before,
                "partitions_before": self.partitions_before, "assocs_before": self.assocs_before}

    @classmethod
    def from_json(cls, data: Mapping) -> InstallRecord:
        if not isinstance(data, Mapping) or data.get("version") != RECORD_VERSION:
            raise ValueError(f"not an install record of version {RECORD_VERSION}")
        try:
            return cls(created_qos=[str(x) for x in data["created_qos"]],
                       created_partitions=[str(x) for x in data["created_partitions"]],
                       qos_before={str(k): {str(f): str(v) for f, v in s.items()} for k, s in data["qos_before"].items()},
                       partitions_before={str(k): {str(f): str(v) for f, v in s.items()}
                                          for k, s in data["partitions_before"].items()},
                       assocs_before=[{str(f): str(v) for f, v in a.items()} for a in data["assocs_before"]])
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed install record: {e}") from None


# ------------------------------------------------------------------ the site's QOS


def qos_conflicts(changes: list[Change], state: ClusterState, record: InstallRecord) -> list[str]:
    """The QOS of the site that `changes` would rewrite: they exist, slurm-hai did not add
    them and they are not adopted. Sorted; [] when none."""
    return sorted({c.where["name"] for c in changes if (c.op, c.entity) == ("modify", "qos")
                   and c.where.get("name") in state.qos and not record.owns_qos(c.where["name"])})


def conflict_warning(name: str, state: ClusterState) -> str:
    have = state.qos.get(name, {})
    shown = ", ".join(f"{k} {have.get(k.lower()) or '(none)'}" for k in ("Priority", "Preempt", "PreemptMode", "GraceTime"))
    return (f"warning: QOS {name} is the site's ({shown}): apply leaves it alone until `--adopt {name}` "
            "(remove puts its settings back), or name the level otherwise in [levels]")


# ------------------------------------------------------------------ recording apply's changes


def recorded(record: InstallRecord, changes: list[Change], state: ClusterState) -> InstallRecord:
    """`record` with what `changes` (about to be made on `state`) create, and the settings
    as they are of what they change of the site's for the first time."""
    assocs = {_assoc_key(a): a for a in record.assocs_before}
    for c in changes:
        if (c.op, c.entity) == ("add", "qos") and c.name not in record.created_qos:
            record.created_qos.append(c.name)
        elif (c.op, c.entity) == ("modify", "qos"):
            name = c.where["name"]
            if name in state.qos and not record.owns_qos(name):
                have = state.qos[name]
                record.qos_before[name] = {k: _as_set(k, have.get(k.lower(), "")) for k in c.settings}
            elif name in record.qos_before:  # adopted earlier: keep the first value of a field changed now
                have = state.qos.get(name, {})
                for k in c.settings:
                    record.qos_before[name].setdefault(k, _as_set(k, have.get(k.lower(), "")))
        elif c.op == "create" and c.entity == "partition" and c.name not in record.created_partitions:
            record.created_partitions.append(c.name)
        elif c.op == "update" and c.entity == "partition" and c.name not in record.created_partitions:
            have = (state.partitions or {}).get(c.name, {})
            before = record.partitions_before.setdefault(c.name, {})
            for k in c.settings:
                before.setdefault(k, partition_setting(have, k))
        elif c.op == "modify" and c.entity in ("user", "account"):
            key = _assoc_key({**c.where, "entity": c.entity})
            if key in assocs:
                continue
            row = next((r for r in state.assocs if _assoc_key(_where_of(r)) == key), None)
            if row is not None:  # a grant "for a moment" names a user row apply also changes itself
                assocs[key] = {**_where_of(row), "qos": row.get("QOS", ""), "defaultqos": row.get("DefaultQOS", "")}
    record.assocs_before = list(assocs.values())
    return record


def _as_set(key: str, shown: str) -> str:
    """A QOS field as `sacctmgr show qos` printed it, spelt as `modify qos set` takes it back."""
    if key in ("Preempt", "Flags"):
        return shown or ("" if key == "Preempt" else "-1")
    if key == "MaxTRESPU":
        return shown or "node=-1"
    if key == "PreemptExemptTime":
        return shown or "-1"
    if key == "GraceTime":
        return str(_seconds(shown))
    return shown


def _seconds(hms: str) -> int:
    days, _, rest = hms.rpartition("-")
    parts = [int(p) for p in rest.split(":") if p] if rest else [0]
    while len(parts) < 3:
        parts.insert(0, 0)
    h, m, s = parts[-3:]
    return (int(days) if days else 0) * 86400 + h * 3600 + m * 60 + s


def _where_of(row: Mapping[str, str]) -> dict[str, str]:
    """An association row as the `where` of the change that sets it."""
    if row.get("User"):
        return {"entity": "user", **user_where(row)}
    return {"entity": "account", "cluster": row.get("Cluster", ""), "name": row.get("Account", "")}


def _assoc_key(where: Mapping[str, str]) -> tuple[str, ...]:
    return tuple(where.get(k, "") for k in ("entity", "cluster", "account", "name", "partition"))


# ------------------------------------------------------------------ taking it out again


def removal_changes(record: InstallRecord, state: ClusterState) -> list[Change]:
    """Every change, in order, that takes out what `record` says slurm-hai made of `state`.

    Order: associations (our QOS out of their lists, their default back: a QOS may not go
    while it is a default), partitions (AllowQos may only name QOS that exist), the adopted
    QOS' settings back, then our QOS deleted (Slurm drops a deleted QOS from every Preempt
    list). [] when nothing is left to take out.

    No Preempt list is emptied before a later Preempt change could reach it: slurmdbd (seen
    on 22.05) keeps a stale copy of a list made shorter, and its loop check for a later
    change that reaches that QOS fails ("QOS Preemption loop detected"). So the adopted QOS
    whose list was empty come last, and our QOS are deleted with their lists as they are.
    """
    ours = set(record.created_qos)
    changes: list[Change] = []
    for before in record.assocs_before:
        key = _assoc_key(before)
        row = next((r for r in state.assocs if _assoc_key(_where_of(r)) == key), None)
        if row is None:
            continue
        have = name_set(row.get("QOS", ""))
        want = (have - ours) | (name_set(before["qos"]) & have)
        settings = {}
        if want != have:
            settings["qos"] = ",".join(sorted(want))
        default_now, default_before = row.get("DefaultQOS", "").lower(), before.get("defaultqos", "").lower()
        if default_now != default_before:
            settings["defaultqos"] = default_before or "-1"
        if settings:
            where = {k: v for k, v in before.items() if k not in ("entity", "qos", "defaultqos")}
            who = f"user {where['name']} in account {where.get('account', '')}" if before["entity"] == "user" \
                else f"account {where['name']}"
            changes.append(Change("modify", before["entity"], where=where, settings=settings,
                                  why=f"{who}: back to the QOS it had before slurm-hai"))
    parts = state.partitions if state.partitions is not None else {}
    for name in sorted(record.created_partitions):
        if name in parts:
            changes.append(Change("delete", "partition", name=name, why=f"partition {name} was slurm-hai's"))
    for name, before in sorted(record.partitions_before.items()):
        current = parts.get(name)
        if current is None:
            continue
        sets = {k: v for k, v in before.items() if partition_setting(current, k) != v and v != ""}
        if sets:
            changes.append(Change("update", "partition", name=name, settings=sets,
                                  why=f"partition {name}: back to the site's settings"))
    present = sorted(n for n in ours if n in state.qos)
    for name, before in sorted(record.qos_before.items(), key=lambda kv: (kv[1].get("Preempt") == "", kv[0])):
        if name in state.qos:
            changes.append(Change("modify", "qos", where={"name": name}, settings=dict(before),
                                  why=f"QOS {name}: back to the site's settings"))
    for name in sorted(present, key=lambda n: (parse_qos(n)[1] == "", n)):  # overrides before their level
        changes.append(Change("delete", "qos", where={"name": name}, why=f"QOS {name} was slurm-hai's"))
    return changes



# ------------------------------------------------------------------ the site's slurm.conf


def config_warnings(config: Mapping[str, str]) -> list[str]:
    """One line for each setting of `scontrol show config` that would defeat slurm-hai."""
    warnings = []
    mode = config.get("PreemptMode", "").upper()
    if "REQUEUE" not in mode:
        what = {"CANCEL": "cancels a preempted job instead of requeueing it: it never runs again",
                "OFF": "turns preemption off: no level takes nodes from a lower one",
                "SUSPEND": "suspends a preempted job in memory: its GPUs stay taken"}
        said = next((text for key, text in what.items() if key in mode), "does not requeue a preempted job")
        warnings.append(f"warning: slurm.conf PreemptMode={mode or '(none)'} {said}; "
                        "set PreemptMode=REQUEUE (hai-policy.conf from `hai-admin render` does)")
    ptype = config.get("PreemptType", "")
    if ptype and ptype != "preempt/qos":
        warnings.append(f"warning: slurm.conf PreemptType={ptype}: the levels are QOS, so set PreemptType=preempt/qos "
                        "(hai-policy.conf from `hai-admin render` does)")
    if config.get("JobRequeue", "1").strip() == "0":
        warnings.append("warning: slurm.conf JobRequeue=0: a job submitted without --requeue is cancelled when "
                        "preempted (hai-submit asks for --requeue; plain sbatch jobs do not); set JobRequeue=1")
    return warnings

