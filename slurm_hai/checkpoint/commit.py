"""The commit protocol for one checkpoint directory (one tier).

A save writes into ``DIR/.staging-<step>-<host>-<pid>-<start>-<rand>/``, fsyncs every file,
writes and fsyncs ``manifest.json`` last, fsyncs the staging directory, then (holding
``DIR/.lock``) renames it to ``DIR/step-<step>`` and fsyncs ``DIR``. ``DIR`` and any parent
that a job's first save creates are made durable in their parents (fsynced) when created,
so a power loss cannot take a committed step with them. A reader only looks at ``step-*``
directories, so it never sees a partial checkpoint, whenever a crash hits.
Deletion is the reverse: rename aside to ``.deleting-*`` first, then remove.

The run fence: a store that knows its run (``RunId``: the Slurm job and its restart count)
records, holding ``DIR/.lock``, that the run has started, in ``DIR/.run-of-job-<job>`` (the
newest run number of that job that has started), and every commit checks it under the same
lock, before the rename: a run that a newer run of its job has superseded (Slurm requeued the
job while this run's processes were cut off from it, and they still see the directory)
commits nothing; it gets ``SupersededRunError``. A node-local fast tier checks the durable
directory's record (``fence_store``), which every run of the job shares.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from ..policy.contract import restart_count
from .errors import CheckpointError, SupersededRunError
from .fileio import describe_os_error, fsync_dir, make_dirs
from .manifest import (
    DELETING_PREFIX,
    LOCK_NAME,
    MANIFEST_NAME,
    PERSIST_PREFIX,
    QUARANTINE_DIR,
    STAGING_PREFIX,
    Manifest,
    VerifyResult,
    list_step_dirs,
    step_dir_name,
    verify_checkpoint,
)

log = logging.getLogger(__name__)

_STAGING_RE = re.compile(r"^\.staging-(\d+)-(.+)-(\d+)-(\d+)-([0-9a-f]+)$")
RUN_RECORD_PREFIX = ".run-of-job-"  # DIR/.run-of-job-<job>: the newest run of <job> that started


@dataclass(frozen=True)
class RunId:
    """One run of a Slurm job: the job and its restart count (0, then 1 after a requeue...)."""

    job: str
    run: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> RunId | None:
        """This process's run, inside a Slurm job (hai-submit's, or any); None outside one
        (no fence: nothing else could supersede it)."""
        job = env.get("SLURM_JOB_ID", "")
        return cls(job, restart_count(env)) if job.isdigit() else None


def process_start_ticks(pid: int) -> int:
    """When a process started (clock ticks since boot; 0 if unknown). With the pid it
    names one process for good, even when pids are reused (containers restart at low pids)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def writer_alive(pid: int, start_ticks: int) -> bool:
    """Is the process that created a staging dir (on this host) still running?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    return start_ticks == 0 or process_start_ticks(pid) in (0, start_ticks)


@dataclass(frozen=True)
class StagingOwner:
    host: str
    pid: int
    start_ticks: int


def parse_staging_owner(name: str) -> StagingOwner | None:
    match = _STAGING_RE.match(name)
    return StagingOwner(match.group(2), int(match.group(3)), int(match.group(4))) if match else None


def _newest_mtime(path: Path) -> float:
    """A writer on another host shows it is alive by its files growing (DCP shards too)."""
    newest = path.lstat().st_mtime
    for parent, _, names in os.walk(path):
        for name in names:
            newest = max(newest, os.lstat(os.path.join(parent, name)).st_mtime)
    return newest


def refuse_foreign_directory(root: Path) -> None:
    """A checkpoint directory that another user made (in /tmp, say, before the job ran) or
    that anyone may write is not used: its owner could read the checkpoints or plant one."""
    st = root.stat()
    if st.st_uid != os.geteuid():
        raise CheckpointError(f"checkpoint directory {root} belongs to uid {st.st_uid}, not to you "
                              f"(uid {os.geteuid()}); choose a directory of your own")
    if st.st_mode & 0o002:
        raise CheckpointError(f"checkpoint directory {root} is writable by everyone; "
                              f"run `chmod o-w {root}` or choose another directory")


class CheckpointStore:
    """Committed checkpoints of one directory: commit, verify, quarantine, retention."""

    def __init__(self, root: str | os.PathLike[str], *, lock_timeout: float, stale_staging_age_s: float,
                 run: RunId | None = None, fence_store: CheckpointStore | None = None) -> None:
        self.root = Path(root)
        self.run = run  # None: commits are not fenced (outside a Slurm job, the persist agents)
        self.fence_store = fence_store  # where the run record lives; None: this directory
        self.lock_timeout = lock_timeout
        self.stale_staging_age_s = stale_staging_age_s
        self.host = socket.gethostname()
        self._start_ticks = process_start_ticks(os.getpid())
        try:
            make_dirs(self.root, mode=0o700)
        except OSError as exc:
            raise describe_os_error(exc, f"creating checkpoint directory {self.root}") from exc
        refuse_foreign_directory(self.root)
        # filelock counts re-entries per object, not per thread: the thread lock makes the
        # background committer and the training thread exclude each other too.
        self._thread_lock = threading.RLock()
        self._file_lock = FileLock(str(self.root / LOCK_NAME), mode=0o600, thread_local=False)
        # Full checksum verification is costly: remember results per (step dir, inode).
        self._verified: dict[tuple[str, int], bool] = {}

    def __repr__(self) -> str:
        return f"CheckpointStore({str(self.root)!r})"

    @contextmanager
    def locked(self, timeout: float | None = None) -> Iterator[None]:
        wait = self.lock_timeout if timeout is None else timeout
        with self._thread_lock:
            try:
                self._file_lock.acquire(timeout=wait)
            except Timeout:
                raise CheckpointError(
                    f"{self.root / LOCK_NAME} is held by another process for over {wait:.0f} s; "
                    "is a second job writing checkpoints to the same directory?"
                ) from None
            try:
                yield
            finally:
                self._file_lock.release()

    # --- listing and verification -------------------------------------------------

    def steps(self) -> dict[int, Path]:
        return dict(list_step_dirs(self.root))

    def step_path(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def _cache_key(self, step_dir: Path) -> tuple[str, int] | None:
        try:
            return (step_dir.name, (step_dir / MANIFEST_NAME).stat().st_ino)
        except OSError:
            return None

    def verify(self, step_dir: Path) -> VerifyResult:
        """Full verification (sizes + checksums), cached for this store's lifetime."""
        key = self._cache_key(step_dir)
        if key is not None and self._verified.get(key):
            return VerifyResult(step_dir, None, None, [])
        result = verify_checkpoint(step_dir)
        if key is not None:
            self._verified[key] = result.ok
        return result

    def mark_verified(self, step_dir: Path) -> None:
        if (key := self._cache_key(step_dir)) is not None:
            self._verified[key] = True

    # --- the run fence ---------------------------------------------------------------

    def _run_record(self, job: str) -> Path:
        return self.root / f"{RUN_RECORD_PREFIX}{job}"

    def newest_run(self, job: str) -> int | None:
        """The newest run of `job` that has started on this directory (None: none recorded).
        Read it holding the lock to act on it."""
        try:
            return int(self._run_record(job).read_text().strip())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {self._run_record(job)} ({exc}); remove it if it is damaged, "
                                  "then start the job again") from None

    def start_run(self) -> None:
        """Record that this store's run has started, so that no older run of the job commits
        from now on. Raises SupersededRunError if a newer run has started already."""
        if self.run is None:
            return
        if self.fence_store is not None:
            self.fence_store.start_run()
            return
        with self.locked():
            newest = self._check_not_superseded(self.run)
            if newest == self.run.run:
                return
            record = self._run_record(self.run.job)
            tmp = record.with_name(f"{record.name}.{os.getpid()}.tmp")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                try:
                    os.write(fd, f"{self.run.run}\n".encode())
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(tmp, record)
                fsync_dir(self.root)
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                raise describe_os_error(exc, f"recording run {self.run.run} in {record}") from exc

    def _check_not_superseded(self, run: RunId) -> int | None:
        """Raise SupersededRunError if a newer run of `run.job` has started; the caller
        holds this store's lock. Returns the newest run recorded."""
        newest = self.newest_run(run.job)
        if newest is not None and newest > run.run:
            raise SupersededRunError(f"run {run.run} of job {run.job} was superseded by run {newest}: not committing "
                                     f"to {self.root}; this process stops")
        return newest

    def check_fence(self) -> None:
        """The commit's fence (the caller holds this store's lock): refuse if this store's
        run has been superseded. A fast tier asks the durable directory, under its lock."""
        if self.run is None:
            return
        if self.fence_store is None:
            self._check_not_superseded(self.run)
            return
        with self.fence_store.locked():
            self.fence_store._check_not_superseded(self.run)

    # --- writing ------------------------------------------------------------------

    def new_staging(self, step: int) -> Path:
        name = f"{STAGING_PREFIX}{step:012d}-{self.host}-{os.getpid()}-{self._start_ticks}-{secrets.token_hex(4)}"
        path = self.root / name
        try:
            path.mkdir(mode=0o700)
        except OSError as exc:
            raise describe_os_error(exc, f"creating {path}") from exc
        return path

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def commit(self, staging: Path, manifest: Manifest) -> Path | None:
        """Publish a fully written staging dir as step-<step>; None if that step exists."""
        target = self.step_path(manifest.step)
        try:
            fd = os.open(staging / MANIFEST_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                data = memoryview(manifest.to_json_bytes())
                while data:
                    data = data[os.write(fd, data) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            for sub in [p for p in staging.rglob("*") if p.is_dir()] + [staging]:
                fsync_dir(sub)
        except OSError as exc:
            self.discard(staging)
            raise describe_os_error(exc, f"writing {staging / MANIFEST_NAME}") from exc
        with self.locked():
            try:
                self.check_fence()
            except CheckpointError:
                self.discard(staging)
                raise
            if target.exists():
                # Checkpoints are immutable: never replace a committed step.
                self.discard(staging)
                log.warning("step %d is already committed in %s; kept the existing one", manifest.step, self.root)
                return None
            try:
                os.rename(staging, target)
                fsync_dir(self.root)
            except OSError as exc:
                self.discard(staging)
                raise describe_os_error(exc, f"committing {target}") from exc
        self.mark_verified(target)
        return target

    # --- quarantine, retention, cleanup ------------------------------------------

    def quarantine(self, step_dir: Path, reason: str) -> None:
        """Move a bad checkpoint aside (kept for inspection) so nothing loads it again."""
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        dest_dir = self.root / QUARANTINE_DIR
        dest = dest_dir / f"{step_dir.name}-{stamp}-{secrets.token_hex(2)}"
        try:
            with self.locked(timeout=min(self.lock_timeout, 30.0)):
                if not step_dir.exists():
                    return
                dest_dir.mkdir(mode=0o700, exist_ok=True)
                os.rename(step_dir, dest)
                fsync_dir(dest_dir)
                fsync_dir(self.root)
        except (OSError, CheckpointError) as exc:
            log.error("checkpoint %s is bad (%s) and could not be quarantined: %s", step_dir, reason, exc)
            return
        log.error("checkpoint %s is bad (%s); quarantined to %s", step_dir, reason, dest)

    def _move_aside(self, step_dir: Path) -> Path | None:
        """Atomically take a checkpoint out of view; the slow rmtree happens later."""
        aside = self.root / f"{DELETING_PREFIX}{step_dir.name}-{self.host}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.rename(step_dir, aside)
        except FileNotFoundError:
            return None
        return aside

    def apply_retention(self, keep_last: int, protected: set[int]) -> None:
        """Keep the newest keep_last VALID checkpoints, quarantine invalid ones among them,
        delete older ones except protected steps (being loaded or written)."""
        keep: list[Path] = []
        doomed: list[Path] = []
        for step, path in list_step_dirs(self.root):
            if len(keep) >= keep_last:
                if step not in protected:
                    doomed.append(path)
                continue
            result = self.verify(path)  # outside the lock: may read a lot
            if result.ok:
                keep.append(path)
            elif step not in protected and path.exists():
                self.quarantine(path, "; ".join(str(p) for p in result.problems))
        if not doomed:
            return
        with self.locked():
            self.check_fence()  # a superseded run deletes nothing either
            if not all(path.exists() for path in keep):
                return  # someone else changed the directory meanwhile: decide next time
            moved = [(path, self._move_aside(path)) for path in doomed]
            fsync_dir(self.root)
        for path, aside in moved:
            if aside is not None:
                log.info("retention: removed %s (keep_last=%d)", path.name, keep_last)
                shutil.rmtree(aside, ignore_errors=True)

    def clean_stale(self, active: set[Path]) -> None:
        """Remove staging dirs whose writer is dead (same host) or silent for too long
        (the persist agents' too: a node lost before its copy), and leftovers of
        interrupted deletions."""
        now = time.time()
        with os.scandir(self.root) as entries:
            candidates = [
                Path(e.path)
                for e in entries
                if e.name.startswith((STAGING_PREFIX, DELETING_PREFIX, PERSIST_PREFIX))
                and e.is_dir(follow_symlinks=False)
            ]
        for path in candidates:
            if path in active:
                continue
            owner = parse_staging_owner(path.name)
            try:
                age = now - _newest_mtime(path)
            except FileNotFoundError:
                continue
            if path.name.startswith(DELETING_PREFIX):
                stale = True
            elif owner is not None and owner.host == self.host:
                stale = not writer_alive(owner.pid, owner.start_ticks) or age > self.stale_staging_age_s
            else:
                stale = age > self.stale_staging_age_s
            if stale:
                log.info("removing stale %s (age %.0f s)", path, age)
                shutil.rmtree(path, ignore_errors=True)
