"""Suspend at memory speed (issue 56): a single process's state file written straight into
node memory reserved ahead, and read back straight into the live tensors.

Save: the spare (memory.py, FAST/spares/own-0) is mapped once, in the background, with
MAP_POPULATE (its page tables at once), and the mapping is kept across saves: a suspend save
renames the spare into its part, checks that the file it now owns is the mapped one (same
inode, same size), and copies every tensor straight into the mapping, piece by piece, each
piece hashed right after its copy while it is still in the CPU's cache, the pieces spread
over one thread per core (memmove and xxhash release the GIL). No staging buffer, no write().
The mapping is only ever written after the rename succeeded: a file of a committed part is
never written through it (a spare comes back only once its step is committed durably).

Load: the state file of a part is read piece by piece (pread) into a buffer of each thread,
reused; each piece is hashed there and compared with its digest in the manifest before a
byte of it is copied into the live tensors. A piece that does not match stops the load
(CorruptCheckpointError) with the tensors partly overwritten: the manager then loads an
older checkpoint over them, or raises.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import mmap
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError, CorruptCheckpointError, Problem
from .manifest import PIECE_SIZE, PIECES_HASH, FileEntry, hash_pool, new_hasher
from .serialize import FlatState, TensorSlot, build_header, parse_header, plan_slots

PAGE = 4096
MADV_POPULATE_WRITE = 23  # Linux 5.14; older kernels say EINVAL, and the save faults them in
CACHE_CHUNK = 512 << 10  # copy then hash this much at a time: it is still in the core's L2


@dataclass(frozen=True)
class Segment:
    """Bytes to copy: `length` bytes at address `src` to offset `at` of the file."""

    at: int
    src: int
    length: int


def state_file_plan(flat: FlatState) -> tuple[bytes, list[Segment], int] | None:
    """The header, the tensors' segments and the size of the state file of `flat`, or None
    when a tensor cannot be copied from its memory as it is (on a GPU, not contiguous)."""
    slots = plan_slots(flat.tensors)
    header = build_header(slots, flat.tree, align=PAGE)
    segments = _segments(slots, flat.tensors, len(header))
    if segments is None:
        return None
    return header, segments, len(header) + (slots[-1].end if slots else 0)


def _segments(slots: list[TensorSlot], tensors: dict[str, torch.Tensor], data_start: int) -> list[Segment] | None:
    """Where each slot's bytes lie in a state file whose data starts at `data_start`, and in
    the memory of its tensor in `tensors`; None when a tensor cannot be copied from or into
    its memory as it is (on a GPU, not contiguous)."""
    segments = []
    for slot in slots:
        tensor = tensors[slot.name].detach()
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        if slot.end > slot.begin:
            segments.append(Segment(data_start + slot.begin, tensor.data_ptr(), slot.end - slot.begin))
    return segments


class MappedRegion:
    """A spare's pages mapped into this process, kept across saves (at most one mapping)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[int, int, int] | None = None  # (st_dev, st_ino, length)
        self._map: mmap.mmap | None = None
        self._view: torch.Tensor | None = None

    def prepare(self, path: Path, size: int) -> None:
        """In the background: map the spare at `path` now, so that the save finds it mapped."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return
        try:
            if os.fstat(fd).st_size >= size > 0:
                with self._lock:
                    st = os.fstat(fd)
                    if self._key == (st.st_dev, st.st_ino, size) and self._map is not None:
                        # mapped by an earlier save: its page tables may have been dropped since
                        # (the kernel moving pages): fault them in again, writable, now
                        with contextlib.suppress(OSError, ValueError):
                            self._map.madvise(MADV_POPULATE_WRITE)
                    self._mapped(fd, size)
        finally:
            os.close(fd)

    def _mapped(self, fd: int, size: int) -> torch.Tensor:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, size)
        if self._key != key or self._view is None:
            self._release()
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self._view = torch.frombuffer(self._map, dtype=torch.uint8)
            self._key = key
        return self._view

    def _release(self) -> None:
        self._view, self._key = None, None
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still held: closed when collected
                self._map.close()
            self._map = None

    def release(self) -> None:
        with self._lock:
            self._release()

    def write(self, path: Path, header: bytes, segments: list[Segment], size: int,
              piece_size: int = PIECE_SIZE) -> FileEntry:
        """Make `path` (a spare just renamed there, or a new file) exactly `size` bytes: the
        header, then the tensors, copied into its mapping; returns its PIECES_HASH entry."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)  # before mapping: nothing mapped lies past the end
            if size == 0:
                return FileEntry.from_pieces(0, piece_size, [])
            with self._lock:
                view = self._mapped(fd, size)
                base = view.data_ptr()
                mapped = memoryview(self._map) if self._map is not None else memoryview(b"")
                ctypes.memmove(base, header, len(header))
                starts = [s.at for s in segments]

                def piece(start: int) -> str:
                    hasher = new_hasher()
                    end = min(start + piece_size, size)
                    for sub in range(start, end, CACHE_CHUNK):
                        sub_end = min(sub + CACHE_CHUNK, end)
                        _copy_overlap(segments, starts, sub, sub_end, base, to_file=True)
                        hasher.update(mapped[sub:sub_end])
                    return str(hasher.hexdigest())

                try:
                    digests = list(hash_pool().map(piece, range(0, size, piece_size)))
                finally:
                    mapped.release()
        finally:
            os.close(fd)
        return FileEntry.from_pieces(size, piece_size, digests)


def _copy_overlap(segments: list[Segment], starts: list[int], lo: int, hi: int, file_base: int, to_file: bool) -> None:
    """Copy the parts of `segments` inside file bytes [lo, hi) between the tensors' memory
    and the file's bytes in memory, the byte at file offset `at` being at address
    `file_base + at`: into the file (`to_file`, a save) or out of it (a load)."""
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    while i < len(segments) and segments[i].at < hi:
        seg = segments[i]
        a, b = max(seg.at, lo), min(seg.at + seg.length, hi)
        if a < b:
            tensor_at, file_at = seg.src + (a - seg.at), file_base + a
            if to_file:
                ctypes.memmove(file_at, tensor_at, b - a)
            else:
                ctypes.memmove(tensor_at, file_at, b - a)
        i += 1


_buffers = threading.local()


def _piece_buffer(size: int) -> tuple[bytearray, int]:
    """This thread's reused read buffer (and its address), at least `size` bytes."""
    buf = getattr(_buffers, "buf", None)
    if buf is None or len(buf[0]) < size:
        data = bytearray(size)
        buf = (data, ctypes.addressof((ctypes.c_char * size).from_buffer(data)))
        _buffers.buf = buf
    return buf


def stream_tensor_file(path: Path, entry: FileEntry, name: str, targets: dict[str, torch.Tensor]) -> FlatState | None:
    """Read one of our safetensors files (PIECES_HASH) straight into the live tensors
    `targets` (by name), each piece verified before it is used. None (nothing written) when
    the file's tensors do not all have a live tensor of the same dtype and shape on the CPU,
    contiguous: the caller reads it the usual way. Raises CorruptCheckpointError on a bad
    piece (the tensors may then be partly overwritten)."""
    if entry.kind != PIECES_HASH:
        return None
    with _VerifiedPieces(path, entry, name) as pieces:
        tree, slots, data_start = pieces.header()
        live = _live_targets(slots, targets)
        if live is None:
            return None
        segments = _segments(slots, live, data_start)
        if segments is None:
            return None
        pieces.fill(segments)
        return FlatState(tree, live)


def _live_targets(slots: list[TensorSlot], targets: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The live tensor of each slot, by name; None when a slot has none of its dtype and shape."""
    live = {}
    for slot in slots:
        target = targets.get(slot.name)
        if target is None or target.dtype != slot.dtype or tuple(target.shape) != slot.shape:
            return None
        live[slot.name] = target
    return live


def _has_header(prefix: bytearray) -> bool:
    """Whether the first bytes of a safetensors file hold its whole header (after its length)."""
    return len(prefix) >= 8 and len(prefix) >= 8 + struct.unpack_from("<Q", prefix)[0]


class _VerifiedPieces:
    """A state file open for reading piece by piece (pread into this thread's buffer), each
    piece checked against its digest in `entry` before it is returned."""

    def __init__(self, path: Path, entry: FileEntry, name: str) -> None:
        self.entry, self._where, self._name = entry, str(path.parent), name
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise self.corrupt("missing") from None
        except OSError as exc:
            raise CheckpointError(f"cannot open {path}: {exc.strerror or exc}") from None
        try:
            self.size = os.fstat(self._fd).st_size
            if self.size != entry.size:
                raise self.corrupt(f"size {self.size} bytes, manifest says {entry.size} (truncated or torn)")
        except BaseException:
            os.close(self._fd)
            raise

    def __enter__(self) -> _VerifiedPieces:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)

    def corrupt(self, reason: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(self._where, [Problem(self._name, reason)])

    def piece(self, index: int) -> tuple[memoryview, int]:
        """Piece `index`, verified, in this thread's buffer: its bytes and their address."""
        start, end = self.entry.piece_range(index)
        data, address = _piece_buffer(self.entry.piece_size)
        view = memoryview(data)[:end - start]
        got = 0
        while got < len(view):
            n = os.preadv(self._fd, [view[got:]], start + got)
            if n == 0:
                raise self.corrupt("file shrank while being read")
            got += n
        hasher = new_hasher()
        hasher.update(view)
        if hasher.hexdigest() != self.entry.pieces[index]:
            raise self.corrupt(f"checksum mismatch in piece {index} of {len(self.entry.pieces)} (bytes {start}-{end})")
        return view, address

    def header(self) -> tuple[Any, list[TensorSlot], int]:
        """The file's tree, its tensors' slots and where their data starts, from the first
        pieces, each verified on its own."""
        prefix = bytearray()
        index = 0
        while index < len(self.entry.pieces) and not _has_header(prefix):
            view, _ = self.piece(index)
            prefix += view
            index += 1
        if not _has_header(prefix):
            raise self.corrupt("header runs past the end of the file")
        (header_len,) = struct.unpack_from("<Q", prefix)
        data_start = 8 + header_len
        try:
            tree, slots = parse_header(bytes(prefix[8:data_start]), self.size - data_start)
        except CheckpointError as exc:
            raise self.corrupt(str(exc)) from None
        return tree, slots, data_start

    def fill(self, segments: list[Segment]) -> None:
        """Copy every piece into the tensors' memory of `segments`, each only once verified;
        the pieces spread over the hash pool's threads."""
        starts = [s.at for s in segments]

        def fill_piece(index: int) -> None:
            _, address = self.piece(index)  # verified: only now copied into the live tensors
            start, end = self.entry.piece_range(index)
            _copy_overlap(segments, starts, start, end, address - start, to_file=False)

        with torch.no_grad():
            list(hash_pool().map(fill_piece, range(len(self.entry.pieces))))
