"""What hai-submit asks Slurm of the cluster before it submits (jobs/submit.py): the node
groups (Slurm's partitions, with their limits), the GPUs of each group's nodes, and whether a
preempted job gets its own signal rather than SIGTERM.

Three Slurm commands (`scontrol show partition`, `show node`, `show config`): most of a
submission's cost beside sbatch, and on a busy login node three processes and three slurmctld
RPCs per job of a sweep (docs/benchmarks.md, "A burst of submissions"). A user's submissions
in a row ask them once per VIEW_TTL_S: the answer is kept in the user's HAI_HOME
(`cluster-view.HOST.json`, mode 0600), for this host, this SLURM_CONF and SLURM_CLUSTERS, and
slurm.conf as it is (an edit of it, which a reconfigure follows, makes the view old at once).

A kept view never refuses: a request it would refuse is checked again against what Slurm
says now (a node group added a moment ago is found). What a kept view can have wrong, for at
most VIEW_TTL_S after an admin changed the cluster without editing slurm.conf (`scontrol
update`): a group's limits (Slurm applies its own at sbatch) and the GPUs its nodes have (the
default --gpus-per-node). A dry run asks Slurm each time.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from ..slurm import Backend
from .jobdir import write_atomic

VIEW_TTL_S = 10.0


@dataclass(frozen=True)
class ClusterView:
    partitions: list[dict[str, str]]  # `scontrol show partition -o`, KEY=VALUE each
    gpus: dict[str, list[int]]  # node group -> the GPUs of each of its nodes
    user_signal: bool | None  # a preempted job gets its --signal (else SIGTERM); None: not asked
    kept: bool = False  # read from the user's file, not from Slurm now


def asked(slurm: Backend, notice: bool = True) -> ClusterView:
    """The view as Slurm gives it now (the notice's signal only if `notice`)."""
    partitions = slurm.partitions()
    gpus: dict[str, list[int]] = {}
    for node in slurm.nodes():
        for group in node.partitions:
            gpus.setdefault(group, []).append(node.gpus)
    return ClusterView(partitions, gpus, slurm.preempt_sends_user_signal() if notice else None)


def cluster_view(slurm: Backend, home: Path, fresh: bool = False) -> ClusterView:
    """The view kept in `home` if it is fresh and of this host and Slurm (and not `fresh`
    asked for), else Slurm's now (then kept, where `home` can be written)."""
    path = home / f"cluster-view.{socket.gethostname()}.json"
    key = _key(slurm)
    kept = None if fresh else _read(path, key)
    if kept is not None:
        return kept
    view = asked(slurm)
    try:
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"key": key, "taken": time.time(), "partitions": view.partitions,
                                       "gpus": view.gpus, "user_signal": view.user_signal}))
    except OSError:
        pass  # a home that cannot be written: asked each time
    return view


# Where Slurm's commands find slurm.conf without SLURM_CONF: Debian's packages, and the copy a
# configless cluster's sackd or slurmd keeps (both rewritten by a change and its reconfigure).
CONF_FILES = ("/etc/slurm/slurm.conf", "/run/slurm/conf/slurm.conf")


def _key(slurm: Backend) -> list[str]:
    """What a kept view is of: the backend, the cluster asked, and slurm.conf as it is now
    (a reconfigure after an edit makes the view old at once)."""
    conf = os.environ.get("SLURM_CONF", "")
    stamps = []
    for path in (conf,) if conf else CONF_FILES:
        try:
            st = os.stat(path)
        except OSError:
            continue
        stamps.append(f"{path} {st.st_mtime_ns} {st.st_size}")
    return [slurm.name, conf, os.environ.get("SLURM_CLUSTERS", ""), *stamps]


def _read(path: Path, key: list[str]) -> ClusterView | None:
    try:
        data = json.loads(path.read_text())
        fresh = data["key"] == key and 0 <= time.time() - float(data["taken"]) < VIEW_TTL_S
        partitions, gpus, user_signal = data["partitions"], data["gpus"], data["user_signal"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    well_formed = (isinstance(partitions, list) and all(isinstance(p, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in p.items()) for p in partitions)
        and isinstance(gpus, dict) and all(isinstance(g, list) and all(type(n) is int for n in g) for g in gpus.values())
        and isinstance(user_signal, bool))
    return ClusterView(partitions, gpus, user_signal, kept=True) if fresh and well_formed else None
