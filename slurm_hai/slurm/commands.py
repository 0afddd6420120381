"""How slurm-hai's typed Slurm operations are spelt as Slurm commands, and how the
commands' text is read back (pure: no process is started here; `cli.py` runs them).

- A policy change (`slurm_hai.policy.ladder.Change`) -> `sacctmgr -i ...` (accounting:
  add, modify, delete of a cluster, account, user or QOS) or `scontrol create|update|delete ...`
  (slurmctld: a partition). `hai-admin plan` prints exactly these argv, `apply` runs them.
- The job step the batch script runs -> `srun ...` (one task per node).
- The queue: `squeue.py`.
- `sacctmgr -n -P show ...` and `scontrol show node -o` text -> rows and NodeInfo.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Mapping, Sequence

from .base import NodeInfo

if TYPE_CHECKING:
    from ..policy.ladder import Change

ACCOUNTING_OPS = ("add", "modify", "delete")  # sacctmgr, on slurmdbd
ACCOUNTING_ENTITIES = ("cluster", "account", "user", "qos")
CONTROLLER_OPS = ("create", "update", "delete")  # scontrol, on slurmctld (lasts until it restarts)
CONTROLLER_KEYS = {"partition": "PartitionName"}  # entity -> the key that names it

# What the typed reads ask sacctmgr for (the keys of their rows).
QOS_FIELDS = ("Name", "Priority", "Preempt", "GraceTime", "PreemptMode", "MaxTRESPU", "PreemptExemptTime", "Flags")
ASSOC_FIELDS = ("Cluster", "Account", "User", "Partition", "QOS", "DefaultQOS")
USER_FIELDS = ("User", "DefaultAccount")

KEY = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


def change_argv(change: Change) -> list[str]:
    """The command that makes `change`; ValueError for an operation Slurm has no command for.

    add:    sacctmgr -i add ENTITY NAME KEY=VALUE...
    modify: sacctmgr -i modify ENTITY where KEY=VALUE... set KEY=VALUE...
    delete: sacctmgr -i delete ENTITY where KEY=VALUE...
    create/update/delete: scontrol create|update|delete PartitionName=NAME KEY=VALUE...
    """
    op, entity = change.op, change.entity
    if op in ACCOUNTING_OPS and entity in ACCOUNTING_ENTITIES:
        argv = ["sacctmgr", "-i", op, entity]
        if op == "add":
            return [*argv, _name(change), *_pairs(change.settings)]
        if not change.where:
            raise ValueError(f"{op} {entity} without `where` would change every {entity}")
        argv += ["where", *_pairs(change.where)]
        if op == "modify":
            if not change.settings:
                raise ValueError(f"modify {entity} with nothing to set")
            argv += ["set", *_pairs(change.settings)]
        return argv
    if op in CONTROLLER_OPS and entity in CONTROLLER_KEYS:
        return ["scontrol", op, f"{CONTROLLER_KEYS[entity]}={_name(change)}", *_pairs(change.settings)]
    raise ValueError(f"no Slurm command to {op} a {entity}")


def _name(change: Change) -> str:
    if not change.name or _blank(change.name):
        raise ValueError(f"{change.op} {change.entity} needs a name, not {change.name!r}")
    return change.name


def _pairs(fields: Mapping[str, str]) -> list[str]:
    for key, value in fields.items():
        if not KEY.match(key) or _blank(str(value)):
            raise ValueError(f"not a Slurm setting: {key}={value!r}")
    return [f"{key}={value}" for key, value in fields.items()]


def _blank(text: str) -> bool:
    """Whitespace would split one value into two arguments of the command."""
    return any(ch.isspace() for ch in text)


def show_argv(entity: str, fields: Sequence[str]) -> list[str]:
    return ["sacctmgr", "-n", "-P", "show", entity, "format=" + ",".join(fields)]


def parsable_rows(text: str, fields: Sequence[str]) -> list[dict[str, str]]:
    """`sacctmgr -n -P show ... format=FIELDS` -> one dict per line."""
    return [dict(zip(fields, line.split("|"))) for line in text.splitlines() if line.strip()]


GRES_GPU = re.compile(r"(?:^|,)gpu(?::[^:,()]+)?:(\d+)")


def nodes_from_text(text: str) -> list[NodeInfo]:
    """`scontrol show node -o` -> one NodeInfo per node (GPUs: the sum of its gpu GRES)."""
    nodes = []
    for line in text.splitlines():
        fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
        if "NodeName" not in fields:
            continue
        gpus = sum(int(n) for n in GRES_GPU.findall(fields.get("Gres", "")))
        parts = frozenset(p for p in fields.get("Partitions", "").split(",") if p)
        nodes.append(NodeInfo(fields["NodeName"], gpus, parts, fields.get("NodeAddr", "")))
    return nodes


def run_ends_argv(job_ids: Sequence[int]) -> list[str]:
    """sacct: one row per run (requeued runs too) of each job: its id and how the run ended."""
    return ["sacct", "--noheader", "--parsable2", "--allocations", "--duplicates", "--format=JobIDRaw,State",
            "--jobs=" + ",".join(map(str, job_ids))]


# A run's state that says it has not ended (the requeued job's new run is PENDING)
NOT_ENDED = ("PENDING", "RUNNING", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED")


def last_run_ends(text: str) -> dict[int, str]:
    """run_ends_argv's rows -> job id -> how its newest run before the pending one ended (the
    state's first word: "CANCELLED by 0" is CANCELLED). A job whose newest such run is not
    recorded as ended (slurmdbd not told yet) is left out."""
    runs: dict[int, list[str]] = {}
    for line in text.splitlines():
        job, _, state = line.strip().partition("|")
        if job.isdigit() and state:
            runs.setdefault(int(job), []).append(state.split(" ", 1)[0])
    ends: dict[int, str] = {}
    for job_id, states in runs.items():
        while states and states[-1] == "PENDING":
            states.pop()
        if states and states[-1] not in NOT_ENDED:
            ends[job_id] = states[-1]
    return ends


# After srun's --kill-on-bad-exit ended a step of several nodes (a task failed), a node's
# slurmstepd may remove the step's cgroup up to 3 s after the step ended: the kill
# (SIG_TERM_KILL) holds a connection to it for KillWait, and the stepd waits up to 3 s for
# its connections before it cleans up (STEPD_MESSAGE_COMP_WAIT; 24.11 and later). A step of the
# same job started there meanwhile has the same cgroup path and loses it (`Slurmd could not
# execve job`): runtime/batch.py requeues such a run for a retry no sooner than this after it.
KILLED_STEP_CLEANUP_S = 4.0


def step_argv(command: Sequence[str], nodes: int | str, gpus_per_node: int = 0, job_name: str = "hai") -> list[str]:
    """One job step running `command` once on each of `nodes` nodes: output unbuffered, and a
    task that fails ends the others."""
    argv = ["srun", f"--nodes={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--unbuffered",
            f"--job-name={job_name}"]
    if gpus_per_node:
        argv.append(f"--gres=gpu:{gpus_per_node}")
    return [*argv, *command]
