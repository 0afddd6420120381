"""What both save paths share: the files of a step directory, the single-process layout's
reader, the manifest's versions and the staging dirs a save is writing into.

manager.py (single process) and sharded.py (DCP) import this module; it imports neither.
"""

from __future__ import annotations

import logging
import platform
import struct
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from .commit import CheckpointStore
from .errors import CheckpointError, CorruptCheckpointError, Problem
from .fileio import VerifyingReader
from .manifest import LAYOUT_FILES, FileEntry, Manifest
from .serialize import FlatState, parse_header, unflatten_state

log = logging.getLogger(__name__)

STATE_FILE = "state.safetensors"


def rank_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def checkpoint_versions() -> dict[str, str]:
    return {"slurm_hai": __version__, "torch": torch.__version__, "python": platform.python_version()}


def read_single_checkpoint(path: Path, manifest: Manifest, rank: int) -> Any:
    """Read state.safetensors (+ this rank's per-rank file), verifying before parsing."""
    if manifest.layout == LAYOUT_FILES:  # valid, but not ours to parse: never quarantine it
        raise CheckpointError(f"{path} holds a framework's own files: resume it through slurm_hai.integrations")
    if STATE_FILE not in manifest.files:
        raise CorruptCheckpointError(str(path), [Problem(STATE_FILE, "not listed in the manifest")])
    main = read_tensor_file(path / STATE_FILE, manifest.files[STATE_FILE], STATE_FILE)
    per_rank = read_rank_file(path, manifest, rank)
    return unflatten_state(main.tree, main.tensors, per_rank)


def read_rank_file(path: Path, manifest: Manifest, rank: int) -> list[Any] | None:
    """This rank's PerRank values, or None when the checkpoint has none for this rank
    (it was saved with a smaller world size)."""
    name = rank_file_name(rank)
    entry = manifest.files.get(name)
    if entry is None:
        if any(n.startswith("rank-") for n in manifest.files):
            log.warning("%s has no per-rank state for rank %d (saved with world size %d)", path, rank, manifest.world_size)
        return None
    flat = read_tensor_file(path / name, entry, name)
    values = unflatten_state(flat.tree, flat.tensors)
    if not isinstance(values, list):
        raise CorruptCheckpointError(str(path), [Problem(name, "per-rank file does not hold a list")])
    return values


class ActiveStaging:
    """The staging dirs this process is writing into: CheckpointStore.clean_stale(paths)
    must leave them alone, whatever their age."""

    def __init__(self) -> None:
        self.paths: set[Path] = set()

    def add(self, staging: Path) -> None:
        self.paths.add(staging)

    def release(self, store: CheckpointStore, staging: Path) -> None:
        """The save is over, committed or not: forget the dir and remove what is left of it."""
        self.paths.discard(staging)
        if staging.exists():
            store.discard(staging)


def read_tensor_file(path: Path, entry: FileEntry, name: str) -> FlatState:
    """Read one of our safetensors files straight into freshly allocated tensors (one per
    entry, so nothing aliases a shared buffer), verifying size and checksum of every byte.
    The tensors are handed out only after the whole file matched the manifest."""
    reader = VerifyingReader(path, entry, name)
    try:
        (header_len,) = struct.unpack("<Q", reader.read_bytes(8))
        header = reader.read_bytes(header_len)
        data_start = 8 + header_len
        try:
            tree, slots = parse_header(header, entry.size - data_start)
        except CheckpointError as exc:
            reader.check()  # a checksum mismatch explains a garbled header best
            raise reader.corrupt(str(exc)) from None
        tensors = {}
        for slot in slots:
            if data_start + slot.begin > reader.offset:
                reader.read_bytes(data_start + slot.begin - reader.offset)  # padding, hashed too
            tensor = torch.empty(slot.shape, dtype=slot.dtype)
            if slot.end > slot.begin:
                reader.read_into(memoryview(tensor.view(-1).view(torch.uint8).numpy()).cast("B"))  # type: ignore[arg-type]
            tensors[slot.name] = tensor
        reader.check()
    finally:
        reader.close()
    return FlatState(tree, tensors)
