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

Torch-free, like memory.py: the agent starts in a fraction of a second and copies with the
same fsynced, checksummed writes as the training job.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError
from .memory import AGENT_PIDFILE, persist_part, write_agent_pidfile

log = logging.getLogger("slurm_hai.persist_agent")

MAX_ATTEMPTS = 5
MAX_CHILDREN = 4


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
    def __init__(self, spool: Path) -> None:
        self.spool = spool
        self.requests: dict[str, Request] = {}

    def scan(self) -> None:
        """Pick up new request files; forget ones that are gone (done)."""
        seen = set()
        for entry in os.scandir(self.spool):
            if entry.name.startswith((".", "failed-")) or entry.name == AGENT_PIDFILE or not entry.name.endswith(".json"):
                continue
            st = entry.stat(follow_symlinks=False)
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
            time.sleep(poll)


def handle(request: Path) -> int:
    """The child: persist one request's part as its owner; remove the request when done."""
    try:
        part = Path(json.loads(request.read_text())["part"])
        outcome = persist_part(part)
    except (OSError, ValueError, KeyError, TypeError, CheckpointError) as exc:
        print(f"slurm-hai persist: {request.name}: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"slurm-hai persist: {request.name}: {outcome}", flush=True)
    request.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(handle(Path(sys.argv[1])))
