"""Distributed saves: torch.distributed.checkpoint (DCP) inside our commit protocol.

With world size > 1 every rank calls save()/load()/latest_step() (they are collective):

1. rank 0 creates ``DIR/.staging-...`` (checks the step is new) and broadcasts its path;
2. all ranks run ``dcp.save`` of the tensors into ``staging/dcp/`` (DCP de-duplicates
   replicated tensors and records shards, so any world size can load it later), write
   their PerRank values to ``rank-<r>.safetensors``, and checksum the files they wrote;
3. after an all-gather (the barrier), rank 0 checksums any file nobody claimed, writes
   ``manifest.json`` and commits as usual; every rank learns the outcome.

The same protocol runs in two places. ``save(blocking=True)``: in the caller, over the
default process group, on the live tensors. ``save(blocking=False)``: the caller only copies
its tensors (and PerRank values) into reusable host buffers and returns; steps 1-3 run in
a background thread on every rank, over a separate gloo group made for checkpoints (so
they never interleave with the training's collectives on the default group), on the host
copies. The all-gather of step 3 is the agreement: rank 0 commits only when every rank
reported its files written, fsynced and checksummed, and every rank's thread ends with the
outcome rank 0 broadcasts, so a failure anywhere is raised by the next call on every rank.
A rank that dies breaks the gloo connections: the others' collectives fail (or time out)
and nothing is committed.

Only tensors go through DCP; the structure and plain values live in our JSON, so DCP
never unpickles a value. DCP's ``.metadata`` is a pickle and its tensor payloads are read
with ``torch.load(weights_only=True)``: we only let DCP read a checkpoint after every one
of its files matched the checksum rank 0 recorded when committing it.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from .commit import CheckpointStore
from .errors import CheckpointError, CorruptCheckpointError, Problem, SupersededRunError
from .fileio import describe_os_error, fsync_file, read_verified_file, write_hashed_file
from .layout import ActiveStaging, checkpoint_versions, rank_file_name, read_rank_file, read_single_checkpoint
from .manifest import (LAYOUT_DCP, FileEntry, Manifest, check_file, hash_file, list_step_dirs, new_hasher,
                       read_manifest)
from .serialize import flatten_state, unflatten_state
from .staging import HostBuffer, SaveHandle, StagedFile, stage_files, stage_tensors

log = logging.getLogger(__name__)

DCP_DIR = "dcp"
TREE_FILE = "tree.json"
T = TypeVar("T")


def _rank0_then_broadcast(compute: Callable[[], T], group: Any = None) -> T:
    """Run compute on rank 0 only and give every rank its result (or its error), so that a
    failure on rank 0 raises everywhere instead of leaving the others in a collective."""
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = ("ok", compute())
        except SupersededRunError as exc:  # every rank of the superseded run stops
            payload[0] = ("superseded", str(exc))
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            payload[0] = ("error", str(exc))
    dist.broadcast_object_list(payload, src=0, group=group)
    status, value = payload[0]
    if status == "superseded":
        raise SupersededRunError(value)
    if status == "error":
        raise CheckpointError(value if dist.get_rank() == 0 else f"rank 0: {value}")
    return value


def broadcast_from_rank0(compute: Callable[[], T] | None) -> T:
    """latest_step() helper: rank 0 decides, every rank gets the same answer."""
    return _rank0_then_broadcast(compute or (lambda: None))  # type: ignore[return-value]


def _all_gather(value: T, group: Any = None) -> list[T]:
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def _owned_dcp_files(dcp_dir: Path, rank: int) -> list[Path]:
    """Files DCP wrote for this rank (``__<rank>_<n>.distcp``); rank 0 also owns .metadata."""
    owned = sorted(dcp_dir.glob(f"__{rank}_*.distcp"))
    if rank == 0 and (dcp_dir / ".metadata").exists():
        owned.append(dcp_dir / ".metadata")
    return owned


def _hash_files(staging: Path, paths: list[Path]) -> dict[str, FileEntry]:
    """Size and checksum of files DCP wrote, each fsynced first (DCP's own fsync may
    come before its last bytes are written: see fsync_file)."""
    entries = {}
    for path in paths:
        path.chmod(0o600)
        fsync_file(path)
        size, checksum = hash_file(path)
        entries[path.relative_to(staging).as_posix()] = FileEntry(size, checksum)
    return entries


@dataclass
class RankShare:
    """What one rank contributes to a sharded save: its tensors for DCP (live ones for a
    blocking save, host copies for an async one), the JSON tree (rank 0 writes it), its
    PerRank file image, or why it could not prepare them."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    tree: Any = None
    rank_file: StagedFile | None = None
    error: str | None = None


def prepare_share(state: Any, buffer: HostBuffer, tensor_buffer: HostBuffer | None) -> RankShare:
    """Flatten this rank's state; with tensor_buffer (async) copy its tensors there too.
    Never raises: the error travels in the share, so that every rank learns it in the
    agreement instead of the others waiting in a collective (or, worse, pairing this
    rank's next save with their current one)."""
    rank = dist.get_rank()
    try:
        global_part, rank_part = flatten_state(state)
        tensors = global_part.tensors
        if tensor_buffer is not None:
            tensors = stage_tensors(tensors, tensor_buffer)
        rank_file = None
        if rank_part is not None:
            (rank_file,) = stage_files([(rank_file_name(rank), rank_part)], buffer)
        return RankShare(tensors, global_part.tree, rank_file)
    except CheckpointError as exc:
        return RankShare(error=f"rank {rank}: {exc}")
    except Exception as exc:  # noqa: BLE001 - e.g. a state_dict() that raises; reported on every rank
        return RankShare(error=f"rank {rank}: {exc!r}")


def save_sharded(
    store: CheckpointStore, step: int, state: Any, *, buffer: HostBuffer, active_staging: ActiveStaging
) -> SaveHandle:
    """Collective blocking save into store; returns once committed on every rank (or raises
    on every rank). PerRank values are copied through buffer."""
    handle = SaveHandle(step)
    handle.skipped = persist_sharded(store, step, prepare_share(state, buffer, None), active_staging=active_staging)
    handle.finish()
    return handle


def persist_sharded(
    store: CheckpointStore, step: int, share: RankShare, *, active_staging: ActiveStaging, group: Any = None
) -> bool:
    """The collective part of a sharded save, over `group` (None: the default group).
    Returns True when the step was already committed (skipped); raises the same
    CheckpointError on every rank when any rank failed, and then nothing is committed.
    Rank 0 keeps its staging dir in active_staging while it is in use."""
    rank = dist.get_rank()

    # Agree on the preparation first: a rank that failed there and skipped dcp.save
    # would leave the others waiting in DCP's collectives.
    # The step travels too: ranks saving different steps is a bug in the caller that would
    # otherwise mix two saves' files.
    prepared = _all_gather((step, share.error), group)
    prepare_errors = [error for _, error in prepared if error]
    if len({rank_step for rank_step, _ in prepared}) > 1:
        steps = ", ".join(f"rank {r}: {rank_step}" for r, (rank_step, _) in enumerate(prepared))
        prepare_errors.append(f"the ranks save different steps ({steps}); every rank must save the same step")
    if prepare_errors:
        raise CheckpointError(f"sharded save of step {step} failed: {'; '.join(prepare_errors)}")

    def open_staging() -> str | None:
        existing = store.step_path(step)
        if existing.exists():
            result = store.verify(existing)
            if result.ok:
                return None
            store.quarantine(existing, "; ".join(str(p) for p in result.problems))
        staging = store.new_staging(step)
        (staging / DCP_DIR).mkdir(mode=0o700)
        active_staging.add(staging)
        return str(staging)

    staging_name = _rank0_then_broadcast(open_staging, group)
    if staging_name is None:
        if rank == 0:
            log.warning("step %d is already committed; not saving it again", step)
        return True
    staging = Path(staging_name)
    try:
        return _write_and_commit(store, step, share, staging, active_staging=active_staging, group=group)
    except BaseException:
        # A collective broke (a rank died, the group timed out): the save is over.
        if rank == 0:
            active_staging.release(store, staging)
        raise


def _write_and_commit(
    store: CheckpointStore, step: int, share: RankShare, staging: Path, *, active_staging: ActiveStaging, group: Any
) -> bool:
    # The agreement: rank 0 commits only if every rank's files are written and checksummed.
    reports = _write_share(staging, share, f"writing step {step} to {store.root}", group)

    def commit() -> None:
        try:
            manifest = _agreed_manifest(reports, step, "sharded save", store.host)
            unclaimed = [p for p in (staging / DCP_DIR).iterdir()
                         if p.relative_to(staging).as_posix() not in manifest.files]
            manifest.files.update(_hash_files(staging, unclaimed))
            store.commit(staging, manifest)
        finally:
            active_staging.release(store, staging)

    _rank0_then_broadcast(commit, group)
    return False


Reports = list[tuple[dict[str, FileEntry], "str | None"]]


class _ChecksummedFile(io.BufferedRandom):
    """A file DCP writes from its start, over whatever pages the file already has, and
    checksums as it goes; closing it cuts it after the last byte written. `entry` is its
    FileEntry once closed (None if anything was written out of order)."""

    def __init__(self, raw: io.FileIO) -> None:
        super().__init__(raw)
        self._hasher = new_hasher()
        self._size: int | None = 0  # None: written out of order
        self._end = 0
        self.entry: FileEntry | None = None

    def write(self, data: Any) -> int:
        at = self.tell()
        if self._size is not None and at == self._size:
            self._hasher.update(data)
            self._size += memoryview(data).nbytes
        else:
            self._size = None
        written = super().write(data)
        self._end = max(self._end, at + written)
        return written

    def close(self) -> None:
        if not self.closed:
            self.truncate(self._end)
            if self._size == self._end:
                self.entry = FileEntry(self._end, self._hasher.hexdigest())
        super().close()


class _InMemoryFileSystem(FileSystem):
    """How DCP writes a share into node memory: a data file that already exists (a spare
    moved into place, memory.py) is overwritten in place rather than truncated first, so its
    pages are reused, and every file is checksummed as it is written, not read again."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[Path, FileEntry | None] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Any:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        stream = _ChecksummedFile(io.FileIO(fd, "r+"))
        try:
            yield stream
        finally:
            stream.close()
            self.written[Path(path)] = stream.entry

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        self.written[Path(new_path)] = self.written.pop(Path(path), None)


@contextlib.contextmanager
def _without_zip_crc() -> Any:
    """torch.save's zip CRC32 is a second pass over every byte, and the manifest's checksum
    covers every file already. (A global switch: suspend_save() runs with no other save in flight.)"""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def _write_share(staging: Path, share: RankShare, action: str, group: Any, *, in_memory: bool = False) -> Reports:
    """Every rank writes its share into `staging` (its DCP shards, its PerRank file, rank 0
    the tree) and checksums what it wrote. Returns every rank's (files, error): what rank 0
    commits only if no rank failed. A failure never skips the all-gather. in_memory: node
    memory (node_memory.py): no fsync, files overwritten in place and checksummed as they
    are written, no zip CRC."""
    rank = dist.get_rank()
    entries: dict[str, FileEntry] = {}
    local_error: str | None = None
    try:
        storage = dcp.FileSystemWriter(str(staging / DCP_DIR), single_file_per_rank=True, sync_files=not in_memory)
        fs = storage.fs = _InMemoryFileSystem() if in_memory else storage.fs
        with _without_zip_crc() if in_memory else contextlib.nullcontext():
            write_dcp(share.tensors, storage_writer=storage, process_group=group)
        if share.rank_file is not None:
            entries[share.rank_file.name] = write_hashed_file(staging / share.rank_file.name, share.rank_file.image)
        if rank == 0:
            tree = json.dumps(share.tree, separators=(",", ":")).encode()
            entries[TREE_FILE] = write_hashed_file(staging / TREE_FILE, tree)
        owned = _owned_dcp_files(staging / DCP_DIR, rank)
        hashed = {p.relative_to(staging).as_posix(): e for p in owned if (e := getattr(fs, "written", {}).get(p))}
        entries.update(hashed)
        entries.update(_hash_files(staging, [p for p in owned if p.relative_to(staging).as_posix() not in hashed]))
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        local_error = f"rank {rank}: {_describe_write_error(exc, action)}"
    return _all_gather((entries, local_error), group)


def _agreed_manifest(reports: Reports, step: int, what: str, host: str) -> Manifest:
    """The manifest of every rank's files, or the CheckpointError naming every rank that failed."""
    errors = [error for _, error in reports if error]
    if errors:
        raise CheckpointError(f"{what} of step {step} failed: {'; '.join(errors)}")
    files: dict[str, FileEntry] = {}
    for rank_entries, _ in reports:
        files.update(rank_entries)
    world_size = len(reports)
    return Manifest(step=step, layout=LAYOUT_DCP, world_size=world_size, files=files, versions=checkpoint_versions(),
                    created_by={"host": host, "pid": os.getpid(), "world_size": world_size})


def _describe_write_error(exc: BaseException, action: str) -> str:
    """One line for a failed write. DCP wraps each rank's error, with its stack, in a
    CheckpointException: a full disk must still read as 'no space left ...'."""
    failures = getattr(exc, "failures", None) if isinstance(exc, dcp.api.CheckpointException) else None
    causes = [failure[0] for failure in (failures or {}).values()] or [exc]
    for cause in causes:
        if isinstance(cause, OSError):
            return str(describe_os_error(cause, action))
    return repr(causes[0])


def write_dcp(tensors: dict[str, torch.Tensor], *, storage_writer: Any, process_group: Any) -> None:
    """dcp.save of the tensors (a seam for tests that hold or fail the write)."""
    dcp.save(tensors, storage_writer=storage_writer, process_group=process_group)


def _check_share(path: Path, rank: int, world_size: int) -> list[Problem]:
    """Checksum every world_size-th file of the checkpoint, starting at `rank`."""
    try:
        manifest = read_manifest(path)
        names = sorted(manifest.files)[rank::world_size]
        return [p for name in names for p in check_file(path, name, manifest.files[name], check_data=True)]
    except CheckpointError as exc:
        return [Problem("manifest.json", str(exc))]


def _verify_distributed(path: Path) -> list[Problem]:
    """Every rank checksums a share of the files; all ranks get the union of problems."""
    merged: list[Problem] = []
    for rank_problems in _all_gather(_check_share(path, dist.get_rank(), dist.get_world_size())):
        merged.extend(p for p in rank_problems if p not in merged)
    return merged


def _verify_on_rank0(path: Path) -> list[Problem]:
    """Rank 0 checksums every file (its read that follows then comes from its page cache);
    all ranks get its problems."""
    return _rank0_then_broadcast(lambda: _check_share(path, 0, 1))


def _has_dtensor(into: Any) -> bool:
    return into is not None and any(isinstance(t, DTensor) for t in flatten_state(into)[0].tensors.values())


def load_distributed(store: CheckpointStore, step: int | None, into: Any, group: Any = None) -> tuple[int, Any] | None:
    """Collective load of the newest checkpoint every rank can read (any saved world size):
    (its step, its state), or None when there is none. The caller restores into `into`.
    `group`: a gloo group for broadcasting replicated tensors (CPU), whatever the training's
    backend."""
    rank = dist.get_rank()
    # Replicated state (no DTensor to load into: DDP) is read from storage once, by rank 0,
    # and broadcast; sharded state (FSDP, DTensors) is read by each rank, its own shards.
    replicated = not _has_dtensor(into)
    candidates = _rank0_then_broadcast(
        lambda: [s for s, _ in list_step_dirs(store.root) if step is None or s == step]
    )
    for found_step in candidates:
        path = store.step_path(found_step)
        problems = _verify_on_rank0(path) if replicated else _verify_distributed(path)
        if problems:
            if rank == 0:
                store.quarantine(path, "; ".join(str(p) for p in problems))
            continue
        manifest = read_manifest(path)
        try:
            if manifest.layout == LAYOUT_DCP and replicated:
                state = _read_dcp_broadcast(path, manifest, rank=rank, into=into, group=group)
            elif manifest.layout == LAYOUT_DCP:
                state = read_dcp_checkpoint(path, manifest, rank=rank, into=into, distributed=True)
            else:
                state = read_single_checkpoint(path, manifest, rank=rank)
            error = None
        except CheckpointError as exc:
            state, error = None, f"rank {rank}: {exc}"
        errors = [e for e in _all_gather(error) if e]
        if errors:
            log.warning("skipping checkpoint %s: %s", path, "; ".join(errors))
            continue
        return found_step, state
    if step is not None:
        raise CheckpointError(f"no valid checkpoint for step {step} in {store.root}")
    return None


def read_dcp_checkpoint(path: Path, manifest: Manifest, *, rank: int, into: Any, distributed: bool = False) -> Any:
    """Read a VERIFIED DCP-layout checkpoint into this process, whatever the world size.

    Tensors found at the same name in `into` (a live model's parameters, DTensor shards)
    are loaded in place so DCP reshards into them; the rest are allocated full size."""
    tree, targets = _dcp_tensors(path, manifest, into, read=True, distributed=distributed)
    return unflatten_state(tree, targets, read_rank_file(path, manifest, rank))


def _read_dcp_broadcast(path: Path, manifest: Manifest, *, rank: int, into: Any, group: Any) -> Any:
    """A VERIFIED DCP checkpoint of replicated state: rank 0 reads the tensors, then
    broadcasts them; every rank reads only the small tree, DCP's metadata and its own
    rank file. Errors of any rank raise on all, before the broadcast."""
    try:
        tree, targets = _dcp_tensors(path, manifest, into, read=rank == 0, distributed=False)
        rank_file = read_rank_file(path, manifest, rank)
        error = None
    except CheckpointError as exc:
        error = f"rank {rank}: {exc}"
    errors = [e for e in _all_gather(error, group) if e]
    if errors:
        raise CheckpointError("; ".join(errors))
    for name in sorted(targets):
        dist.broadcast(targets[name], src=0, group=group)
    return unflatten_state(tree, targets, rank_file)


def _dcp_tensors(path: Path, manifest: Manifest, into: Any, *, read: bool, distributed: bool,
                 metadata: Any = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """(the structure, a tensor per saved name) of a VERIFIED DCP checkpoint: `into`'s
    own tensors where name, shape and dtype match, new ones otherwise; filled from storage
    when `read`."""
    if TREE_FILE not in manifest.files:
        raise CorruptCheckpointError(str(path), [Problem(TREE_FILE, "not listed in the manifest")])
    tree = json.loads(read_verified_file(path / TREE_FILE, manifest.files[TREE_FILE], TREE_FILE))
    reader = dcp.FileSystemReader(str(path / DCP_DIR))
    if metadata is None:  # (a caller may have read it already)
        metadata = reader.read_metadata()  # a pickle, read only after its checksum matched
    live = flatten_state(into)[0].tensors if into is not None else {}
    targets: dict[str, torch.Tensor] = {}
    for name, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise CorruptCheckpointError(str(path), [Problem(f"{DCP_DIR}/.metadata", f"{name!r} is not a tensor")])
        target = live.get(name)
        if target is None or tuple(target.shape) != tuple(item.size) or target.dtype != item.properties.dtype:
            target = torch.empty(tuple(item.size), dtype=item.properties.dtype)
        targets[name] = target
    if not read:
        return tree, targets
    try:
        with warnings.catch_warnings():
            # no_dist is deliberate for a single process; DCP warns about it regardless
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(targets, storage_reader=reader, no_dist=not distributed)
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raise CheckpointError(f"torch.distributed.checkpoint could not load {path}: {exc!r}") from exc
    return tree, targets
