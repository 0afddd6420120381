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

import json
import logging
import mmap
import os
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .commit import CheckpointStore
from .errors import CheckpointError, CorruptCheckpointError, Problem
from .fileio import describe_os_error, fsync_file, read_verified_file, write_hashed_file
from .layout import ActiveStaging, checkpoint_versions, rank_file_name, read_rank_file, read_single_checkpoint
from .manifest import (LAYOUT_DCP, FileEntry, Manifest, check_file, hash_file, list_step_dirs, parse_manifest,
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
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            payload[0] = ("error", str(exc))
    dist.broadcast_object_list(payload, src=0, group=group)
    status, value = payload[0]
    if status == "error":
        raise CheckpointError(value if dist.get_rank() == 0 else f"rank 0: {value}")
    return value


def broadcast_from_rank0(compute: Callable[[], T] | None) -> T:
    """latest_step() helper: rank 0 decides, every rank gets the same answer."""
    return _rank0_then_broadcast(compute or (lambda: None))  # type: ignore[arg-type,return-value]


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
    reports = _write_share(staging, share, f"writing step {step} to {store.root}", group, sync=True)

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


def _write_share(staging: Path, share: RankShare, action: str, group: Any, *, sync: bool) -> Reports:
    """Every rank writes its share into `staging` (its DCP shards, its PerRank file, rank 0
    the tree) and checksums what it wrote. Returns every rank's (files, error): what rank 0
    commits only if no rank failed. A failure never skips the all-gather."""
    rank = dist.get_rank()
    entries: dict[str, FileEntry] = {}
    local_error: str | None = None
    try:
        storage = dcp.FileSystemWriter(str(staging / DCP_DIR), single_file_per_rank=True, sync_files=sync)
        write_dcp(share.tensors, storage_writer=storage, process_group=group)
        if share.rank_file is not None:
            entries[share.rank_file.name] = write_hashed_file(staging / share.rank_file.name, share.rank_file.image)
        if rank == 0:
            tree = json.dumps(share.tree, separators=(",", ":")).encode()
            entries[TREE_FILE] = write_hashed_file(staging / TREE_FILE, tree)
        entries.update(_hash_files(staging, _owned_dcp_files(staging / DCP_DIR, rank)))
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
    from torch.distributed.tensor import DTensor

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


def _dcp_tensors(path: Path, manifest: Manifest, into: Any, *, read: bool,
                 distributed: bool) -> tuple[Any, dict[str, torch.Tensor]]:
    """(the structure, a tensor per saved name) of a VERIFIED DCP checkpoint: `into`'s
    own tensors where name, shape and dtype match, new ones otherwise; filled from storage
    when `read`."""
    if TREE_FILE not in manifest.files:
        raise CorruptCheckpointError(str(path), [Problem(TREE_FILE, "not listed in the manifest")])
    tree = json.loads(read_verified_file(path / TREE_FILE, manifest.files[TREE_FILE], TREE_FILE))
    reader = dcp.FileSystemReader(str(path / DCP_DIR))
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


# --- suspend saves into node memory (memory.py has the layout and the agents' side) ----------


def _node_leaders(nodes: list[str]) -> dict[str, int]:
    """The lowest rank of each node: it completes and hands over the node's part."""
    leaders: dict[str, int] = {}
    for rank, node in enumerate(nodes):
        leaders.setdefault(node, rank)
    return leaders


def save_to_memory(parts: CheckpointStore, durable: CheckpointStore, step: int, share: RankShare, *,
                   active_staging: ActiveStaging, group: Any = None, peer_copy: bool = True) -> bool | None:
    """The collective suspend save: every rank writes its shards into its node's memory
    part (node-local staging dir, DCP as in a durable save), the ranks agree, each node's
    leader commits its part, and then hands it to its persist agent; rank 0 marks the step
    pending in the durable directory. Returns True when the step was already committed
    (skipped), None when some node has no persist agent (nothing written: the caller saves
    to the durable tier instead); raises the same CheckpointError on every rank on failure."""
    from .memory import PartInfo, agent_alive, commit_part, file_request, mark_pending, node_name

    rank = dist.get_rank()
    prepared = _all_gather((step, share.error, node_name(), agent_alive()), group)
    errors = [error for _, error, _, _ in prepared if error]
    if len({rank_step for rank_step, _, _, _ in prepared}) > 1:
        errors.append("the ranks save different steps; every rank must save the same step")
    if errors:
        raise CheckpointError(f"suspend save of step {step} failed: {'; '.join(errors)}")
    nodes = [node for _, _, node, _ in prepared]  # each rank's node
    if not all(alive for _, _, _, alive in prepared):
        if rank == 0:
            missing = sorted({node for _, _, node, alive in prepared if not alive})
            log.warning("no persist agent on %s: saving step %d to %s directly", ", ".join(missing), step, durable.root)
        return None
    leaders = _node_leaders(nodes)
    order = sorted(leaders, key=leaders.__getitem__)

    def open_staging() -> str | None:
        existing = durable.step_path(step)
        if existing.exists() and durable.verify(existing).ok:
            return None
        return parts.new_staging(step).name

    staging_name = _rank0_then_broadcast(open_staging, group)
    if staging_name is None:
        return True
    staging = parts.root / staging_name
    active_staging.add(staging)
    try:
        try:
            staging.mkdir(mode=0o700, exist_ok=True)  # rank 0 made it on its node; each node its own
            (staging / DCP_DIR).mkdir(mode=0o700, exist_ok=True)
        except OSError:
            pass  # reported by the write that follows, in the agreement
        reports = _write_share(staging, share, f"writing step {step} to node memory", group, sync=False)

        def whole() -> tuple[bytes, bytes, bytes]:
            manifest = _agreed_manifest(reports, step, "suspend save", durable.host)
            return (manifest.to_json_bytes(), (staging / TREE_FILE).read_bytes(),
                    (staging / DCP_DIR / ".metadata").read_bytes())

        manifest_bytes, tree_bytes, metadata_bytes = _rank0_then_broadcast(whole, group)
        manifest = parse_manifest(manifest_bytes)
        node = nodes[rank]
        part = PartInfo(step, staging_name.rsplit("-", 1)[-1], node, order.index(node), len(order), str(durable.root),
                        sorted(name for r, (rank_entries, _) in enumerate(reports) if nodes[r] == node
                               for name in rank_entries), manifest)
        committed, local_error = None, None
        if leaders[node] == rank:
            try:
                for name, data in ((TREE_FILE, tree_bytes), (f"{DCP_DIR}/.metadata", metadata_bytes)):
                    if not (staging / name).exists():  # the small shared files: on every node, for a load there
                        write_hashed_file(staging / name, data)
                committed = commit_part(parts, staging, part)
            except (OSError, CheckpointError) as exc:
                local_error = f"node {node}: {exc}"
        failed = [e for e in _all_gather(local_error, group) if e]
        if failed:
            raise CheckpointError(f"suspend save of step {step} failed: {'; '.join(failed)}")
        if committed is not None:
            # A peer copy first: once go_suspend() has run, the node may be lost at any time.
            peer = _peer_copy(parts, committed, part, order, leaders, group) if peer_copy and len(order) > 1 else None
            try:
                file_request(committed, part)
                if peer is not None:
                    file_request(*peer)
            except CheckpointError as exc:
                local_error = f"node {node}: {exc}"
        # Every node's request is filed before the step is marked pending.
        failed = [e for e in _all_gather(local_error, group) if e]
        if failed:
            raise CheckpointError(f"suspend save of step {step} failed: {'; '.join(failed)}")
        if rank == 0:
            mark_pending(durable, step, order)
        return False
    finally:
        active_staging.paths.discard(staging)
        if staging.exists() and leaders.get(nodes[rank]) == rank:
            parts.discard(staging)


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def _peer_copy(parts: CheckpointStore, part_dir: Path, part: Any, order: list[str], leaders: dict[str, int],
               group: Any) -> tuple[Path, Any] | None:
    """Node leaders only: send this node's share to the next node's leader and keep the
    previous node's share here (FAST/parts/peer-<step>-<k>/, with its part.json), so that
    one node lost before the agents' durable commit does not lose the step: the agent
    that holds the peer copy persists that node's share too. Returns (the peer copy, its
    PartInfo), or None when the exchange failed (logged: the save stands without it)."""
    from .memory import PART_FILE, PartInfo, peer_dir_name

    k, n = part.node_index, len(order)
    prev = (k - 1) % n
    to, frm = leaders[order[(k + 1) % n]], leaders[order[prev]]
    maps: list[mmap.mmap] = []
    tensors: list[torch.Tensor] = []
    works: list[Any] = []
    staging = parts.root / f".staging-peer-{part.step:012d}-{prev}-{os.getpid()}"

    def mapped(fd: int, size: int, writable: bool) -> torch.Tensor:
        maps.append(mmap.mmap(fd, size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)))
        tensors.append(torch.frombuffer(maps[-1], dtype=torch.uint8))
        return tensors[-1]

    try:
        sizes = [(part_dir / name).stat().st_size for name in part.owned]
        header = torch.frombuffer(bytearray(json.dumps([part.owned, sizes]).encode()), dtype=torch.uint8)
        length, their_length = torch.tensor([header.numel()]), torch.zeros(1, dtype=torch.int64)
        _wait([dist.isend(length, to, group), dist.irecv(their_length, frm, group)])
        their_header = torch.empty(int(their_length), dtype=torch.uint8)
        _wait([dist.isend(header, to, group), dist.irecv(their_header, frm, group)])
        their_names, their_sizes = json.loads(bytes(their_header.numpy()))
        staging.mkdir(mode=0o700)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for name, size in zip(part.owned, sizes):
                if size:
                    with open(part_dir / name, "rb") as f:
                        works.append(dist.isend(mapped(f.fileno(), size, False), to, group))
            for name, size in zip(their_names, their_sizes):
                path = staging / name
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                try:
                    os.ftruncate(fd, size)
                    if size:
                        works.append(dist.irecv(mapped(fd, size, True), frm, group))
                finally:
                    os.close(fd)
            _wait(works)
        peer = PartInfo(part.step, part.token, order[prev], prev, n, part.durable, their_names, part.manifest)
        (staging / PART_FILE).write_bytes(peer.to_json_bytes())
        target = parts.root / peer_dir_name(part.step, prev)
        shutil.rmtree(target, ignore_errors=True)
        os.rename(staging, target)
        return target, peer
    except (OSError, ValueError, RuntimeError) as exc:
        log.warning("no peer copy of step %d (%s): a node lost before the durable commit loses this step", part.step, exc)
        shutil.rmtree(staging, ignore_errors=True)
        return None
    finally:
        works.clear()
        tensors.clear()
        for m in maps:
            try:
                m.close()
            except BufferError:  # still exported: closed when collected
                pass


def _tensor_owners(path: Path) -> dict[str, int]:
    """The rank whose DCP file holds each whole tensor (replicated state: DCP wrote each
    tensor once, in one rank's file); a tensor spread over several files has no owner."""
    metadata = dcp.FileSystemReader(str(path / DCP_DIR)).read_metadata()
    files: dict[str, set[str]] = {}
    for index, info in metadata.storage_data.items():
        files.setdefault(index.fqn, set()).add(info.relative_path)
    owners = {}
    for name, paths in files.items():
        if len(paths) == 1 and (m := re.match(r"__(\d+)_\d+\.distcp$", next(iter(paths)))):
            owners[name] = int(m.group(1))
    return owners


def load_from_memory(parts: CheckpointStore, durable: CheckpointStore, step: int | None, into: Any,
                     group: Any) -> tuple[int, Any] | None:
    """Collective load of a suspend checkpoint from node memory, when this run landed where
    it was saved: every rank finds the same newest part on its node, no newer step is
    committed durably, and each rank's own files verify there. Replicated state: each rank
    reads the tensors its own DCP file holds and broadcasts them; sharded state (DTensors):
    each rank reads its shards through DCP. None (nothing read) when any rank cannot."""
    from .memory import check_part_files, newest_part, pending_steps, read_part

    rank = dist.get_rank()
    local = newest_part(parts)
    found = _all_gather(local[0] if local else None, group)
    # A newer step committed durably, or on its way there from other nodes' memory, wins.
    newest_elsewhere = _rank0_then_broadcast(lambda: max(
        [s for s, _ in list_step_dirs(durable.root)] + pending_steps(durable), default=-1), group)
    chosen = found[0]
    if chosen is None or len(set(found)) > 1 or (step is not None and chosen != step) or newest_elsewhere > chosen:
        return None
    path = local[1]
    replicated = not _has_dtensor(into)
    try:
        part = read_part(path)
        manifest = part.manifest
        own = [n for n in manifest.files if n.startswith(f"{DCP_DIR}/__{rank}_")] + [rank_file_name(rank)]
        need = [TREE_FILE, f"{DCP_DIR}/.metadata"] + [n for n in own if n in manifest.files]
        problems = check_part_files(path, part, need)
        error = f"rank {rank}: " + "; ".join(map(str, problems)) if problems else None
        owners = _tensor_owners(path) if replicated and not problems else {}
    except CheckpointError as exc:
        error, owners = f"rank {rank}: {exc}", {}
    errors = [e for e in _all_gather(error, group) if e]
    if errors:
        log.info("step %d is in node memory but not readable here (%s): loading from %s", chosen,
                 "; ".join(errors), durable.root)
        return None
    try:
        if replicated:
            tree, targets = _dcp_tensors(path, manifest, into, read=False, distributed=False)
            mine = {name: t for name, t in targets.items() if owners.get(name) == rank}
            if len(owners) < len(targets):
                raise CheckpointError("a tensor is spread over several ranks' files")
            if mine:
                dcp.load(mine, storage_reader=dcp.FileSystemReader(str(path / DCP_DIR)), no_dist=True)
            state = (tree, targets, read_rank_file(path, manifest, rank))
        else:
            state = read_dcp_checkpoint(path, manifest, rank=rank, into=into, distributed=True)
        error = None
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        state, error = None, f"rank {rank}: {exc!r}"
    errors = [e for e in _all_gather(error, group) if e]
    if errors:
        log.warning("could not load step %d from node memory (%s): loading from %s", chosen, "; ".join(errors),
                    durable.root)
        return None
    if replicated:
        tree, targets, rank_values = state
        for name in sorted(targets):
            dist.broadcast(targets[name], src=owners[name], group=group)
        state = unflatten_state(tree, targets, rank_values)
    log.info("loaded step %d from node memory %s", chosen, path)
    return chosen, state
