"""Suspend saves of a distributed job into node memory (the torch side of memory.py).

``save_to_memory``: every rank writes its shards, through DCP as in a durable save, into its
node's memory part; the ranks agree; each node's lowest rank commits the node's part, sends
it to the next node (the peer copy) and files the request for its persist agent; rank 0
marks the step pending in the durable directory. The data files are written into spares
(memory.py: pages reserved ahead in the background), in place, without torch.save's zip
CRC (the manifest's xxh3 checksum covers them): the save copies at memory speed instead of
faulting in fresh pages.

``load_from_memory``: when a restart lands where the step was saved, every rank reads its
own shards from its node's memory (checked against the manifest first), straight from the
mapped file into the live tensors; replicated tensors are read once and broadcast.
"""

from __future__ import annotations

import json
import io
import logging
import mmap
import os
import re
import shutil
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.tensor import DTensor

from .commit import CheckpointStore
from .errors import CheckpointError
from .fileio import write_hashed_file
from .layout import ActiveStaging, rank_file_name, read_rank_file
from .manifest import list_step_dirs, parse_manifest
from .memory import (PART_FILE, PartInfo, agent_alive, check_part_files, commit_part, file_request, mark_pending,
                     newest_part, node_name, peer_dir_name, pending_steps, read_part, spare_names, spares_dir,
                     take_spare)
from .serialize import unflatten_state
from .sharded import (DCP_DIR, TREE_FILE, RankShare, Reports, _agreed_manifest, _all_gather, _dcp_tensors,
                      _rank0_then_broadcast, _write_share)

log = logging.getLogger(__name__)



def own_file(rank: int) -> str:
    """The DCP file of `rank` in a save (single_file_per_rank)."""
    return f"__{rank}_0.distcp"


def spare_sizes(tensors: dict[str, torch.Tensor], rank: int, world_size: int, several_nodes: bool) -> dict[str, int]:
    """The spares (memory.py) this rank wants for a suspend save of these tensors: its own
    file (its DTensor shards, its share of the replicated tensors DCP spreads over the ranks,
    headers; a single process: the state file) and, with several nodes, as much again for
    the previous node's peer copy."""
    nbytes = sum(t.to_local().nbytes if isinstance(t, DTensor) else t.nbytes // world_size for t in tensors.values())
    size = nbytes + 4096 * len(tensors) + (1 << 20)
    sizes = {f"own-{rank}": size}
    if several_nodes:
        sizes[f"peer-{rank}"] = size
    return sizes


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

    rank = dist.get_rank()
    nodes = _agree_to_save(durable, step, share, group)
    if nodes is None:
        return None
    leaders = _node_leaders(nodes)
    order = sorted(leaders, key=leaders.__getitem__)
    staging_name = _rank0_then_broadcast(lambda: _open_staging(parts, durable, step), group)
    if staging_name is None:
        return True
    staging = parts.root / staging_name
    active_staging.add(staging)
    try:
        reports = _write_shards(parts, staging, step, share, group)
        part, shared_files = _agreed_part(durable, staging, step, reports, nodes, order, group)
        committed, local_error = None, None
        if leaders[part.node] == rank:
            committed, local_error = _commit_node_part(parts, staging, part, shared_files)
        _raise_if_any_failed(local_error, step, group)
        if committed is not None:
            local_error = _hand_over(parts, committed, part, order, leaders, group, peer_copy)
        # Every node's request is filed before the step is marked pending.
        _raise_if_any_failed(local_error, step, group)
        if rank == 0:
            mark_pending(durable, step, order)
        return False
    finally:
        active_staging.paths.discard(staging)
        if staging.exists() and leaders.get(nodes[rank]) == rank:
            parts.discard(staging)


def _save_failed(step: int, errors: list[str]) -> CheckpointError:
    """The error every rank raises when the suspend save of `step` failed somewhere."""
    return CheckpointError(f"suspend save of step {step} failed: {'; '.join(errors)}")


def _raise_if_any_failed(local_error: str | None, step: int, group: Any) -> None:
    """Collective: every rank raises the same CheckpointError, naming every rank's error, when
    any rank has one."""
    failed = [e for e in _all_gather(local_error, group) if e]
    if failed:
        raise _save_failed(step, failed)


def _agree_to_save(durable: CheckpointStore, step: int, share: RankShare, group: Any) -> list[str] | None:
    """Collective: the node of each rank, once every rank has prepared its share of the same
    `step` (else the same CheckpointError on every rank); None when some node has no persist
    agent (logged by rank 0)."""
    prepared = _all_gather((step, share.error, node_name(), agent_alive()), group)
    errors = [error for _, error, _, _ in prepared if error]
    if len({rank_step for rank_step, _, _, _ in prepared}) > 1:
        errors.append("the ranks save different steps; every rank must save the same step")
    if errors:
        raise _save_failed(step, errors)
    if not all(alive for _, _, _, alive in prepared):
        if dist.get_rank() == 0:
            missing = sorted({node for _, _, node, alive in prepared if not alive})
            log.warning("no persist agent on %s: saving step %d to %s directly", ", ".join(missing), step, durable.root)
        return None
    return [node for _, _, node, _ in prepared]


def _open_staging(parts: CheckpointStore, durable: CheckpointStore, step: int) -> str | None:
    """Rank 0: the name of a new staging dir for `step` in node memory, or None when the step
    is already committed durably (and verifies)."""
    existing = durable.step_path(step)
    if existing.exists() and durable.verify(existing).ok:
        return None
    return parts.new_staging(step).name


def _write_shards(parts: CheckpointStore, staging: Path, step: int, share: RankShare, group: Any) -> Reports:
    """Collective: every rank writes its share into `staging` on its node, its own DCP file
    into its spare (pages reserved ahead); returns every rank's report (_write_share)."""
    rank = dist.get_rank()
    try:
        staging.mkdir(mode=0o700, exist_ok=True)  # rank 0 made it on its node; each node its own
        (staging / DCP_DIR).mkdir(mode=0o700, exist_ok=True)
    except OSError:
        pass  # reported by the write that follows, in the agreement
    take_spare(spares_dir(parts), f"own-{rank}", staging / DCP_DIR / own_file(rank))
    return _write_share(staging, share, f"writing step {step} to node memory", group, in_memory=True)


def _agreed_part(durable: CheckpointStore, staging: Path, step: int, reports: Reports, nodes: list[str],
                 order: list[str], group: Any) -> tuple[PartInfo, dict[str, bytes]]:
    """Collective: this node's part.json (the files of its ranks; the manifest of every rank's
    files, from rank 0, whose CheckpointError every rank raises when a rank failed to write),
    and the small files that every node's part holds (the tree, DCP's metadata) as rank 0
    wrote them."""

    def whole() -> tuple[bytes, bytes, bytes]:
        manifest = _agreed_manifest(reports, step, "suspend save", durable.host)
        return (manifest.to_json_bytes(), (staging / TREE_FILE).read_bytes(),
                (staging / DCP_DIR / ".metadata").read_bytes())

    manifest_bytes, tree_bytes, metadata_bytes = _rank0_then_broadcast(whole, group)
    node = nodes[dist.get_rank()]
    owned = sorted(name for r, (rank_entries, _) in enumerate(reports) if nodes[r] == node for name in rank_entries)
    part = PartInfo(step, staging.name.rsplit("-", 1)[-1], node, order.index(node), len(order), str(durable.root),
                    owned, parse_manifest(manifest_bytes))
    return part, {TREE_FILE: tree_bytes, f"{DCP_DIR}/.metadata": metadata_bytes}


def _commit_node_part(parts: CheckpointStore, staging: Path, part: PartInfo,
                      shared_files: dict[str, bytes]) -> tuple[Path | None, str | None]:
    """Node leaders only: commit this node's part, with the small shared files written where
    this node lacks them. Returns (the committed part, None), or (None, the error)."""
    try:
        for name, data in shared_files.items():
            if not (staging / name).exists():  # the small shared files: on every node, for a load there
                write_hashed_file(staging / name, data)
        return commit_part(parts, staging, part), None
    except (OSError, CheckpointError) as exc:
        return None, f"node {part.node}: {exc}"


def _hand_over(parts: CheckpointStore, committed: Path, part: PartInfo, order: list[str], leaders: dict[str, int],
               group: Any, peer_copy: bool) -> str | None:
    """Node leaders only: file the request for this node's persist agent, and for the peer
    copy of the previous node's share that this node then holds; returns the error, if any."""
    # A peer copy first: once go_suspend() has run, the node may be lost at any time.
    peer = _peer_copy(parts, committed, part, order, leaders, group) if peer_copy and len(order) > 1 else None
    try:
        file_request(committed, part)
        if peer is not None:
            file_request(*peer)
    except CheckpointError as exc:
        return f"node {part.node}: {exc}"
    return None


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

    k, n = part.node_index, len(order)
    prev = (k - 1) % n
    to, frm = leaders[order[(k + 1) % n]], leaders[order[prev]]
    maps: list[mmap.mmap] = []
    tensors: list[torch.Tensor] = []
    works: list[Any] = []
    staging = parts.root / f".staging-peer-{part.step:012d}-{prev}-{os.getpid()}"

    def mapped(fd: int, size: int, writable: bool) -> torch.Tensor:
        # MAP_POPULATE: the page tables at once, not one fault per 4 KiB while gloo copies
        # (faults at every page made the copy into a spare several times slower).
        maps.append(mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                              prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)))
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
            pool = spare_names(spares_dir(parts), "peer-")
            for name, size in zip(their_names, their_sizes):
                path = staging / name
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                # the smallest spare that fits, or else the largest
                fits = [spare for spare in pool if spare[0] >= size] or pool[:1]
                reused = size >= 1 << 20 and bool(fits) and take_spare(spares_dir(parts), fits[-1][1], path)
                if reused:
                    pool.remove(fits[-1])
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (0 if reused else os.O_EXCL), 0o600)
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


class _MemoryFile(io.RawIOBase):
    """A read-only, seekable file over a memoryview, for zipfile: nothing is copied but what
    it reads (the archive's directory)."""

    def __init__(self, data: memoryview) -> None:
        self._data, self._pos = data, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), len(self._data) - self._pos))
        buffer[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._data)}[whence] + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # a zip local file header: signature ... name and extra lengths


def _stored_tensor_bytes(data: memoryview) -> memoryview | None:
    """The raw bytes of the tensor in one DCP item, a torch.save archive: its data record
    (`*/data/0`), which torch stores uncompressed and aligned. None when the archive is laid
    out otherwise (the caller then loads from the durable tier)."""
    try:
        with zipfile.ZipFile(_MemoryFile(data)) as archive:
            info = next((i for i in archive.infolist() if i.filename.endswith("/data/0")), None)
    except (zipfile.BadZipFile, ValueError, OSError):
        return None
    if info is None or info.compress_type != zipfile.ZIP_STORED:
        return None
    signature, name_len, extra_len = _LOCAL_HEADER.unpack_from(data, info.header_offset)
    if signature != b"PK\x03\x04":
        return None
    start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    return data[start:start + info.compress_size]


def _plan_in_place(metadata: Any, targets: dict[str, torch.Tensor], rank: int,
                   owners: dict[str, int]) -> list[tuple[torch.Tensor, str, Any]]:
    """What this rank reads straight from the mapped file of its own DCP file: [(the tensor
    to fill, the file, DCP's storage info)]. A DTensor's local shard comes from this rank's
    own file; a plain tensor from the one rank whose file holds it all (the others get it
    by broadcast). Raises CheckpointError when a tensor cannot be read that way."""
    mine = own_file(rank)
    reads = []
    for name, target in sorted(targets.items()):
        if isinstance(target, DTensor):
            chunks = target.__create_chunk_list__()
            if len(chunks) != 1:
                raise CheckpointError(f"{name}: {len(chunks)} local shards; only one per rank is read in place")
            offsets, sizes, local = chunks[0].offsets, chunks[0].sizes, target.to_local()
        else:
            if owners.get(name) is None:
                raise CheckpointError(f"{name}: spread over several ranks' files")
            if owners[name] != rank:
                continue
            offsets, sizes, local = torch.Size([0] * target.dim()), target.shape, target
        info = metadata.storage_data.get(MetadataIndex(name, torch.Size(offsets)))
        if info is None or info.relative_path != mine or tuple(sizes) != tuple(local.shape):
            raise CheckpointError(f"{name}: its shard at {tuple(offsets)} is not in this rank's file")
        reads.append((local, info.relative_path, info))
    return reads


def _read_in_place(path: Path, reads: list[tuple[torch.Tensor, str, Any]]) -> None:
    """Copy each planned tensor from its mapped file (MAP_POPULATE: page tables at once)."""
    files = {relative for _, relative, _ in reads}
    for relative in files:
        with open(path / DCP_DIR / relative, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if not size:
                continue
            with mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ) as m:
                view = memoryview(m)
                try:
                    for local, rel, info in reads:
                        if rel != relative:
                            continue
                        data = _stored_tensor_bytes(view[info.offset:info.offset + info.length])
                        if data is None or len(data) != local.nbytes:
                            raise CheckpointError(f"{relative}: an item at {info.offset} is not a plain stored tensor")
                        with warnings.catch_warnings():
                            warnings.filterwarnings("ignore", message="The given buffer is not writable")
                            stored = torch.frombuffer(data, dtype=torch.uint8) if len(data) else None
                        if stored is not None:
                            with torch.no_grad():
                                local.copy_(stored.view(local.dtype).view(local.shape))
                            del stored
                        data.release()
                finally:
                    view.release()


def _tensor_owners(metadata: Any) -> dict[str, int]:
    """The rank whose DCP file holds each whole tensor (replicated state: DCP wrote each
    tensor once, in one rank's file); a tensor spread over several files has no owner."""
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
    committed durably, and each rank's own files verify there. Each rank copies its DTensor
    shards, and the plain tensors its file holds, straight from the mapped file into the
    live tensors; the plain tensors are then broadcast by the rank that read them. None
    (nothing loaded: the caller reads the durable tier) when any rank cannot."""
    rank = dist.get_rank()
    local = newest_part(parts)
    found = _all_gather(local[0] if local else None, group)
    # A newer step committed durably, or on its way there from other nodes' memory, wins.
    newest_elsewhere = _rank0_then_broadcast(lambda: max(
        [s for s, _ in list_step_dirs(durable.root)] + pending_steps(durable), default=-1), group)
    chosen = found[0]
    if chosen is None or len(set(found)) > 1 or (step is not None and chosen != step) or newest_elsewhere > chosen:
        return None
    assert local is not None  # this rank's entry of `found` is `chosen`
    path = local[1]
    reads: list[tuple[torch.Tensor, str, Any]] = []
    try:
        part = read_part(path)
        manifest = part.manifest
        if manifest.world_size != dist.get_world_size():  # an elastic job restarted at another size
            raise CheckpointError(f"saved by {manifest.world_size} ranks, this run has {dist.get_world_size()}")
        own = [n for n in manifest.files if n.startswith(f"{DCP_DIR}/__{rank}_")] + [rank_file_name(rank)]
        problems = check_part_files(path, part, [TREE_FILE, f"{DCP_DIR}/.metadata"] +
                                    [n for n in own if n in manifest.files])
        if problems:
            raise CheckpointError("; ".join(map(str, problems)))
        metadata = dcp.FileSystemReader(str(path / DCP_DIR)).read_metadata()  # its checksum matched
        owners = _tensor_owners(metadata)
        tree, targets = _dcp_tensors(path, manifest, into, read=False, distributed=False, metadata=metadata)
        reads = _plan_in_place(metadata, targets, rank, owners)
        error = None
    except CheckpointError as exc:
        error = f"rank {rank}: {exc}"
    if errors := [e for e in _all_gather(error, group) if e]:
        log.info("step %d is in node memory but not readable in place here (%s): loading from %s", chosen,
                 "; ".join(errors), durable.root)
        return None
    try:
        _read_in_place(path, reads)
        rank_values, error = read_rank_file(path, manifest, rank), None
    except (OSError, CheckpointError) as exc:
        error = f"rank {rank}: {exc}"
    if errors := [e for e in _all_gather(error, group) if e]:
        log.warning("could not load step %d from node memory (%s): loading from %s", chosen, "; ".join(errors),
                    durable.root)
        return None
    for name in sorted(n for n, t in targets.items() if not isinstance(t, DTensor)):
        dist.broadcast(targets[name], src=owners[name], group=group)
    log.info("loaded step %d from node memory %s", chosen, path)
    return chosen, unflatten_state(tree, targets, rank_values)
