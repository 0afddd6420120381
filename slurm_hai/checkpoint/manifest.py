"""The on-disk format of one committed checkpoint, and how to verify it.

Stdlib + xxhash only (no torch), so ``hai ckpt verify`` runs anywhere.

Layout of a checkpoint root (see docs/checkpoint.md)::

    DIR/.lock                         filelock: one committer at a time
    DIR/step-000000001200/            committed (renamed into place after every fsync)
        manifest.json                 written last; lists every file with size + checksum
                                      (xxh3_128 of the whole file, or xxh3_128 of each
                                      fixed-size piece: PIECES_HASH, format_version 2)
        state.safetensors             global state (single-process layout)
        rank-00000.safetensors        per-rank state (RNG), one file per rank
        dcp/.metadata, dcp/*.distcp   model/optimizer via torch DCP (sharded layout)
    DIR/.staging-<step>-<host>-<pid>-<start>-<rand>/   a save in progress (never read)
    DIR/.quarantine/step-...-<time>/  checkpoints that failed verification
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from .errors import CheckpointError, Problem

FORMAT_NAME = "slurm-hai-checkpoint"
FORMAT_VERSION = 2  # the newest this reader understands; a manifest says 1 unless a file is pieced
MANIFEST_NAME = "manifest.json"
HASH_NAME = "xxh3_128"  # one digest of the whole file (format_version 1, and any file of 2)
# One xxh3_128 digest per fixed-size piece (the last one shorter): pieces hash in parallel,
# and a reader verifies each piece before it uses a byte of it (format_version 2).
PIECES_HASH = "xxh3_128_pieces"
PIECE_SIZE = 8 << 20  # what writers use; a reader takes the manifest's (a power of two, 64 KiB to 1 GiB)
_PIECE_SIZES = range(16, 31)
LAYOUT_SINGLE = "single"  # one process wrote state.safetensors
LAYOUT_DCP = "dcp"  # torch.distributed.checkpoint wrote dcp/, rank 0 committed
LAYOUT_FILES = "files"  # a framework's own checkpoint files, committed as they are (slurm_hai.integrations)
LAYOUTS = (LAYOUT_SINGLE, LAYOUT_DCP, LAYOUT_FILES)

STEP_DIR_PREFIX = "step-"
STAGING_PREFIX = ".staging-"
DELETING_PREFIX = ".deleting-"
PERSIST_PREFIX = ".persist-"  # the persist agents' shared staging dir of a suspend save (memory.py)
QUARANTINE_DIR = ".quarantine"
LOCK_NAME = ".lock"

_STEP_DIR_RE = re.compile(r"^step-(\d+)$")
_HASH_CHUNK = 16 << 20


def step_dir_name(step: int) -> str:
    """Zero padded so that a plain `ls` sorts checkpoints by step."""
    return f"{STEP_DIR_PREFIX}{step:012d}"


def parse_step_dir_name(name: str) -> int | None:
    match = _STEP_DIR_RE.match(name)
    return int(match.group(1)) if match else None


def list_step_dirs(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Committed checkpoint directories under root, newest step first."""
    root = Path(root)
    found = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:  # e.g. a node-local fast tier wiped at job end
        return []
    for entry in entries:
        step = parse_step_dir_name(entry.name)
        if step is not None and entry.is_dir(follow_symlinks=False):
            found.append((step, root / entry.name))
    found.sort(reverse=True)
    return found


def new_hasher() -> Any:
    """The file checksum: xxh3_128 (faster per core than the disks it checks, releases the GIL on big buffers)."""
    try:
        import xxhash  # lazy: xxhash, optional
    except ImportError as exc:  # pragma: no cover - xxhash is in the torch extra
        raise CheckpointError(
            "checkpoint checksums need the xxhash package: pip install 'slurm-hai[torch]'"
        ) from exc
    return xxhash.xxh3_128()


def _manifest_digest(fields: dict[str, Any]) -> str:
    import xxhash  # lazy: xxhash, optional

    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return xxhash.xxh3_64(canonical).hexdigest()


@dataclass(frozen=True)
class FileEntry:
    """A file's size and checksum. kind HASH_NAME: checksum is the xxh3_128 hex digest of the
    whole file. kind PIECES_HASH: pieces holds the xxh3_128 hex digest of each piece_size
    piece, and checksum is derived from them (one string to compare and to print)."""

    size: int
    checksum: str
    kind: str = HASH_NAME
    piece_size: int = 0
    pieces: tuple[str, ...] = ()

    @classmethod
    def from_pieces(cls, size: int, piece_size: int, pieces: list[str] | tuple[str, ...]) -> FileEntry:
        return cls(size, pieces_checksum(pieces), PIECES_HASH, piece_size, tuple(pieces))

    def piece_range(self, index: int) -> tuple[int, int]:
        start = index * self.piece_size
        return start, min(start + self.piece_size, self.size)

    def to_json(self) -> dict[str, Any]:
        if self.kind == PIECES_HASH:
            return {"size": self.size, "hash": PIECES_HASH, "piece_size": self.piece_size, "pieces": list(self.pieces)}
        return {"size": self.size, HASH_NAME: self.checksum}


def pieces_checksum(pieces: list[str] | tuple[str, ...]) -> str:
    """The one-string checksum of a pieced file: xxh3_128 over its pieces' digests."""
    hasher = new_hasher()
    hasher.update(",".join(pieces).encode())
    return f"pieces:{hasher.hexdigest()}"


def piece_count(size: int, piece_size: int) -> int:
    return -(-size // piece_size)


def parse_file_entry(entry: Any) -> FileEntry:
    """One entry of a manifest's "files": {"size", "xxh3_128"} or {"size", "hash":
    "xxh3_128_pieces", "piece_size", "pieces"}; raises ValueError/KeyError/TypeError."""
    size = int(entry["size"])
    if size < 0:
        raise ValueError("negative size")
    kind = entry.get("hash", HASH_NAME)
    if kind == HASH_NAME:
        return FileEntry(size=size, checksum=str(entry[HASH_NAME]))
    if kind != PIECES_HASH:
        raise ValueError(f"unknown file hash {kind!r}")
    piece_size = int(entry["piece_size"])
    if piece_size not in {1 << n for n in _PIECE_SIZES}:
        raise ValueError(f"piece_size {piece_size} is not a power of two from 64 KiB to 1 GiB")
    pieces = entry["pieces"]
    if not isinstance(pieces, list) or len(pieces) != piece_count(size, piece_size):
        raise ValueError(f"{size} bytes in pieces of {piece_size} need {piece_count(size, piece_size)} digests")
    if not all(isinstance(p, str) and len(p) == 32 for p in pieces):
        raise ValueError("a piece digest is not an xxh3_128 hex digest")
    return FileEntry.from_pieces(size, piece_size, pieces)


@dataclass
class Manifest:
    step: int
    layout: str
    world_size: int
    files: dict[str, FileEntry]
    versions: dict[str, str] = field(default_factory=dict)
    created_unix: float = field(default_factory=time.time)
    created_by: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files.values())

    def to_json_bytes(self) -> bytes:
        pieced = any(entry.kind == PIECES_HASH for entry in self.files.values())
        fields: dict[str, Any] = {
            "format": FORMAT_NAME,
            # 1 unless a file is pieced: a reader from before pieces refuses 2 ("upgrade")
            "format_version": 2 if pieced else 1,
            "complete": True,
            "step": self.step,
            "layout": self.layout,
            "world_size": self.world_size,
            "created_unix": self.created_unix,
            "created_by": self.created_by,
            "versions": self.versions,
            "hash": HASH_NAME,
            "files": {name: entry.to_json() for name, entry in sorted(self.files.items())},
        }
        # A checksum over the manifest itself: a flipped byte in a size, a digest or the
        # step number must read as corruption, not as a different valid checkpoint.
        fields["manifest_xxh3_64"] = _manifest_digest(fields)
        return (json.dumps(fields, indent=1, sort_keys=True) + "\n").encode()


def _check_relative_path(name: str) -> str | None:
    """Why a file name from a manifest is unsafe to open, or None when it is fine."""
    pure = PurePosixPath(name)
    if not name or pure.is_absolute() or ".." in pure.parts or "\\" in name:
        return "unsafe path in manifest"
    if name == MANIFEST_NAME:
        return "manifest lists itself"
    return None


def parse_manifest(raw: bytes) -> Manifest:
    """Decode and validate manifest.json; raises CheckpointError saying what is wrong."""
    try:
        fields = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"not valid JSON ({exc})") from None
    if not isinstance(fields, dict):
        raise CheckpointError("not a JSON object")
    if fields.get("format") != FORMAT_NAME:
        raise CheckpointError(f"format is {fields.get('format')!r}, expected {FORMAT_NAME!r}")
    version = fields.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"format_version {version!r} is newer than this slurm-hai understands "
            f"({FORMAT_VERSION}); upgrade slurm-hai"
        )
    stored_digest = fields.pop("manifest_xxh3_64", None)
    if stored_digest != _manifest_digest(fields):
        raise CheckpointError("manifest checksum mismatch (manifest.json was modified or torn)")
    if fields.get("complete") is not True:
        raise CheckpointError("manifest does not say complete")
    if fields.get("hash") != HASH_NAME:
        raise CheckpointError(f"unknown hash {fields.get('hash')!r}")
    try:
        files = {str(name): parse_file_entry(entry) for name, entry in fields["files"].items()}
        if version < 2 and any(entry.kind != HASH_NAME for entry in files.values()):
            raise ValueError("a pieced checksum in a format_version 1 manifest")
        manifest = Manifest(
            step=int(fields["step"]),
            layout=str(fields["layout"]),
            world_size=int(fields["world_size"]),
            files=files,
            versions=dict(fields.get("versions", {})),
            created_unix=float(fields.get("created_unix", 0.0)),
            created_by=dict(fields.get("created_by", {})),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"missing or malformed field: {exc}") from None
    if manifest.layout not in LAYOUTS:
        raise CheckpointError(f"unknown layout {manifest.layout!r}")
    for name in files:
        if (why := _check_relative_path(name)) is not None:
            raise CheckpointError(f"{why}: {name!r}")
    return manifest


def read_manifest(step_dir: str | os.PathLike[str]) -> Manifest:
    path = Path(step_dir) / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError("missing (the save never reached its commit)") from None
    except OSError as exc:
        raise CheckpointError(f"unreadable: {exc.strerror or exc}") from None
    return parse_manifest(raw)


class WholeHasher:
    """HASH_NAME: one xxh3_128 over every byte fed, in order."""

    def __init__(self) -> None:
        self._hasher = new_hasher()

    def update(self, data: Any) -> None:
        self._hasher.update(data)

    def entry(self, size: int) -> FileEntry:
        return FileEntry(size=size, checksum=self._hasher.hexdigest())


class PieceHasher:
    """PIECES_HASH fed in order: one xxh3_128 per piece_size piece (the last one shorter)."""

    def __init__(self, piece_size: int = PIECE_SIZE) -> None:
        self.piece_size = piece_size
        self.digests: list[str] = []
        self._hasher = new_hasher()
        self._filled = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            take = min(len(view), self.piece_size - self._filled)
            self._hasher.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.piece_size:
                self._close_piece()

    def _close_piece(self) -> None:
        self.digests.append(self._hasher.hexdigest())
        self._hasher, self._filled = new_hasher(), 0

    def entry(self, size: int) -> FileEntry:
        if self._filled:
            self._close_piece()
        return FileEntry.from_pieces(size, self.piece_size, self.digests)


def hasher_like(entry: FileEntry | None) -> WholeHasher | PieceHasher:
    """A hasher of the kind of `entry` (None: the kind new files of a single-process save get)."""
    if entry is None:
        return PieceHasher()
    return PieceHasher(entry.piece_size) if entry.kind == PIECES_HASH else WholeHasher()


def mismatch(expected: FileEntry, got: FileEntry) -> str | None:
    """Why a file's checksum is not the manifest's, or None when it is (same kind)."""
    if expected.kind != got.kind or expected.piece_size != got.piece_size:
        return f"checksum kind {got.kind} cannot be compared with the manifest's {expected.kind}"
    if expected.kind == PIECES_HASH:
        for index, (want, have) in enumerate(zip(expected.pieces, got.pieces)):
            if want != have:
                start, end = expected.piece_range(index)
                return (f"checksum mismatch in piece {index} of {len(expected.pieces)} (bytes {start}-{end}): "
                        f"xxh3_128 {have}, manifest says {want}")
        if len(expected.pieces) != len(got.pieces):
            return f"{len(got.pieces)} pieces, manifest says {len(expected.pieces)}"
        return None
    if expected.checksum != got.checksum:
        return f"checksum mismatch: xxh3_128 {got.checksum}, manifest says {expected.checksum}"
    return None


_pool: tuple[int, ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


def hash_pool() -> ThreadPoolExecutor:
    """The threads that hash pieces in parallel (one per core, at most 8; xxhash releases
    the GIL). One per process: a forked child makes its own."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            workers = max(1, min(8, len(os.sched_getaffinity(0))))
            _pool = (os.getpid(), ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-pieces"))
        return _pool[1]


def hash_pieces(view: memoryview, piece_size: int = PIECE_SIZE) -> FileEntry:
    """The PIECES_HASH entry of bytes in memory, its pieces hashed in parallel."""
    view = view.cast("B") if view.format != "B" else view

    def one(start: int) -> str:
        hasher = new_hasher()
        hasher.update(view[start:start + piece_size])
        return str(hasher.hexdigest())

    digests = list(hash_pool().map(one, range(0, len(view), piece_size)))
    return FileEntry.from_pieces(len(view), piece_size, digests)


def hash_file(path: str | os.PathLike[str]) -> tuple[int, str]:
    """(size, xxh3_128 hex) of a whole file, read in big chunks."""
    entry = hash_file_entry(path)
    return entry.size, entry.checksum


def hash_file_entry(path: str | os.PathLike[str], like: FileEntry | None = None) -> FileEntry:
    """Size and checksum of a file, read in big chunks; of the kind of `like` (default: the
    whole-file xxh3_128)."""
    hasher = hasher_like(like) if like is not None else WholeHasher()
    size = 0
    chunk = bytearray(_HASH_CHUNK)
    view = memoryview(chunk)
    with open(path, "rb", buffering=0) as fh:
        with contextlib.suppress(OSError):  # only a read-ahead hint
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while n := fh.readinto(chunk):
            hasher.update(view[:n])
            size += n
    return hasher.entry(size)


def hash_mapped(path: str | os.PathLike[str], like: FileEntry | None = None) -> FileEntry:
    """hash_file for a file in memory (tmpfs): hashed through a mapping, without copying it
    out first (faster than reading it: no copy); pieces in parallel."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if not size:
            return (hasher_like(like) if like is not None else WholeHasher()).entry(0)
        with mmap.mmap(fh.fileno(), size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ) as m:
            with memoryview(m) as view:
                if like is not None and like.kind == PIECES_HASH:
                    return hash_pieces(view, like.piece_size)
                hasher = WholeHasher()
                hasher.update(view)
                return hasher.entry(size)


@dataclass
class VerifyResult:
    """Outcome of verifying one checkpoint directory."""

    path: Path
    step: int | None
    manifest: Manifest | None
    problems: list[Problem]

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(step_dir: str | os.PathLike[str], *, check_data: bool = True) -> VerifyResult:
    """Check manifest, every file's size and (with check_data) every checksum.

    Never raises for a bad checkpoint: the problems say which file and why.
    """
    step_dir = Path(step_dir)
    dir_step = parse_step_dir_name(step_dir.name)
    try:
        manifest = read_manifest(step_dir)
    except CheckpointError as exc:
        return VerifyResult(step_dir, dir_step, None, [Problem(MANIFEST_NAME, str(exc))])
    problems: list[Problem] = []
    if dir_step is not None and manifest.step != dir_step:
        problems.append(
            Problem(MANIFEST_NAME, f"says step {manifest.step} but the directory is step {dir_step}")
        )
    for name, entry in sorted(manifest.files.items()):
        problems.extend(check_file(step_dir, name, entry, check_data=check_data))
    return VerifyResult(step_dir, manifest.step, manifest, problems)


def check_file(step_dir: Path, name: str, entry: FileEntry, *, check_data: bool, mapped: bool = False) -> list[Problem]:
    path = step_dir / name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return [Problem(name, "missing")]
    except OSError as exc:
        return [Problem(name, f"unreadable: {exc.strerror or exc}")]
    if size != entry.size:
        return [Problem(name, f"size {size} bytes, manifest says {entry.size} (truncated or torn)")]
    if not check_data:
        return []
    try:
        got = hash_mapped(path, entry) if mapped else hash_file_entry(path, entry)
    except OSError as exc:
        return [Problem(name, f"unreadable: {exc.strerror or exc}")]
    why = mismatch(entry, got)
    return [Problem(name, why)] if why else []
