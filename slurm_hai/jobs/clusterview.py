"""What hai-submit asks Slurm of the cluster before it submits (jobs/submit.py): the node
groups (Slurm's partitions, with their limits), the GPUs of each group's nodes, and whether a
preempted job gets its own signal rather than SIGTERM.

Three Slurm commands (`scontrol show partition`, `show node`, `show config`): most of a
submission's cost beside sbatch, and on a busy login node three processes and three slurmctld
RPCs per job of a sweep (docs/results-archive.md, "A burst of submissions"). A user's submissions
in a row ask them once per VIEW_TTL_S: the answer is kept in the user's HAI_HOME
(`cluster-view.HOST.json`, mode 0600), for this host, this SLURM_CONF and SLURM_CLUSTERS, and
slurm.conf as it is (an edit of it, which a reconfigure follows, makes the view old at once).
Each view is kept for its own share of VIEW_TTL_S, drawn when it is asked (FRESH_SHARE): users
who start a sweep at the same moment would otherwise all ask Slurm again at the same moment
too, each 10 s (a burst of 10 users' submissions, docs/results-archive.md: one cluster of the
slowest 1%).
The notice's signal is slurm.conf's alone (no `scontrol update` changes it): it is kept up to
SIGNAL_TTL_S while the key holds, so that most views are asked with two commands. The CLI
backend's commands are asked at once, not one after the other (each waits on its process and
on slurmctld, so together they take about as long as the slowest one).

A kept view never refuses: a request it would refuse is checked again against what Slurm
says now (a node group added a moment ago is found). What a kept view can have wrong, for at
most VIEW_TTL_S after an admin changed the cluster without editing slurm.conf (`scontrol
update`): a group's limits (Slurm applies its own at sbatch) and the GPUs its nodes have (the
default --gpus-per-node). A dry run asks Slurm each time.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..slurm import Backend
from .jobdir import write_atomic

VIEW_TTL_S = 10.0
FRESH_SHARE = (0.7, 1.0)  # a view is kept for a share of VIEW_TTL_S drawn from this range
SIGNAL_TTL_S = 3600.0


@dataclass(frozen=True)
class ClusterView:
    partitions: list[dict[str, str]]  # `scontrol show partition -o`, KEY=VALUE each
    gpus: dict[str, list[int]]  # node group -> the GPUs of each of its nodes
    user_signal: bool | None  # a preempted job gets its --signal (else SIGTERM); None: not asked
    kept: bool = False  # read from the user's file, fresh (its share of VIEW_TTL_S), not asked of Slurm now
    signal_taken: float = 0.0  # when user_signal was asked (epoch)


def asked(slurm: Backend, notice: bool = True, signal_of: ClusterView | None = None) -> ClusterView:
    """The view as Slurm gives it now: the notice's signal only if `notice`, and not where
    `signal_of` (a view asked before) gives it."""
    calls: list[Callable[[], object]] = [slurm.partitions, slurm.nodes]
    if notice and signal_of is None:
        calls.append(slurm.preempt_sends_user_signal)
    answers: list[Any] = _at_once(calls) if slurm.name == "cli" else [call() for call in calls]
    gpus: dict[str, list[int]] = {}
    for node in answers[1]:
        for group in node.partitions:
            gpus.setdefault(group, []).append(node.gpus)
    if signal_of is not None:
        return ClusterView(answers[0], gpus, signal_of.user_signal, signal_taken=signal_of.signal_taken)
    return ClusterView(answers[0], gpus, answers[2] if notice else None, signal_taken=time.time())


def _at_once(calls: list[Callable[[], object]]) -> list[object]:
    """Each call on a thread of its own, at once (a Slurm command of the CLI backend waits on
    its process and slurmctld); their answers in order, or the first one's error."""
    answers: list[object] = [None] * len(calls)
    errors: list[BaseException | None] = [None] * len(calls)

    def call(i: int) -> None:
        try:
            answers[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
            errors[i] = e

    threads = [threading.Thread(target=call, args=(i,)) for i in range(1, len(calls))]
    for thread in threads:
        thread.start()
    call(0)
    for thread in threads:
        thread.join()
    for error in errors:
        if error is not None:
            raise error
    return answers


def cluster_view(slurm: Backend, home: Path, fresh: bool = False) -> ClusterView:
    """The view kept in `home` if it is fresh and of this host and Slurm (and not `fresh`
    asked for), else Slurm's now (then kept, where `home` can be written); a notice's signal
    kept for this key is asked again only after SIGNAL_TTL_S."""
    path = home / f"cluster-view.{socket.gethostname()}.json"
    key = _key(slurm)
    kept = _read(path, key)
    if kept is not None and kept.kept and not fresh:
        return kept
    signal_of = kept if kept is not None and 0 <= time.time() - kept.signal_taken < SIGNAL_TTL_S else None
    view = asked(slurm, signal_of=signal_of)
    try:
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        # no fsync: a view lost or cut by a power loss is asked again (_read takes it as none),
        # and two fsyncs would lengthen every submission, far more on a disk busy with a burst
        write_atomic(path, json.dumps({"key": key, "taken": time.time(),
                                       "fresh_s": VIEW_TTL_S * random.uniform(*FRESH_SHARE), "partitions": view.partitions,
                                       "gpus": view.gpus, "user_signal": view.user_signal,
                                       "signal_taken": view.signal_taken}), durable=False)
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
    """The view kept for `key`, whatever its age: kept=True while fresh (its `fresh_s`, at
    most VIEW_TTL_S), else only its notice's signal may be used (signal_taken). None: no such
    file, another key, or a file that does not parse as one."""
    try:
        data = json.loads(path.read_text())
        age = time.time() - float(data["taken"])
        fresh_s = min(float(data.get("fresh_s", VIEW_TTL_S)), VIEW_TTL_S)
        signal_taken = float(data.get("signal_taken", data["taken"]))
        partitions, gpus, user_signal = data["partitions"], data["gpus"], data["user_signal"]
        same = data["key"] == key
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    well_formed = (isinstance(partitions, list) and all(isinstance(p, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in p.items()) for p in partitions)
        and isinstance(gpus, dict) and all(isinstance(g, list) and all(type(n) is int for n in g) for g in gpus.values())
        and isinstance(user_signal, bool))
    if not (same and well_formed):
        return None
    return ClusterView(partitions, gpus, user_signal, kept=0 <= age < fresh_s, signal_taken=signal_taken)
