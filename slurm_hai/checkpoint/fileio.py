"""Write a file while hashing it, and read a file back only if its checksum matches.
No torch here: the persist agent (agent.py) writes checkpoints with it.

Hashing runs in a helper thread on the same memory the write (or read) uses, so it
overlaps the I/O: both os.write/readinto and xxhash release the GIL.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .errors import CheckpointError, CorruptCheckpointError, Problem
from .manifest import FileEntry, PieceHasher, WholeHasher, hasher_like, mismatch

log = logging.getLogger(__name__)

IO_CHUNK = 64 << 20  # big sequential writes; small enough to pipeline hashing
DIRECT_ALIGN = 4096  # O_DIRECT wants block-aligned memory, offsets and lengths
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class OutOfSpaceError(CheckpointError):
    """The file system filled up during a save (ENOSPC / EDQUOT)."""


def describe_os_error(exc: OSError, action: str) -> CheckpointError:
    """Turn an OSError into a CheckpointError that says what to do."""
    if exc.errno in _NO_SPACE:
        return OutOfSpaceError(
            f"no space left while {action}; the previous checkpoints are intact. "
            "Free space, lower keep_last, or move the checkpoint directory."
        )
    return CheckpointError(f"{action} failed: {exc.strerror or exc}")


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """A rename or create is durable only once its directory is fsynced."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path, mode: int = 0o777) -> None:
    """path.mkdir(mode, parents=True, exist_ok=True) whose new directories survive a power
    loss: each one it creates (a job's first save creates its checkpoint directory, maybe
    its parents too) is a new entry in its parent, durable only once the parent is fsynced.
    Without that, a power loss after the first commit could take the whole directory."""
    if path.is_dir():
        return
    make_dirs(path.parent)  # missing parents get the default mode, as with mkdir -p
    try:
        path.mkdir(mode=mode)
    except FileExistsError:
        if not path.is_dir():
            raise
        # another process (a rank of the same job) made it this instant: it may not have
        # fsynced the parent yet, so do it here as well
    try:
        fsync_dir(path.parent)
    except PermissionError:  # a parent one may write into but not read (mode 1733) cannot be opened
        log.warning("cannot fsync %s (not readable): a power loss may take %s, and the checkpoints in it, "
                    "until the system writes it back", path.parent, path)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Make a file that another writer closed durable: torch DCP fsyncs .metadata before
    its buffered data reaches the file (pickle.dump into a Python file object, then
    os.fsync), so its bytes may live only in the page cache when DCP returns."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _direct_io_prefix(view: memoryview) -> int:
    """How many leading bytes can go out with O_DIRECT: the page-aligned part of a
    page-aligned buffer (the host buffer is; small bytes objects are not)."""
    if len(view) < DIRECT_ALIGN or np.frombuffer(view, dtype=np.uint8).ctypes.data % DIRECT_ALIGN:
        return 0
    return len(view) // DIRECT_ALIGN * DIRECT_ALIGN


def _open_new(path: Path, direct: bool) -> tuple[int, bool]:
    """Create path (0600, must not exist); O_DIRECT when asked and the file system has it
    (tmpfs refuses it with EINVAL)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    if direct:
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            path.unlink(missing_ok=True)
    return os.open(path, flags, 0o600), False


def _clear_direct(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)


def _write_direct(fd: int, part: memoryview, offset: int) -> bool:
    """Write with O_DIRECT; if the file system wants another alignment (EINVAL), switch the
    file to buffered I/O and write the part again. Returns whether O_DIRECT is still on."""
    try:
        _write_all(fd, part)
        return True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    _clear_direct(fd)
    os.lseek(fd, offset, os.SEEK_SET)
    _write_all(fd, part)
    return False


def write_hashed_file(path: Path, data: bytes | memoryview, *, known: FileEntry | None = None,
                      over_spare: bool = False, hasher: WholeHasher | PieceHasher | None = None) -> FileEntry:
    """Create path (0600, must not exist), write data, fsync; return size + checksum.

    The page-aligned bulk goes out with O_DIRECT where the file system allows it: buffered
    writes + fsync vary widely with page-cache allocation and writeback, while O_DIRECT
    holds a steady, higher rate, and it does not evict the job's page cache.
    The unaligned tail is written buffered. With known (the same bytes were already
    hashed for another tier) hashing is skipped. over_spare: path may already be a spare
    of node memory (memory.py, moved there by the caller): its pages are written over and
    the file is cut after the data, instead of new pages faulted in. hasher: the checksum
    kind (manifest.hasher_like); default the whole-file xxh3_128.
    """
    view = memoryview(data).cast("B")
    direct_len = _direct_io_prefix(view)
    if over_spare and path.exists():
        fd, direct = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW), False
        os.ftruncate(fd, min(os.fstat(fd).st_size, len(view)))
    else:
        fd, direct = _open_new(path, direct=direct_len > 0)
    try:
        if known is not None:
            hasher = None
        elif hasher is None:
            hasher = WholeHasher()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-hash") as pool:
            pending: list[Future[None]] = []
            for start in range(0, len(view), IO_CHUNK):
                chunk = view[start : start + IO_CHUNK]
                if hasher is not None:
                    pending.append(pool.submit(hasher.update, chunk))
                aligned = max(0, min(len(chunk), direct_len - start)) if direct else 0
                if aligned:
                    direct = _write_direct(fd, chunk[:aligned], start)
                if aligned < len(chunk):
                    if direct:
                        _clear_direct(fd)  # O_DIRECT needs whole blocks: the tail goes buffered
                        direct = False
                    _write_all(fd, chunk[aligned:])
            for future in pending:
                future.result()
        os.fsync(fd)
    finally:
        os.close(fd)
    if known is not None:
        return known
    assert hasher is not None  # made above, as nothing was known
    return hasher.entry(len(view))


class VerifyingReader:
    """Reads a file front to back into caller-provided memory while a helper thread hashes
    every byte in order; check() then compares size and checksum with the manifest."""

    def __init__(self, path: Path, entry: FileEntry, name: str) -> None:
        self.where, self.name, self.entry = str(path.parent), name, entry
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise self.corrupt("missing") from None
        except OSError as exc:
            raise CheckpointError(f"cannot open {path}: {exc.strerror or exc}") from None
        size = os.fstat(self.fd).st_size
        if size != entry.size:
            os.close(self.fd)
            raise self.corrupt(f"size {size} bytes, manifest says {entry.size} (truncated or torn)")
        with contextlib.suppress(OSError):  # only a read-ahead hint
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        self.offset = 0
        self.hasher = hasher_like(entry)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-hash")
        self.pending: list[Future[None]] = []

    def corrupt(self, reason: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(self.where, [Problem(self.name, reason)])

    def read_into(self, view: memoryview) -> None:
        for start in range(0, len(view), IO_CHUNK):
            chunk = view[start : start + IO_CHUNK]
            filled = 0
            while filled < len(chunk):
                try:
                    got = os.readv(self.fd, [chunk[filled:]])
                except OSError as exc:
                    raise CheckpointError(f"reading {self.name} in {self.where}: {exc.strerror or exc}") from None
                if got == 0:
                    raise self.corrupt("file shrank while being read")
                filled += got
            self.pending.append(self.pool.submit(self.hasher.update, chunk))
            self.offset += len(chunk)

    def read_bytes(self, count: int) -> bytes:
        if count > self.entry.size - self.offset:
            raise self.corrupt("a length field points past the end of the file")
        data = bytearray(count)
        self.read_into(memoryview(data))
        return bytes(data)

    def check(self) -> None:
        """Hash whatever was not read yet, then compare with the manifest."""
        if self.offset < self.entry.size:
            self.read_bytes(self.entry.size - self.offset)
        for future in self.pending:
            future.result()
        if why := mismatch(self.entry, self.hasher.entry(self.offset)):
            raise self.corrupt(why)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        os.close(self.fd)


def read_verified_file(path: Path, entry: FileEntry, name: str) -> bytes:
    """A small file's bytes, only if its size and checksum match the manifest."""
    reader = VerifyingReader(path, entry, name)
    try:
        data = reader.read_bytes(entry.size)
        reader.check()
    finally:
        reader.close()
    return data
