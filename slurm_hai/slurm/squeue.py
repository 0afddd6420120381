"""How slurm-hai asks Slurm for the queue, and a read started ahead of its use.

The queue -> `squeue --noheader --states=all --Format=FIELD:0SEP,...` of the fields in
FIELDS (records.py reads each back), unpadded and each followed by SEP, a token made at
random for each read, in the environment `queue_env` gives (epoch times, none of the user's
SQUEUE_* defaults).

Standard library only and nothing else loaded: `hai` starts the read its command makes first
(`start_ahead`) before Python has loaded the command (the imports take about as long as
squeue over a large queue, so the two overlap); the commands backend's jobs() takes it (`take`) when its call is the
same, else starts its own.
"""

from __future__ import annotations

import os
import subprocess
from typing import Mapping, NamedTuple, Sequence

# JobInfo field -> squeue --Format field, in JobInfo's order (records.QUEUE_FORMAT adds how
# each is read back)
FIELDS = (
    ("job_id", "JobId"), ("name", "Name"), ("user", "UserName"), ("state", "State"), ("reason", "Reason"),
    ("qos", "QOS"), ("partition", "Partition"), ("num_nodes", "NumNodes"), ("node_list", "NodeList"),
    ("restart_count", "RestartCnt"), ("submit_time", "SubmitTime"), ("start_time", "StartTime"),
    ("eligible_time", "EligibleTime"), ("priority", "PriorityLong"), ("exit_code", "exit_code"),
    ("batch_host", "BatchHost"), ("comment", "Comment"), ("admin_comment", "admin_comment"),
    ("account", "Account"), ("preempt_time", "PreemptTime"), ("end_time", "EndTime"),
    ("array_job_id", "ArrayJobID"),
)


def queue_argv(sep: str, job_ids: Sequence[int] = (), user: str | None = None) -> list[str]:
    """squeue of the jobs slurmctld has (every state: the ones that ended a moment ago too),
    or of the ones asked for, each field of FIELDS unpadded and followed by `sep` (a token
    without a comma: squeue splits --Format at commas)."""
    if not sep or "," in sep or "%" in sep or not sep.isprintable():
        raise ValueError(f"not a field separator for squeue --Format: {sep!r}")
    argv = ["squeue", "--noheader", "--states=all", "--Format=" + ",".join(f"{field}:0{sep}" for _, field in FIELDS)]
    if job_ids:
        argv.append("--jobs=" + ",".join(str(j) for j in job_ids))
    if user:
        argv.append(f"--user={user}")
    return argv


def queue_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment for queue_argv's squeue: times as epoch seconds, and without the
    SQUEUE_* variables a user may set for their own squeue (a default partition, user or
    state filter would hide jobs from slurm-hai; a format or sort is not asked for)."""
    return {**{k: v for k, v in env.items() if not k.startswith("SQUEUE_")}, "SLURM_TIME_FORMAT": "%s"}


class Read(NamedTuple):
    """A queue read, started: its separator, its command, its process."""

    sep: str
    argv: list[str]
    proc: subprocess.Popen


def start(job_ids: Sequence[int] = (), user: str | None = None) -> Read:
    """squeue of the jobs, started (OSError when it cannot be); a new random separator each."""
    sep = f"~{os.urandom(8).hex()}~"
    argv = queue_argv(sep, job_ids, user)
    proc = subprocess.Popen(argv, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=queue_env(os.environ))
    return Read(sep, argv, proc)


_ahead: dict[tuple[tuple[int, ...], str | None], Read] = {}


def start_ahead(job_ids: Sequence[int] = (), user: str | None = None) -> None:
    """Start the read of jobs(job_ids, user) now, for the first such call to take. Nothing is
    started when squeue cannot be run: the call itself then says why."""
    key = (tuple(job_ids), user)
    if key in _ahead:
        return
    try:
        _ahead[key] = start(job_ids, user)
    except OSError:
        pass


def take(job_ids: Sequence[int] = (), user: str | None = None) -> Read | None:
    """The read of jobs(job_ids, user) started ahead, once; None when there is none."""
    return _ahead.pop((tuple(job_ids), user), None)
