"""A part's heal from a live peer, over the part's own process group (issue 31;
docs/elastic-in-place.md, "The heal"): torchft's checkpoint transport for `parts.join`.

torchft's default transport serves the peer's whole state over HTTP and the healing part
unpickles it into new tensors, which it then copies into its own. This one sends each
tensor's bytes over the process group the quorum has just configured (gloo send and recv)
straight into the healing part's own tensors: no copy, no allocation, and so a much shorter
step that heals (measured: docs/results-archive.md, "The heal over the process group"). What travels besides the tensors'
bytes is a JSON header (the step, the state's pytree, and for each leaf its path and either
the tensor's dtype and shape or its value), never a pickle. (torchft's own process-group
transport unpickles its peer's header.)

What a state may hold: tensors (on any device: a tensor off the CPU, or not contiguous,
travels through a CPU buffer), and ints, floats, strings, booleans and None, in dicts, lists
and tuples (torch's pytree). `check_state` says in one line where a state holds anything
else, before the part trains (`join` calls it).

The healing part's state takes the peer's layout (the header carries the peer's pytree, as
JSON): a tensor of the same path, dtype and shape is written in place, one this part does not
have yet (an optimizer's state, made at its first step) is made new.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, Callable

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_unflatten, treespec_dumps, treespec_loads
from torchft.checkpointing.transport import CheckpointTransport

# What travels besides tensors: JSON's own values (a float keeps every bit through repr, nan and
# the infinities included)
VALUES = (bool, int, float, str, type(None))
# the gloo tags of a heal's messages: the header's length, the header, then one per tensor
LENGTH_TAG, HEADER_TAG, FIRST_TENSOR_TAG = 1, 2, 3


class HealError(RuntimeError):
    """A state the heal cannot carry, or a peer that sent what a heal does not hold."""


def check_state(state: Any) -> None:
    """Raise HealError, in one line, where `state` holds a leaf that is neither a tensor nor
    one of VALUES."""
    _check_leaves(tree_flatten_with_path(state)[0])


def _check_leaves(leaves: list[tuple[Any, Any]]) -> None:
    for path, leaf in leaves:
        if not isinstance(leaf, (torch.Tensor, *VALUES)):
            raise HealError(f"the part's state holds a {type(leaf).__name__} at {keystr(path) or 'its top'}: a part "
                            "heals from a peer tensors, numbers, strings, booleans and None; keep the rest in a "
                            "tensor (torch.tensor, torch.frombuffer) or out of the state")


def _spec(leaf: Any) -> dict[str, Any]:
    if isinstance(leaf, torch.Tensor):
        return {"dtype": str(leaf.dtype).removeprefix("torch."), "shape": list(leaf.shape)}
    return {"value": leaf}


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A CPU uint8 tensor of `t`'s values, `t`'s own memory where it can be."""
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.contiguous().cpu()
    return t.reshape(-1).view(torch.uint8)


class PeerHeal(CheckpointTransport):
    """torchft's CheckpointTransport over `pg` (the Manager's own process group, which the
    quorum configures before the heal). `own_state`: this part's state as the Manager sends
    it ({"user": {...}, "torchft": {...}}), whose tensors a heal overwrites in place."""

    def __init__(self, pg: Any, own_state: Callable[[], Any]) -> None:
        self._pg = pg
        self._own_state = own_state

    def metadata(self) -> str:
        return "process group"  # the peer is reached over the group; nothing to look up

    def disallow_checkpoint(self) -> None:
        pass  # a send reads the live state while the main thread waits for the quorum

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        leaves, tree = tree_flatten_with_path(state_dict)
        _check_leaves(leaves)
        header = json.dumps({"step": step, "tree": treespec_dumps(tree),
                             "leaves": [[keystr(p), _spec(v)] for p, v in leaves]}).encode()
        works = []
        for dst in dst_ranks:
            works.append(self._pg.send([torch.tensor([len(header)], dtype=torch.int64)], dst, tag=LENGTH_TAG))
            works.append(self._pg.send([torch.frombuffer(bytearray(header), dtype=torch.uint8)], dst, tag=HEADER_TAG))
        tensors = [_as_bytes(v) for _, v in leaves if isinstance(v, torch.Tensor)]
        for i, t in enumerate(tensors):
            if t.numel():
                works += [self._pg.send([t], dst, tag=FIRST_TENSOR_TAG + i) for dst in dst_ranks]
        for w in works:
            w.wait(timeout)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        length = torch.zeros(1, dtype=torch.int64)
        self._pg.recv([length], src_rank, tag=LENGTH_TAG).wait(timeout)
        raw = torch.empty(int(length.item()), dtype=torch.uint8)
        self._pg.recv([raw], src_rank, tag=HEADER_TAG).wait(timeout)
        header = json.loads(raw.numpy().tobytes())
        if header["step"] != step:
            raise HealError(f"the peer sent step {header['step']}, the quorum's is {step}")
        mine = {keystr(path): leaf for path, leaf in tree_flatten_with_path(self._own_state())[0]}
        values, works, staged = [], [], []
        i = 0
        for path, spec in header["leaves"]:
            if "value" in spec:
                values.append(spec["value"])
                continue
            into = mine.get(path)
            if not (isinstance(into, torch.Tensor) and _spec(into) == spec):  # a leaf this part lacks yet
                into = torch.empty(spec["shape"], dtype=_dtype(spec["dtype"]))
            values.append(into)
            if into.numel():
                into = into.detach()
                direct = into.device.type == "cpu" and into.is_contiguous()
                buf = into.reshape(-1).view(torch.uint8) if direct else torch.empty(
                    into.numel() * into.element_size(), dtype=torch.uint8)
                works.append(self._pg.recv([buf], src_rank, tag=FIRST_TENSOR_TAG + i))
                if not direct:
                    staged.append((into, buf))
            i += 1
        for w in works:
            w.wait(timeout)
        with torch.no_grad():
            for into, buf in staged:
                into.copy_(buf.view(into.dtype).view(into.shape))
        return tree_unflatten(values, treespec_loads(header["tree"]))


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise HealError(f"the peer sent a tensor of dtype {name!r}, which this torch does not have")
    return dtype
