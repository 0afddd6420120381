"""Copy the state into reusable host buffers, then persist it in a background thread.

The blocking part of an async save is one copy of every tensor into a preallocated
(pinned when CUDA is present) host buffer; allocating fresh memory each time costs
several times a plain copy, so the buffer is kept and only grows.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .errors import CheckpointError
from .serialize import FlatState, build_header, plan_slots

log = logging.getLogger(__name__)

PAGE = 4096  # file images start page-aligned in the host buffer, data page-aligned in the file


@dataclass(frozen=True)
class StagedFile:
    """One checkpoint file, ready to write: its complete bytes (header + tensor data) as a
    page-aligned slice of the host buffer, so it can be written with O_DIRECT."""

    name: str
    image: memoryview


class HostBuffer:
    """A single page-aligned uint8 host buffer reused by every save (one save in flight)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def reserve(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None  # let the old one go before allocating the bigger one
            pinned = torch.cuda.is_available()  # pinned memory is page-aligned already
            try:
                raw = torch.empty(nbytes + (0 if pinned else PAGE), dtype=torch.uint8, pin_memory=pinned)
            except RuntimeError as exc:
                raise CheckpointError(
                    f"cannot allocate a {nbytes / 2**30:.2f} GiB host staging buffer ({exc}); "
                    "free host memory or save fewer/smaller tensors per process"
                ) from exc
            skip = -raw.data_ptr() % PAGE
            self._buffer = raw[skip : skip + nbytes]
        return self._buffer[:nbytes]


def stage_files(files: list[tuple[str, FlatState]], buffer: HostBuffer) -> list[StagedFile]:
    """Copy every tensor into the host buffer; returns when the copies are done, so the
    caller may modify its tensors right away."""
    layouts = []
    total = 0
    for name, flat in files:
        slots = plan_slots(flat.tensors)
        header = build_header(slots, flat.tree, align=PAGE)
        start = -(-total // PAGE) * PAGE
        size = len(header) + (slots[-1].end if slots else 0)
        layouts.append((name, flat, slots, header, start, size))
        total = start + size
    host = buffer.reserve(total)
    from_cuda = False
    with torch.no_grad():
        for _, flat, slots, header, start, _ in layouts:
            host[start : start + len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
            data_start = start + len(header)
            for slot in slots:
                if slot.end == slot.begin:
                    continue
                source = flat.tensors[slot.name].detach()
                target = host[data_start + slot.begin : data_start + slot.end].view(slot.dtype).view(slot.shape)
                from_cuda |= source.is_cuda
                target.copy_(source, non_blocking=source.is_cuda)
    if from_cuda:
        torch.cuda.synchronize()  # the copies must land before the caller touches its tensors
    host_bytes = memoryview(host.numpy()).cast("B")  # type: ignore[arg-type]  # an ndarray is a buffer
    return [StagedFile(name, host_bytes[start : start + size]) for name, _, _, _, start, size in layouts]


TENSOR_ALIGN = 64  # each staged tensor starts at a cache-line boundary (any dtype's alignment)


def stage_tensors(tensors: dict[str, torch.Tensor], buffer: HostBuffer) -> dict[str, torch.Tensor]:
    """Copies of tensors in the host buffer, same names, shapes and dtypes (contiguous), for
    an async sharded save: returns when the copies are done, so the caller may modify its
    tensors right away. A DTensor's local shard is copied and wrapped again with its mesh
    and placements, so DCP still records which part of the global tensor it holds."""
    from torch.distributed.tensor import DTensor

    plan = []
    total = 0
    for name, tensor in tensors.items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        start = -(-total // TENSOR_ALIGN) * TENSOR_ALIGN
        nbytes = local.numel() * local.element_size()
        plan.append((name, tensor, local.detach(), start, nbytes))
        total = start + nbytes
    host = buffer.reserve(total)
    staged: dict[str, torch.Tensor] = {}
    from_cuda = False
    with torch.no_grad():
        for name, tensor, local, start, nbytes in plan:
            if nbytes == 0:
                target = torch.empty(local.shape, dtype=local.dtype)
            else:
                target = host[start : start + nbytes].view(local.dtype).view(local.shape)
                from_cuda |= local.is_cuda
                target.copy_(local, non_blocking=local.is_cuda)
            if isinstance(tensor, DTensor):
                target = DTensor.from_local(
                    target, tensor.device_mesh, tensor.placements, run_check=False,
                    shape=tensor.shape, stride=tensor.stride(),
                )
            staged[name] = target
    if from_cuda:
        torch.cuda.synchronize()  # the copies must land before the caller touches its tensors
    return staged


class SaveHandle:
    """An in-flight save. wait() returns once committed, or raises its CheckpointError."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.skipped = False  # True when the step was already committed everywhere
        self.where = ""  # suspend_save(): "node memory", or the durable directory it fell back to
        self.nbytes = 0  # suspend_save(): the checkpoint's size
        self._done = threading.Event()
        self._first_tier_done = threading.Event()
        self._error: CheckpointError | None = None
        self._reported = False

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None, *, durable: bool = True) -> None:
        """Block until committed to every tier (durable=False: to the first, fast tier)."""
        event = self._done if durable else self._first_tier_done
        if not event.wait(timeout):
            raise CheckpointError(f"save of step {self.step} still running after {timeout} s")
        if self._done.is_set():
            self.raise_error()

    def raise_error(self) -> None:
        """Raise this save's failure once; later calls stay silent (it has been reported)."""
        if self._error is not None and not self._reported:
            self._reported = True
            raise self._error

    def mark_first_tier_done(self) -> None:
        self._first_tier_done.set()

    def finish(self, error: CheckpointError | None = None) -> None:
        self._error = error
        self._first_tier_done.set()
        self._done.set()


def run_in_background(
    handle: SaveHandle, persist: Callable[[], None], housekeeping: Callable[[], None]
) -> threading.Thread:
    """Run persist() in a non-daemon thread (so interpreter exit waits for the commit) and
    keep any failure on the handle for the next save/wait/load to raise. housekeeping()
    (retention, cleanup) runs after the handle reports the commit: it never delays it."""

    def target() -> None:
        try:
            persist()
        except CheckpointError as exc:
            # Logged now as well: a job that exits without another save/wait/load still shows it.
            log.error("background save of step %d failed: %s", handle.step, exc)
            handle.finish(exc)
        except BaseException as exc:  # noqa: BLE001 - DCP raises BaseException subclasses
            log.exception("background save of step %d failed", handle.step)
            error = CheckpointError(f"background save of step {handle.step} failed: {exc!r}")
            error.__cause__ = exc
            handle.finish(error)
        else:
            handle.finish()
        housekeeping()

    thread = threading.Thread(target=target, name=f"ckpt-save-{handle.step}", daemon=False)
    thread.start()
    return thread
