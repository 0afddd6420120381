"""The node-local persist agent: finishes the durable copy of suspend saves after the job
has let go of the node (`hai-admin persist-agent`; memory.py has the protocol).

One agent per node, started at boot (contrib/systemd/slurm-hai-persist.service; the local
cluster starts one inside each node). It owns the spool directory (root, mode 1733: anyone
may drop a request, nobody may touch another's) and writes its pid file there, which is
how a job learns that an agent runs. Each request is handled by a child process running
as the request file's owner (its uid, group and groups), so the agent can do nothing with
a request that its owner could not do: a request that names another user's memory part
fails on that user's permissions. A child that fails (disk full, the durable file system
away) leaves the request; it is tried again with a growing pause, up to MAX_ATTEMPTS, then
renamed to failed-<name>.

The agent also sweeps this node's memory: a job's directory there (HAI_NODE_MEMORY,
``/dev/shm/slurm-hai-<job>-memory-*``, and the runs' suspend-flag directories,
``slurm-hai-<job>.<run>-*``) outlives each run on purpose, for a restart on this node; once
Slurm says the job is over (not pending, running or suspended, seen twice a sweep apart)
and its owner has no request waiting, the agent removes it. A job that ends with exit 0
removes its own; this covers the cancelled, failed and killed ones.

Torch-free, like memory.py: the agent starts in a fraction of a second and copies with the
same fsynced, checksummed writes as the training job.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError
from .memory import AGENT_PIDFILE, persist_part, write_agent_pidfile

log = logging.getLogger("slurm_hai.persist_agent")

MAX_ATTEMPTS = 5
MAX_CHILDREN = 4
SWEEP_S = 30.0
# a job's node memory (slurm-hai-<job>-memory-*) or one of its runs' flag dirs (slurm-hai-<job>.<run>-*)
JOB_DIR = re.compile(r"slurm-hai-(\d+)[-.]")


class AgentError(Exception):
    """The agent cannot run (its spool is unsafe); one line for the admin."""


def prepare_spool(spool: Path) -> None:
    """Create the spool (1733, owned by the agent's user) or refuse one that someone else
    owns or that is a link: whoever owns it could read or forge requests."""
    try:
        spool.mkdir(mode=0o755, parents=True, exist_ok=True)
        st = os.lstat(spool)
    except OSError as exc:
        raise AgentError(f"cannot create the spool {spool}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise AgentError(f"{spool} is not a directory of uid {os.geteuid()}; remove it and start the agent again")
    os.chmod(spool, 0o1733)


@dataclass
class Request:
    path: Path
    uid: int
    attempts: int = 0
    next_try: float = 0.0
    child: subprocess.Popen | None = None


def _child_argv(path: Path) -> list[str]:
    return [sys.executable, "-m", "slurm_hai.checkpoint.agent", str(path)]


def _as_owner(uid: int) -> dict:
    """subprocess arguments that run a child as `uid`, with its own groups (root only)."""
    if os.geteuid() != 0:
        return {}
    user = pwd.getpwuid(uid)
    return {"user": uid, "group": user.pw_gid, "extra_groups": os.getgrouplist(user.pw_name, user.pw_gid)}


class Agent:
    """jobs_over(job ids) -> those of them Slurm says are over; None: no sweeping.
    memory_root: where jobs keep their node memory."""

    def __init__(self, spool: Path, jobs_over: Callable[[list[int]], set[int]] | None = None,
                 memory_root: Path = Path("/dev/shm"), sweep_s: float = SWEEP_S) -> None:
        self.spool = spool
        self.requests: dict[str, Request] = {}
        self.jobs_over, self.memory_root, self.sweep_s = jobs_over, memory_root, sweep_s
        self._over_before: set[str] = set()  # dirs whose job was over at the last sweep
        self._slurm_away = False  # said once per outage
        self._next_sweep = 0.0

    def sweep(self) -> list[str]:
        """Remove the node memory of jobs that are over: seen over at two sweeps in a row
        (a requeue in flight is never mistaken for an end), its owner with no request
        waiting (the agent may still need its parts). Returns what it removed."""
        dirs: dict[str, tuple[int, int]] = {}
        with os.scandir(self.memory_root) as entries:
            for entry in entries:
                if (m := JOB_DIR.match(entry.name)) and entry.is_dir(follow_symlinks=False):
                    dirs[entry.name] = (int(m.group(1)), entry.stat(follow_symlinks=False).st_uid)
        if not dirs or self.jobs_over is None:
            self._over_before = set()
            return []
        try:
            over = self.jobs_over(sorted({job for job, _ in dirs.values()}))
        except Exception as exc:  # noqa: BLE001 - Slurm away: keep everything, try again later
            (log.debug if self._slurm_away else log.warning)("not sweeping node memory: %s", exc)
            self._slurm_away = True
            return []
        if self._slurm_away:
            log.info("sweeping node memory again: Slurm answers")
            self._slurm_away = False
        waiting = {req.uid for req in self.requests.values()}
        over_now = {name for name, (job, uid) in dirs.items() if job in over and uid not in waiting}
        removed = sorted(over_now & self._over_before)
        for name in removed:
            shutil.rmtree(self.memory_root / name, ignore_errors=True)
            log.info("removed %s: job %d is over", self.memory_root / name, dirs[name][0])
        self._over_before = over_now - set(removed)
        return removed

    def scan(self) -> None:
        """Pick up new request files; forget ones that are gone (done)."""
        seen = set()
        for entry in os.scandir(self.spool):
            if entry.name.startswith((".", "failed-")) or entry.name == AGENT_PIDFILE or not entry.name.endswith(".json"):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # done between the listing and now: the persist child removes its request
            if not stat.S_ISREG(st.st_mode):
                continue
            if os.geteuid() != 0 and st.st_uid != os.geteuid():
                continue  # an unprivileged agent serves its own user only
            seen.add(entry.name)
            self.requests.setdefault(entry.name, Request(Path(entry.path), st.st_uid))
        for name in [n for n, r in self.requests.items() if n not in seen and r.child is None]:
            del self.requests[name]

    def step(self) -> None:
        now = time.monotonic()
        running = sum(r.child is not None for r in self.requests.values())
        for name, req in list(self.requests.items()):
            if req.child is not None:
                code = req.child.poll()
                if code is None:
                    continue
                req.child, running = None, running - 1
                if code == 0:
                    del self.requests[name]
                    continue
                req.attempts += 1
                if req.attempts >= MAX_ATTEMPTS:
                    log.error("giving up on %s after %d attempts; kept as failed-%s", name, req.attempts, name)
                    os.replace(req.path, self.spool / f"failed-{name}")
                    del self.requests[name]
                    continue
                req.next_try = now + min(2.0 ** req.attempts, 30.0)
            elif running < MAX_CHILDREN and now >= req.next_try and req.path.exists():
                req.child = subprocess.Popen(_child_argv(req.path), stdin=subprocess.DEVNULL, cwd="/",
                                             **_as_owner(req.uid))
                running += 1

    def serve(self, poll: float = 0.1, once: bool = False) -> None:
        write_agent_pidfile(self.spool)
        log.info("persist agent serving %s (pid %d)", self.spool, os.getpid())
        while True:
            self.scan()
            self.step()
            if once and not self.requests:
                return
            if time.monotonic() >= self._next_sweep:
                self._next_sweep = time.monotonic() + self.sweep_s
                try:
                    self.sweep()
                except OSError as exc:
                    log.warning("sweeping %s: %s", self.memory_root, exc)
            time.sleep(poll)


def _there(part: Path) -> bool:
    """False when the part is gone: its step was committed and the part recycled, or the
    job's memory removed (nothing to persist, now or later). Any other error (a request
    naming someone else's part) is persist_part's to report."""
    try:
        part.stat()
    except FileNotFoundError:
        return False
    except OSError:
        pass
    return True


def handle(request: Path) -> int:
    """The child: persist one request's part as its owner; remove the request when done."""
    try:
        part = Path(json.loads(request.read_text())["part"])
        outcome = persist_part(part) if _there(part) else "gone"
    except (OSError, ValueError, KeyError, TypeError, CheckpointError) as exc:
        print(f"slurm-hai persist: {request.name}: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"slurm-hai persist: {request.name}: {outcome}", flush=True)
    request.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(handle(Path(sys.argv[1])))
