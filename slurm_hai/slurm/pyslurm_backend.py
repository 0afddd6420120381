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
from .records import PYSLURM, JobInfo, job_from_record


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

        where = f"pyslurm {getattr(pyslurm, '__version__', '?')} Jobs.load()"
        out = []
        for job in pyslurm.Jobs.load().values():
            rec = job.to_dict()
            if job_ids and rec.get("id") not in job_ids:
                continue
            if user and rec.get("user_name") != user:
                continue
            out.append(job_from_record(rec, PYSLURM, where))
        return out
