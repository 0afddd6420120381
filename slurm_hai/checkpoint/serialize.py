"""Flatten a nested training state into named tensors + a JSON tree, and back. No pickle.

A state is a nested dict/list/tuple of tensors, numpy arrays, plain values
(None/bool/int/float/str/bytes) and objects with ``state_dict()`` (module, optimizer,
scheduler, sampler). The tree keeps the structure and the plain values; tensors are
replaced by ``{"tensor": name}`` and stored in a safetensors-compatible file whose
header also carries the tree, so any safetensors reader can open our files.

Values wrapped in :class:`PerRank` (RNG state, ...) differ between ranks: they are split
out and stored once per rank (``rank-00003.safetensors``), so a world-size change never
mixes them up and DCP never de-duplicates them away.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .errors import CheckpointError

TREE_METADATA_KEY = "slurm_hai.tree"

# safetensors dtype names; the file header uses them so other tools can read our files.
_DTYPE_TO_NAME: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_NAME_TO_DTYPE = {name: dtype for dtype, name in _DTYPE_TO_NAME.items()}


class PerRank:
    """Marks a value that differs per rank (RNG state): saved under a rank-unique file."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


@dataclass
class FlatState:
    """A state split into a JSON-able tree and the tensors it references by name."""

    tree: Any
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and not isinstance(
        value, (torch.Tensor, Mapping)
    )


class _Flattener:
    def __init__(self, collect_per_rank: bool) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.per_rank: list[Any] | None = [] if collect_per_rank else None

    def _name(self, path: tuple[str, ...]) -> str:
        base = "/".join(path) or "root"
        name, n = base, 1
        while name in self.tensors or name == "__metadata__":
            n += 1
            name = f"{base}#{n}"
        return name

    def node(self, value: Any, path: tuple[str, ...]) -> Any:
        where = "/".join(path) or "<root>"
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return float(value) if math.isfinite(value) else {"float": repr(float(value))}
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided or value.is_quantized or value.is_meta:
                raise CheckpointError(
                    f"{where}: cannot save a {value.layout} / quantized / meta tensor; "
                    "convert it to a dense tensor first"
                )
            if value.dtype not in _DTYPE_TO_NAME:
                raise CheckpointError(f"{where}: dtype {value.dtype} is not supported")
            name = self._name(path)
            self.tensors[name] = value
            return {"tensor": name}
        if isinstance(value, np.ndarray):
            try:
                as_tensor = torch.from_numpy(np.ascontiguousarray(value))
            except TypeError as exc:
                raise CheckpointError(f"{where}: numpy array of {value.dtype} is not supported") from exc
            name = self._name(path)
            self.tensors[name] = as_tensor
            return {"ndarray": name}
        if isinstance(value, (bytes, bytearray)):
            return {"bytes": base64.b64encode(bytes(value)).decode("ascii")}
        if isinstance(value, np.generic):
            return self.node(value.item(), path)
        if isinstance(value, PerRank):
            if self.per_rank is None:
                return self.node(value.value, path)
            self.per_rank.append(value.value)
            return {"per_rank": len(self.per_rank) - 1}
        if isinstance(value, Mapping):
            items = []
            for key, item in value.items():
                if isinstance(key, bool) or not isinstance(key, (str, int)):
                    raise CheckpointError(
                        f"{where}: dict key {key!r} is a {type(key).__name__}; only str and int keys can be saved"
                    )
                items.append([key, self.node(item, (*path, str(key)))])
            return {"dict": items}
        if isinstance(value, (list, tuple)):
            kind = "list" if isinstance(value, list) else "tuple"
            return {kind: [self.node(item, (*path, str(i))) for i, item in enumerate(value)]}
        if is_stateful(value):
            return self.node(value.state_dict(), path)
        raise CheckpointError(
            f"{where}: cannot save a {type(value).__module__}.{type(value).__qualname__}; "
            "use tensors, plain values, dicts/lists, or an object with state_dict()"
        )


def flatten_state(state: Any) -> tuple[FlatState, FlatState | None]:
    """(global part, per-rank part or None). Calls state_dict() on stateful objects."""
    flattener = _Flattener(collect_per_rank=True)
    tree = flattener.node(state, ())
    global_part = FlatState(tree, flattener.tensors)
    if not flattener.per_rank:
        return global_part, None
    rank_flattener = _Flattener(collect_per_rank=False)
    rank_tree = rank_flattener.node(flattener.per_rank, ("per_rank",))
    return global_part, FlatState(rank_tree, rank_flattener.tensors)


def unflatten_state(
    tree: Any, tensors: Mapping[str, torch.Tensor], per_rank: list[Any] | None = None
) -> Any:
    """Rebuild the nested state; PerRank places get this rank's value (None if it has none)."""
    try:
        return _build(tree, tensors, per_rank)
    except (KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(f"checkpoint tree does not match its tensors ({exc!r})") from exc


def _build(node: Any, tensors: Mapping[str, torch.Tensor], per_rank: list[Any] | None) -> Any:
    """The value of one node of the tree. A module function, not a closure that calls itself:
    such a closure is a reference cycle holding `tensors`, which (a load's freshly read
    tensors, gigabytes) then lived until the cyclic garbage collector ran, and it ran during
    the next suspend save (issue 56: 0.1-0.4 s of munmap in a 0.15 s save)."""
    if not isinstance(node, dict):
        return node
    (kind, payload), = node.items()
    if kind == "dict":
        return {key: _build(item, tensors, per_rank) for key, item in payload}
    if kind == "list":
        return [_build(item, tensors, per_rank) for item in payload]
    if kind == "tuple":
        return tuple(_build(item, tensors, per_rank) for item in payload)
    if kind == "tensor":
        return tensors[payload]
    if kind == "ndarray":
        return tensors[payload].numpy()
    if kind == "bytes":
        return base64.b64decode(payload)
    if kind == "float":
        return float(payload)
    if kind == "per_rank":
        return per_rank[payload] if per_rank is not None and payload < len(per_rank) else None
    raise CheckpointError(f"unknown node kind {kind!r} in checkpoint tree")


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives in a file's data region."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def plan_slots(tensors: Mapping[str, torch.Tensor]) -> list[TensorSlot]:
    """Lay tensors out back to back, widest dtype first, so every slot is naturally aligned
    (the data region starts 8-aligned) and loaded tensors can be zero-copy views."""
    order = sorted(tensors.items(), key=lambda item: -item[1].element_size())
    slots, offset = [], 0
    for name, tensor in order:
        nbytes = tensor.numel() * tensor.element_size()
        slots.append(TensorSlot(name, tensor.dtype, tuple(tensor.shape), offset, offset + nbytes))
        offset += nbytes
    return slots


def build_header(slots: list[TensorSlot], tree: Any, align: int = 8) -> bytes:
    """The safetensors header: u64 length + JSON, space-padded (allowed by the format) so
    that the data starts at a multiple of align (4096 lets the data go out with O_DIRECT)."""
    header: dict[str, Any] = {
        "__metadata__": {"format": "pt", TREE_METADATA_KEY: json.dumps(tree, separators=(",", ":"))}
    }
    for slot in slots:
        header[slot.name] = {
            "dtype": _DTYPE_TO_NAME[slot.dtype],
            "shape": list(slot.shape),
            "data_offsets": [slot.begin, slot.end],
        }
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % align)
    return struct.pack("<Q", len(encoded)) + encoded


def parse_header(header: bytes, data_len: int) -> tuple[Any, list[TensorSlot]]:
    """Decode a safetensors JSON header (without its u64 length prefix): the tree and the
    tensor slots sorted by offset. Rejects slots outside the data region or overlapping."""
    try:
        fields = json.loads(header)
        tree = json.loads(fields.pop("__metadata__")[TREE_METADATA_KEY])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"unreadable safetensors header ({exc})") from exc
    slots = []
    for name, info in fields.items():
        try:
            dtype = _NAME_TO_DTYPE[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"bad header entry for tensor {name!r}") from exc
        itemsize = torch.empty((), dtype=dtype).element_size()
        if min(shape, default=0) < 0 or end - begin != math.prod(shape) * itemsize:
            raise CheckpointError(f"tensor {name!r}: shape {shape} does not match its {end - begin} bytes")
        slots.append(TensorSlot(name, dtype, shape, begin, end))
    slots.sort(key=lambda slot: slot.begin)
    previous_end = 0
    for slot in slots:
        if slot.begin < previous_end or slot.end > data_len:
            raise CheckpointError(f"tensor {slot.name!r} overlaps another or runs past the end of the file")
        previous_end = slot.end
    return tree, slots
