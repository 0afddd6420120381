"""The one place slurm-hai talks to Slurm.

`backend()` returns the Slurm CLI backend (works on 22.05+), or the pyslurm backend when
HAI_SLURM_BACKEND=pyslurm is asked for, or when pyslurm is importable and built for the
running Slurm (pyslurm only exists for 25.11; see docs/design.md).

Importing the package loads only its errors (errors.py): `Backend` and `JobInfo` are loaded
when first named, so `hai` can start its first queue read (squeue.py) before the rest.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import TYPE_CHECKING

from .errors import SlurmError, SlurmMissing

if TYPE_CHECKING:
    from .base import Backend
    from .records import JobInfo

__all__ = ["Backend", "JobInfo", "SlurmError", "SlurmMissing", "backend", "config_missing", "forget_munge_socket", "munge_socket", "reads_with_commands"]

_LAZY = {"Backend": "base", "JobInfo": "records"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def backend(remember_queue: bool = False) -> Backend:
    """The backend HAI_SLURM_BACKEND names (auto: pyslurm where it is usable, else the
    commands). remember_queue: for a caller that reads the whole queue every few seconds (the
    policy daemon): the commands backend then reads into records only the ones that changed."""
    choice = os.environ.get("HAI_SLURM_BACKEND", "auto")
    if choice in ("auto", "pyslurm"):
        from . import pyslurm_backend  # lazy: pyslurm, an optional extra

        if pyslurm_backend.usable():
            return pyslurm_backend.PyslurmBackend()
        if choice == "pyslurm":
            raise SlurmError(f"HAI_SLURM_BACKEND=pyslurm but {pyslurm_backend.why_not()}; "
                             "unset it to use the Slurm commands")
    from .cli import CliBackend  # lazy: +15 ms to hai

    return CliBackend(remember_queue)


def reads_with_commands() -> bool:
    """Whether backend() reads the queue with squeue, as far as can be told without loading
    either backend: asked for (HAI_SLURM_BACKEND=cli), or chosen as no pyslurm is installed."""
    choice = os.environ.get("HAI_SLURM_BACKEND", "auto")
    if choice == "auto":
        return importlib.util.find_spec("pyslurm") is None
    return choice == "cli"


def config_missing() -> bool:
    """SLURM_CONF names no file: every Slurm command would retry for 60 s before failing."""
    conf = os.environ.get("SLURM_CONF")
    return conf is not None and conf != "" and not os.path.isfile(conf)


def munge_socket() -> str | None:
    """The MUNGE socket Slurm authenticates with (AuthInfo's `socket=`, or its older bare
    path); None, MUNGE's default socket, when Slurm names none or cannot be asked yet. A part's
    lighthouse ask is proven with it (runtime/parts.py), and checked on it (controller/lighthouse.py).
    Slurm's answer is kept; a Slurm that did not answer (a service started before slurmctld
    was: seen in CI, every credential then checked on the wrong socket) is asked again."""
    try:
        return _auth_info_socket()
    except (SlurmError, OSError):
        return None


@functools.cache
def _auth_info_socket() -> str | None:
    """munge_socket()'s answer from Slurm's configuration (SlurmError when it cannot be read)."""
    for item in backend().config().get("AuthInfo", "").split(","):
        key, sep, value = item.strip().partition("=")
        if sep and key == "socket":
            return value
        if not sep and key.startswith("/"):
            return key
    return None


def forget_munge_socket() -> None:
    """munge_socket() asks Slurm again (a process that moved to another cluster: tests)."""
    _auth_info_socket.cache_clear()
