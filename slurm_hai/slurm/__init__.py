"""The one place slurm-hai talks to Slurm.

`backend()` returns the Slurm CLI backend (works on 22.05+), or the pyslurm backend when
HAI_SLURM_BACKEND=pyslurm is asked for, or when pyslurm is importable and built for the
running Slurm (pyslurm only exists for 25.11; see docs/design.md).
"""

from __future__ import annotations

import os

from .base import Backend, SlurmError
from .records import JobInfo

__all__ = ["Backend", "JobInfo", "SlurmError", "backend"]


def backend() -> Backend:
    choice = os.environ.get("HAI_SLURM_BACKEND", "auto")
    if choice in ("auto", "pyslurm"):
        from . import pyslurm_backend

        if pyslurm_backend.usable():
            return pyslurm_backend.PyslurmBackend()
        if choice == "pyslurm":
            raise SlurmError(f"HAI_SLURM_BACKEND=pyslurm but {pyslurm_backend.why_not()}; "
                             "unset it to use the Slurm commands")
    from .cli import CliBackend

    return CliBackend()
