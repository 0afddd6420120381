"""A framework's own checkpoint files, committed with slurm-hai's protocol.

The Hugging Face Trainer writes `checkpoint-N/` in place and Lightning moves a temp file
into place, neither with fsync; HF's `get_last_checkpoint` takes the highest number without
checking it. Here the files a framework wrote are moved into a staging dir of our store,
fsynced and checksummed, and committed as `step-N/` (layout `files`) by the same
CheckpointStore as every other checkpoint: atomic, durable, verified before use, keep-last,
bad ones quarantined, `hai ckpt verify` checks them. A torn save is never committed, so a
restart can never pick it up.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

from ..checkpoint.errors import CheckpointError
from ..checkpoint.fileio import describe_os_error
from ..checkpoint.layout import checkpoint_versions
from ..checkpoint.manager import CheckpointManager
from ..checkpoint.manifest import LAYOUT_FILES, FileEntry, Manifest, hash_file


def default_checkpoint_dir() -> Path:
    """$HAI_JOB_DIR/checkpoints in a job (shared by every node and every run), else ./checkpoints."""
    job_dir = os.environ.get("HAI_JOB_DIR")
    return Path(job_dir, "checkpoints") if job_dir else Path("checkpoints")


def _seal(path: Path) -> FileEntry:
    """fsync a file another writer left in the page cache, then checksum it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    size, digest = hash_file(path)
    return FileEntry(size=size, checksum=digest)


class FrameworkCheckpoints:
    """Committed checkpoints of one framework's run in one directory.

    directory: None for default_checkpoint_dir(). keep_last: how many valid checkpoints
    stay. framework: name and version recorded in each manifest ("transformers 5.23.0").
    """

    def __init__(self, directory: str | os.PathLike[str] | None, *, keep_last: int, framework: str,
                 version: str) -> None:
        self.framework, self.version = framework, version
        # The manager finds the newest checkpoint that verifies (the same answer on every
        # rank), quarantines bad ones and cleans stale staging dirs; its store commits.
        self.manager = CheckpointManager(default_checkpoint_dir() if directory is None else directory,
                                         keep_last=keep_last)
        self.store = self.manager.durable

    @property
    def root(self) -> Path:
        return self.store.root

    def latest(self) -> Path | None:
        """The newest committed checkpoint whose every file verifies, or None."""
        step = self.manager.latest_step()
        return None if step is None else self.store.step_path(step)

    def new_staging(self, step: int) -> Path:
        """A private directory for the framework to save step `step` into; commit() it."""
        return self.store.new_staging(step)

    def adopt(self, step: int, source: Path, *, world_size: int = 1) -> Path | None:
        """Move the files of `source` (a directory the framework just wrote) into a staging
        dir and commit them as `step`; `source` is removed. None if `step` was committed."""
        staging = self.new_staging(step)
        try:
            for path in sorted(source.rglob("*")):
                if path.is_file():
                    dest = staging / path.relative_to(source)
                    dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                    shutil.move(path, dest)  # a rename on the same file system
        except OSError as exc:
            self.store.discard(staging)
            raise describe_os_error(exc, f"moving {source} into {self.root}") from exc
        committed = self.commit(step, staging, world_size=world_size)
        shutil.rmtree(source, ignore_errors=True)
        return committed

    def commit(self, step: int, staging: Path, *, world_size: int = 1) -> Path | None:
        """Seal every file of a staging dir and publish it as step-<step> (see commit.py);
        None if that step is already committed (checkpoints are immutable)."""
        try:
            files = {str(p.relative_to(staging)): _seal(p) for p in sorted(staging.rglob("*")) if p.is_file()}
        except OSError as exc:
            self.store.discard(staging)
            raise describe_os_error(exc, f"sealing {staging}") from exc
        if not files:
            self.store.discard(staging)
            raise CheckpointError(f"{self.framework} wrote no files for step {step}: nothing to commit")
        manifest = Manifest(
            step=step,
            layout=LAYOUT_FILES,
            world_size=world_size,
            files=files,
            versions=checkpoint_versions() | {self.framework: self.version},
            created_by={"host": socket.gethostname(), "pid": os.getpid(), "framework": self.framework},
        )
        committed = self.store.commit(staging, manifest)
        self.manager.housekeeping([self.store])  # retention + stale staging; only logs failures
        return committed
