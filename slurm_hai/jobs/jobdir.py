"""The per-job state directory: markers, events, logs, whole-life state (stdlib only).

Layout (docs/design.md), private to the job's user (0700 dirs, 0600 files), on a file
system every node of the job sees (by default ~/.hai/jobs/<job id>):

    job.json              what hai-submit asked for (name, level, nodes, command, ...)
    events.jsonl          one JSON object per line: submit, start, notice, suspend, ...
    logs/rank-<R>.log     the user's output on node rank R, all runs appended, each
                          run opened by a "==== slurm-hai run K ..." line
    whole_life_state      one integer kept across restarts
    threads               threads per process of every run, fixed by the first (runtime/launcher.py)
    submit_token          which submission owns this directory (see JobDir.claim)
    suspend.<K>           run K ended by a suspend (go_suspend or forced), not a failure
    retries_used          how many --retries were spent (retries_used.lock: one at a time)
    final.json            the job ended for good: {"state": succeeded|failed|stopped, ...}

The batch script's own output (Slurm's --output) is `<root>/batch-<job id>.log`, beside the
job directory: Slurm opens it before the directory exists.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import math
import os
import pwd
import stat
import time
from pathlib import Path
from typing import BinaryIO, Iterable

FINAL_STATES = ("succeeded", "failed", "stopped")
# How long a claim waits for another claimant of the same directory to decide (jobdir.claim):
# it takes milliseconds; one that died deciding leaves its marker, and this one decides then.
CLAIM_WAIT_S = 10.0
MAX_EVENTS_READ = 4 << 20  # a job's events.jsonl holds a few KiB a run; of a larger one, its last 4 MiB


def default_root() -> Path:
    return Path(os.environ.get("HAI_HOME") or Path.home() / ".hai") / "jobs"


@functools.lru_cache(maxsize=4096)
def user_uid(user: str) -> int | None:
    """The uid of a user name, None for a name this host does not know."""
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None


def owned(st: os.stat_result, uid: int | None) -> bool:
    """A regular file (not a link) owned by `uid`: what root may trust in a job directory,
    which its user controls (the policy daemon reads them so)."""
    return uid is not None and stat.S_ISREG(st.st_mode) and st.st_uid == uid


def open_owned(path: Path, uid: int | None) -> BinaryIO:
    """Open for reading a file of a job directory, whose user may put anything there: without
    following a link, without blocking (a FIFO's open waits for a writer). OSError as open's
    (FileNotFoundError: none yet), or PermissionError when it is not `owned` by `uid`
    (None: any owner, for a reader of its own files)."""
    fh = open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC), "rb")
    st = os.fstat(fh.fileno())
    if not stat.S_ISREG(st.st_mode) or (uid is not None and st.st_uid != uid):
        fh.close()
        raise PermissionError(f"{path} is not a regular file of the job's user")
    return fh


def parse_event(line: bytes | str) -> dict | None:
    """One line of events.jsonl as an event (`t` a finite float, `event` a string, `run` and
    `part` ints), None for a line that is none: cut by a crash mid-write, or made up by the
    job's user (`[[[[...` nested past the parser, `Infinity`, a bare number)."""
    try:
        e = json.loads(line)
        e["t"], e["run"] = float(e["t"]), int(e.get("run", 0) or 0)
        if "part" in e:
            e["part"] = int(e["part"])
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError):
        return None
    return e if math.isfinite(e["t"]) and isinstance(e.get("event"), str) else None


def events_in(path: Path, uid: int | None) -> list[dict]:
    """The events of an events.jsonl (`open_owned`'s rules), of its last MAX_EVENTS_READ
    bytes; [] when there is none, or none to trust."""
    try:
        with open_owned(path, uid) as fh:
            size = os.fstat(fh.fileno()).st_size
            fh.seek(max(0, size - MAX_EVENTS_READ))
            data = fh.read(MAX_EVENTS_READ)
    except (OSError, ValueError):  # none yet, another user's private directory, a bad path
        return []
    lines = data.splitlines()
    if size > MAX_EVENTS_READ:
        lines = lines[1:]  # begun before the part read
    return [e for e in map(parse_event, lines) if e is not None]


def last_request(events: list[dict], run: int) -> dict | None:
    """Run `run`'s last word on a suspend request (its launcher's `notice`, a command's
    `suspend_requested`, or `suspend_request_failed`), None if none: a request whose last
    word is `suspend_requested` is the run's, whenever it came, the step's start included
    (the command journals it before it signals a step that may not run yet)."""
    return next((e for e in reversed(events) if e.get("run") == run and e.get("event") in
                 ("notice", "suspend_requested", "suspend_request_failed")), None)


def open_request(events: list[dict], run: int) -> dict | None:
    """Run `run`'s `hai suspend` that is still open (its `suspend_requested`, when it is the
    run's last word on a request: no notice heard since, not failed), None if none."""
    last = last_request(events, run)
    return last if last is not None and last["event"] == "suspend_requested" else None


def run_notices(events: Iterable[dict]) -> dict[int, dict]:
    """The notice of each run (its first), with the cause the daemon told later (a
    `notice_cause` event of the run: by_job, by_level, target_size) merged in."""
    notices: dict[int, dict] = {}
    for e in events:
        kind, run = e.get("event"), int(e.get("run", 0) or 0)
        if kind == "notice" and run not in notices:
            notices[run] = dict(e)
        elif kind == "notice_cause" and run in notices:
            notices[run].update({k: v for k, v in e.items() if k not in ("t", "event", "run")})
    return notices


def untold_notice(events: Iterable[dict], run: int) -> bool:
    """Whether run `run` had a notice without the size that the policy daemon's word on a
    preemption by Slurm brings, and no `notice_cause` since (its launcher left first)."""
    notice = run_notices(events).get(run)
    return notice is not None and "target_size" not in notice


def write_atomic(path: Path, text: str, durable: bool = True) -> None:
    """Write-then-rename, so a reader sees the old or the new text, never half; `durable`:
    with fsync of the file and its directory, so that a power loss does not lose it either
    (a file whose loss costs nothing may skip them, and the wait they add)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if not durable:
        return
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class JobDir:
    def __init__(self, path: str | Path) -> None:
        self.path = path if isinstance(path, Path) else Path(path)

    @classmethod
    def for_job(cls, job_id: int | str, root: str | Path | None = None) -> "JobDir":
        return cls((root if isinstance(root, Path) else Path(root) if root else default_root()) / str(job_id))

    def create(self) -> "JobDir":
        self._private(self.path / "logs")
        self.path.chmod(0o700)
        return self

    @staticmethod
    def _private(path: Path) -> None:
        """`path` and the directories above it that are missing, made private (0700)."""
        old = os.umask(0o077)
        try:
            path.mkdir(parents=True, exist_ok=True)
        finally:
            os.umask(old)

    def claim(self, token: str) -> "JobDir":
        """Create the directory for the submission `token` (hai-submit and the batch script
        both call this, and each part of a job in place as it starts). A directory left by an
        older job with the same id (Slurm reuses ids when its state is reset; several clusters
        may share one HAI_HOME) is moved aside to .stale-<id>-<time>-<rand>, never merged
        into: its final.json would stop the new job. One claimant at a time decides (the one
        that made .claiming-<id> beside it, an atomic mkdir on any file system): of parts that
        start at once, one moves the old directory aside and none the new one."""
        self._private(self.path.parent)
        marker = self.path.with_name(f".claiming-{self.path.name}")
        deadline = time.monotonic() + CLAIM_WAIT_S
        while True:
            try:
                os.mkdir(marker, 0o700)
                break
            except FileExistsError:
                if self._token() == token:  # claimed by another process of this submission
                    return self.create()
                if time.monotonic() > deadline:  # its claimant died deciding: decide here
                    break
                time.sleep(0.05)
        try:
            owner = self._token()
            stale = owner != token if owner is not None else self.path.is_dir() and any(
                (self.path / name).exists() for name in ("job.json", "final.json", "events.jsonl"))
            if stale:
                os.rename(self.path, self.path.with_name(
                    f".stale-{self.path.name}-{int(time.time())}-{os.urandom(3).hex()}"))
            self.create()
            if owner != token:
                fd = os.open(self.path / "submit_token", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.write(fd, token.encode())
                finally:
                    os.close(fd)
        finally:
            with contextlib.suppress(OSError):
                os.rmdir(marker)
        return self

    def _token(self) -> str | None:
        """The submission token this directory was claimed for, if any."""
        try:
            return (self.path / "submit_token").read_text().strip()
        except FileNotFoundError:
            return None

    # -- events -------------------------------------------------------------------
    def event(self, name: str, **fields: object) -> None:
        rec = {"t": round(time.time(), 3), "event": name, **fields}
        fd = os.open(self.path / "events.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, (json.dumps(rec, sort_keys=True) + "\n").encode())
        finally:
            os.close(fd)

    def events(self) -> list[dict]:
        """This job's events (`events_in`): its user's own process reads them."""
        return events_in(self.path / "events.jsonl", None)

    # -- markers ------------------------------------------------------------------
    def suspend_marker(self, run: int) -> Path:
        return self.path / f"suspend.{run}"

    def mark_suspend(self, run: int, how: str) -> bool:
        """Record that run `run` ends by a suspend; False if it was already marked."""
        try:
            fd = os.open(self.suspend_marker(run), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return False
        try:
            os.write(fd, how.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def suspended(self, run: int) -> str | None:
        try:
            return self.suspend_marker(run).read_text() or "suspend"
        except FileNotFoundError:
            return None

    def final(self) -> dict | None:
        try:
            return json.loads((self.path / "final.json").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def set_final(self, state: str, exit_code: int, reason: str = "") -> None:
        assert state in FINAL_STATES
        if self.final() is None:
            write_atomic(self.path / "final.json",
                         json.dumps({"state": state, "exit_code": exit_code, "reason": reason, "t": time.time()}))

    def take_retry(self, allowed: int) -> int | None:
        """Spend one of the job's `allowed` retries: the number of the retry taken, None
        when all are spent. One at a time (an flock on retries_used.lock): the parts of a
        job in place that fail together share one count."""
        fd = os.open(self.path / "retries_used.lock", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                used = int((self.path / "retries_used").read_text())
            except (FileNotFoundError, ValueError):
                used = 0
            if used >= allowed:
                return None
            write_atomic(self.path / "retries_used", str(used + 1))
            return used + 1
        finally:
            os.close(fd)

    # -- whole-life state ---------------------------------------------------------
    def whole_life_state(self) -> int:
        try:
            return int((self.path / "whole_life_state").read_text())
        except (FileNotFoundError, ValueError):
            return 0

    def set_whole_life_state(self, value: int) -> None:
        write_atomic(self.path / "whole_life_state", str(int(value)))

    # -- logs / request -----------------------------------------------------------
    def rank_log(self, rank: int) -> Path:
        return self.path / "logs" / f"rank-{rank}.log"

    def batch_said(self) -> str:
        """The last line the job's batch script printed (Slurm's --output, beside this
        directory), '' for none: what says why a job ended before its ranks started (an
        interpreter the node cannot see: `.../bin/python3: No such file or directory`)."""
        try:
            with open_owned(self.path.parent / f"batch-{self.path.name}.log", None) as fh:
                fh.seek(max(0, os.fstat(fh.fileno()).st_size - 4096))
                lines = fh.read(4096).decode(errors="replace").splitlines()
        except (OSError, ValueError):
            return ""
        said = [line.strip() for line in lines if line.strip()]
        return said[-1][:300] if said else ""

    @staticmethod
    def run_line(run: int, rank: int) -> str:
        """How the launcher opens run `run` in rank `rank`'s log (then "on HOST at TIME ====")."""
        return f"==== slurm-hai run {run} rank {rank} "

    def open_run_log(self, run: int, rank: int) -> int:
        """Rank `rank`'s log, opened to append run `run`'s output, the run's line written first
        (`hai logs` cuts the log into runs at these lines; `launched` looks for them). The
        caller owns the returned file descriptor."""
        fd = os.open(self.rank_log(rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        os.write(fd, f"{self.run_line(run, rank)}on {os.uname().nodename} at {stamp} ====\n".encode())
        return fd

    def launched(self, run: int, ranks: int) -> set[int]:
        """Which of the node ranks 0..ranks-1 started run `run`: the launcher's first act on
        a node is the run's "==== slurm-hai run K rank R" line in that rank's log, or, when
        it found the run cannot start there, a `launch_failed` event."""
        out = {e["rank"] for e in self.events() if e.get("event") == "launch_failed" and e.get("run") == run
               and isinstance(e.get("rank"), int) and 0 <= e["rank"] < ranks}
        for rank in set(range(ranks)) - out:
            try:
                if self.run_line(run, rank).encode() in self.rank_log(rank).read_bytes():
                    out.add(rank)
            except OSError:
                pass
        return out

    def request(self) -> dict:
        try:
            return json.loads((self.path / "job.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}


# Changes of a job in place's size closer together than this are one change (its parts'
# tasks start, and leave for one higher job, within a second or two of each other).
SIZE_SETTLE_S = 5.0


def run_sizes(events: Iterable[dict]) -> list[int]:
    """The nodes of each run, from the `start` events (runs before slurm-hai recorded a size:
    none). For a job in place, its size over time instead: the parts running after each
    change (a part's start or leave, up to the job's end), changes within SIZE_SETTLE_S
    taken as one."""
    events = list(events)
    if not any(e.get("event") == "start" and "part" in e for e in events):
        return [int(e["size"]) for e in events if e.get("event") == "start" and str(e.get("size", "")).isdigit()]
    running: set[int] = set()
    sizes: list[int] = []
    last = float("-inf")
    for e in sorted(events, key=lambda e: float(e.get("t", 0))):
        kind, part, t = e.get("event"), e.get("part"), float(e.get("t", 0))
        if kind == "finished":
            break  # the job's end: the parts still running end with it
        if not isinstance(part, int) or kind not in ("start", "left"):
            continue
        running.add(part) if kind == "start" else running.discard(part)
        if sizes and t - last < SIZE_SETTLE_S:
            sizes[-1] = len(running)
        else:
            sizes.append(len(running))
        last = t
    out: list[int] = []
    for n in sizes:
        if n and (not out or out[-1] != n):
            out.append(n)
    return out
