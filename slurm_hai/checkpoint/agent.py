"""The node-local persist agent: finishes the durable copy of suspend saves after the job
has let go of the node (`hai-admin persist-agent`; memory.py has the protocol).

One agent per node, started at boot (slurm-hai-persist.service of `hai-admin units`; the local
cluster starts one inside each node). It owns the spool directory (root, mode 1733: anyone
may drop a request, nobody may touch another's) and writes its pid file there, which is
how a job learns that an agent runs. The spool's parent must be a directory only root can
write to (/run/slurm-hai): else anyone could take the spool's name while no agent runs.

Everything in a request is a user's, so the agent bounds it. The agent itself only looks at
a request's directory entry: a link, FIFO, device, socket or directory, a file over
REQUEST_MAX_BYTES, or a user's request past MAX_WAITING_PER_UID is refused at once (one
line in its log, renamed to failed-<name>, never retried). Each other request is handled by
a child: a fresh interpreter (`python -I -m slurm_hai.checkpoint.agent REQUEST`, fork and
exec, with a fixed environment and no descriptor of the agent's), running our code as the
request file's owner (its uid, group and groups), so the child holds nothing of another
user's and can do nothing that the owner could not: a request that names another user's
memory part fails on that user's permissions. The child opens every file it reads without
following links or blocking (memory.open_regular), so a FIFO or a link in place of the
request or a part file is refused (exit REFUSED: failed-<name> at once), as is a request
that is not {"part": "/absolute/path"}. Children are shared fairly: at most one per user at
a time, MAX_CHILDREN in all, the next one for the user who waited longest since their last
(round robin), and each is killed after child_timeout_s. A child that fails or is killed (disk
full, the durable file system away) leaves the request; it is tried again with a growing
pause, up to MAX_ATTEMPTS, then renamed to failed-<name>.

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

import itertools
import json
import logging
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError
from .memory import (AGENT_PIDFILE, FAILED_PREFIX, UnsafeFile, file_kind, open_regular, persist_part,
                     write_agent_pidfile)

log = logging.getLogger("slurm_hai.persist_agent")

MAX_ATTEMPTS = 5
MAX_CHILDREN = 4
MAX_WAITING_PER_UID = 64  # a suspend save files one or two per node; more is someone flooding
REQUEST_MAX_BYTES = 4096  # {"part": path}: a path is at most 4096 bytes
CHILD_TIMEOUT_S = 3600.0  # a node's share at 100 MB/s: 360 GB
REFUSED = 3  # the child's exit status for a request refused for good (not retried)
CHILD_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
CHILD_ENV_KEPT = ("HAI_PEER_GRACE_S",)  # the admin's (memory._peer_grace_s), never a user's
SWEEP_S = 30.0
# a job's node memory (slurm-hai-<job>-memory-*) or one of its runs' flag dirs (slurm-hai-<job>.<run>-*)
JOB_DIR = re.compile(r"slurm-hai-(\d+)[-.]")


class AgentError(Exception):
    """The agent cannot run (its spool is unsafe); one line for the admin."""


def unsafe_place(spool: Path) -> str | None:
    """Why the spool's place is unsafe, or None. Its parent and each directory above must be
    a real directory of root (or of the agent's user) that nobody else can write to; above
    the parent a sticky one (/tmp) will do, as nobody else can rename what is in it."""
    trusted = {0, os.geteuid()}
    for i, d in enumerate(spool.parents):
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode):
            return f"{d} is {file_kind(st.st_mode)}"
        if st.st_uid not in trusted:
            return f"{d} belongs to uid {st.st_uid}"
        if st.st_mode & 0o022 and (i == 0 or not st.st_mode & stat.S_ISVTX):
            return f"others can create entries in {d} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def prepare_spool(spool: Path) -> None:
    """Create the spool (1733, owned by the agent's user) and the directories above it
    (0755), or refuse a spool that is a link or someone else's, or whose place is unsafe:
    whoever can rename or own it could read or forge requests."""
    spool = Path(os.path.abspath(spool))
    try:
        for d in reversed([d for d in spool.parents if not os.path.lexists(d)]):
            os.mkdir(d, 0o755)
            os.chmod(d, 0o755)  # not narrowed by the umask: jobs must reach the spool
        if (why := unsafe_place(spool)) is not None:
            raise AgentError(f"cannot use the spool {spool}: {why}; give the agent a spool in a directory only root "
                             "can write to (default /run/slurm-hai/persist)")
        if not os.path.lexists(spool):
            os.mkdir(spool, 0o700)
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
    order: int  # when the agent first saw it: a user's requests run oldest first
    attempts: int = 0
    next_try: float = 0.0
    child: subprocess.Popen | None = None
    started: float = 0.0


def refusal(st: os.stat_result) -> str | None:
    """Why the agent refuses a request file from its directory entry alone, or None."""
    if not stat.S_ISREG(st.st_mode):
        return f"{file_kind(st.st_mode)}, not a regular file"
    if st.st_size > REQUEST_MAX_BYTES:
        return f"{st.st_size} bytes, over the {REQUEST_MAX_BYTES} of a request"
    return None


def next_request(requests: Iterable[Request], now: float, turns: dict[int, int],
                 max_children: int = MAX_CHILDREN) -> Request | None:
    """The request to start now, or None: one child per user at most, max_children in all;
    among users with a request due, the one whose last child started longest ago (never:
    first), and of theirs the oldest."""
    requests = list(requests)
    running = {r.uid for r in requests if r.child is not None}
    if len(running) >= max_children:
        return None
    due = [r for r in requests if r.child is None and r.uid not in running and now >= r.next_try]
    return min(due, key=lambda r: (turns.get(r.uid, -1), r.order), default=None)


def child_argv(request: Path) -> list[str]:
    """A fresh interpreter (-I: no user site-packages, no PYTHON* variables, not the working
    directory on the path), so that only our code runs, and nothing of the agent's memory."""
    return [sys.executable, "-I", "-m", "slurm_hai.checkpoint.agent", str(request)]


def child_env() -> dict[str, str]:
    return {"PATH": CHILD_PATH, "LANG": "C.UTF-8",
            **{key: os.environ[key] for key in CHILD_ENV_KEPT if key in os.environ}}


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
                 memory_root: Path = Path("/dev/shm"), sweep_s: float = SWEEP_S,
                 child_timeout_s: float = CHILD_TIMEOUT_S) -> None:
        self.spool = spool
        self.requests: dict[str, Request] = {}
        self.jobs_over, self.memory_root, self.sweep_s = jobs_over, memory_root, sweep_s
        self.child_timeout_s = child_timeout_s
        self.turns: dict[int, int] = {}  # uid -> when (in starts) their last child started
        self._starts = itertools.count()
        self._seen = itertools.count()
        self._stuck: set[str] = set()  # refused, and could not be renamed: not looked at again
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
        """Pick up new request files (refusing those whose entry shows they are not one);
        forget ones that are gone (done)."""
        seen, new = set(), []
        for entry in os.scandir(self.spool):
            name = entry.name
            if name.startswith((".", FAILED_PREFIX)) or name == AGENT_PIDFILE or not name.endswith(".json"):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # done between the listing and now: the persist child removes its request
            if os.geteuid() != 0 and st.st_uid != os.geteuid():
                continue  # an unprivileged agent serves its own user only
            seen.add(name)
            if name not in self.requests and name not in self._stuck:
                new.append((st.st_mtime_ns, name, st))
        waiting: dict[int, int] = {}
        for req in self.requests.values():
            waiting[req.uid] = waiting.get(req.uid, 0) + 1
        for _, name, st in sorted(new):
            why = refusal(st)
            if why is None and waiting.get(st.st_uid, 0) >= MAX_WAITING_PER_UID:
                why = f"uid {st.st_uid} has {MAX_WAITING_PER_UID} requests waiting already"
            if why is not None:
                self._refuse(name, st.st_uid, why)
                continue
            waiting[st.st_uid] = waiting.get(st.st_uid, 0) + 1
            self.requests[name] = Request(self.spool / name, st.st_uid, next(self._seen))
        for name in [n for n, r in self.requests.items() if n not in seen and r.child is None]:
            del self.requests[name]
        self._stuck &= seen

    def _refuse(self, name: str, uid: int, why: str | None) -> None:
        """Rename a request to failed-<name> (why: say so in one line; None: its child did)."""
        if why is not None:
            log.error("refused %s of uid %d: %s; kept as %s%s", name, uid, why, FAILED_PREFIX, name)
        try:
            os.replace(self.spool / name, self.spool / f"{FAILED_PREFIX}{name}")
        except FileNotFoundError:
            pass
        except OSError as exc:  # e.g. failed-<name> is a directory someone left: leave it be
            log.error("could not rename %s to %s%s (%s): not looking at it again", name, FAILED_PREFIX, name,
                      exc.strerror or exc)
            self._stuck.add(name)
        self.requests.pop(name, None)

    def _start(self, name: str, req: Request, now: float) -> None:
        try:
            req.child = subprocess.Popen(child_argv(req.path), stdin=subprocess.DEVNULL, cwd="/", env=child_env(),
                                         close_fds=True, start_new_session=True, **_as_owner(req.uid))
        except KeyError:
            self._refuse(name, req.uid, f"no user has uid {req.uid}")
            return
        except OSError as exc:
            log.error("cannot start the child for %s: %s", name, exc.strerror or exc)
            self._retry(name, req, now)
            return
        req.started = now
        self.turns[req.uid] = next(self._starts)

    def _retry(self, name: str, req: Request, now: float) -> None:
        req.attempts += 1
        if req.attempts >= MAX_ATTEMPTS:
            log.error("giving up on %s after %d attempts; kept as %s%s", name, req.attempts, FAILED_PREFIX, name)
            self._refuse(name, req.uid, None)
        else:
            req.next_try = now + min(2.0 ** req.attempts, 30.0)

    def step(self) -> None:
        """Reap (or kill, past the time limit) the children, then start what is due."""
        now = time.monotonic()
        for name, req in list(self.requests.items()):
            if req.child is None:
                continue
            code = req.child.poll()
            if code is None:
                if now - req.started < self.child_timeout_s:
                    continue
                log.error("%s of uid %d: its child ran past %g s; killed", name, req.uid, self.child_timeout_s)
                os.killpg(req.child.pid, signal.SIGKILL)
                code = req.child.wait()
            req.child = None
            if code == 0:
                del self.requests[name]
            elif code == REFUSED:
                self._refuse(name, req.uid, None)
            else:
                self._retry(name, req, now)
        while (due := next_request(self.requests.values(), now, self.turns)) is not None:
            self._start(due.path.name, due, now)

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


def read_request(request: Path) -> Path:
    """The part a request names: a regular file of this user's, at most REQUEST_MAX_BYTES, of
    {"part": "/absolute/path"}; else UnsafeFile."""
    with open(open_regular(request), "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid():
            raise UnsafeFile(f"the request belongs to uid {st.st_uid}, not {os.getuid()}")
        data = f.read(REQUEST_MAX_BYTES + 1)
    if len(data) > REQUEST_MAX_BYTES:
        raise UnsafeFile(f"over {REQUEST_MAX_BYTES} bytes")
    try:
        part = json.loads(data)["part"]
    except (ValueError, KeyError, TypeError):
        raise UnsafeFile('not {"part": PATH} in JSON') from None
    if not isinstance(part, str) or not part.startswith("/") or "\0" in part:
        raise UnsafeFile("its part is not an absolute path")
    return Path(part)


def _there(part: Path) -> bool:
    """False when the part is gone: its step was committed and the part recycled, or the
    job's memory removed (nothing to persist, now or later). A part that is not a directory
    is refused; any other error (a request naming someone else's part) is persist_part's."""
    try:
        st = os.lstat(part)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFile(f"{part} is {file_kind(st.st_mode)}, not a directory")
    return True


def handle(request: Path) -> int:
    """The child: persist one request's part as its owner; remove the request when done.
    Exit 0: done; REFUSED: refused for good; 1: to be tried again."""
    try:
        part = read_request(request)
        outcome = persist_part(part) if _there(part) else "gone"
    except UnsafeFile as exc:
        print(f"slurm-hai persist: {request.name}: refused, kept as {FAILED_PREFIX}{request.name}: {exc}",
              file=sys.stderr, flush=True)
        return REFUSED
    except (OSError, CheckpointError) as exc:
        print(f"slurm-hai persist: {request.name}: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"slurm-hai persist: {request.name}: {outcome}", flush=True)
    request.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(handle(Path(sys.argv[1])))
