"""Optional backend on pyslurm (>= 25.11, built against the running Slurm's headers).

pyslurm has no release for Slurm 22.05 (the version Debian 12 ships), so this backend cannot
be exercised on the local test cluster: it only replaces the read path (job listing) and
inherits every write from the CLI backend, so the untested surface stays small.
"""

from __future__ import annotations

import re
import shutil
import subprocess

from .cli import CliBackend
from .records import JobInfo, job_from_squeue


def _slurm_version() -> str | None:
    if not shutil.which("sinfo"):
        return None
    out = subprocess.run(["sinfo", "--version"], text=True, capture_output=True).stdout
    m = re.search(r"(\d+)\.(\d+)", out)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def why_not() -> str | None:
    """None when pyslurm is importable and made for this Slurm, else the reason it is not."""
    try:
        import pyslurm  # noqa: F401
    except ImportError:
        return "pyslurm is not installed"
    version = getattr(pyslurm, "__version__", "")
    running = _slurm_version()
    if not running or not version.startswith(running):
        return f"pyslurm {version or '?'} does not match Slurm {running or '?'}"
    return None


def usable() -> bool:
    return why_not() is None


class PyslurmBackend(CliBackend):
    name = "pyslurm"

    def jobs(self, job_ids=(), user=None) -> list[JobInfo]:
        import pyslurm

        out = []
        for job in pyslurm.Jobs.load().values():
            rec = job.to_dict()
            if job_ids and rec.get("id") not in job_ids:
                continue
            if user and rec.get("user_name") != user:
                continue
            out.append(job_from_squeue({
                "job_id": rec.get("id"), "name": rec.get("name"), "user_name": rec.get("user_name"),
                "job_state": rec.get("state"), "state_reason": rec.get("state_reason"), "qos": rec.get("qos"),
                "partition": rec.get("partition"), "node_count": rec.get("num_nodes"), "nodes": rec.get("nodes"),
                "restart_cnt": rec.get("requeue_count"), "submit_time": rec.get("submit_time"),
                "start_time": rec.get("start_time"), "eligible_time": rec.get("eligible_time"),
                "priority": rec.get("priority"), "batch_host": rec.get("batch_host"),
                "comment": rec.get("comment"), "admin_comment": rec.get("admin_comment"),
                "account": rec.get("account"), "preempt_time": rec.get("preempt_time"),
                "end_time": rec.get("end_time"),
            }))
        return out
