"""Copy the state into reusable host buffers, then persist it in a background thread.

The blocking part of an async save is one copy of every tensor into a preallocated host
buffer (pinned when a tensor is on a GPU); allocating fresh memory each time costs several
times a plain copy, so the buffer is kept and only grows.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
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
    """A single page-aligned uint8 host buffer reused by every save (one save in flight).

    Its memory is an anonymous mapping of exactly the size asked for. For tensors on a GPU
    it is pinned in place (cudaHostRegister), so device-to-host copies run at DMA speed:
    torch's pinned allocator (pin_memory=True) rounds every block up to a power of two
    (a 32.1 GiB save would pin 64 GiB) and keeps freed blocks cached, pinned."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._pinned_ptr: int | None = None  # registered with CUDA: unregistered on release

    def reserve(self, nbytes: int, *, pinned: bool = False) -> torch.Tensor:
        """At least nbytes of the buffer (pinned: registered with CUDA), grown when needed."""
        if self._buffer is None or self._buffer.numel() < nbytes:
            size = max(nbytes, PAGE)
            self.release()  # let the old one go before mapping the bigger one
            try:
                self._buffer = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)
            except (OSError, ValueError) as exc:
                raise CheckpointError(
                    f"cannot allocate a {size / 2**30:.2f} GiB host staging buffer ({exc}); "
                    "free host memory or save fewer/smaller tensors per process"
                ) from exc
        if pinned and self._pinned_ptr is None:
            size = self._buffer.numel()
            error = torch.cuda.cudart().cudaHostRegister(self._buffer.data_ptr(), size, 0)
            if int(error) == 0:
                self._pinned_ptr = self._buffer.data_ptr()
            else:  # still correct, only slower: copies from the GPU go through pageable memory
                log.warning("cannot pin a %.2f GiB host staging buffer (CUDA error %s); copying through "
                            "pageable memory", size / 2**30, int(error))
        return self._buffer[:nbytes]

    def release(self) -> None:
        """Unpin and drop the buffer (its memory goes once no staged file refers to it)."""
        if self._pinned_ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)
            self._pinned_ptr = None
        self._buffer = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone already
            self.release()


def copy_to_host(copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """target.copy_(source) for each pair; returns once every copy has landed. Copies from a
    GPU are queued on the source device's current stream, behind the work that computes
    the tensors, and waited for on those streams alone (not the whole device)."""
    streams: dict[torch.device, torch.cuda.Stream] = {}
    with torch.no_grad():
        for target, source in copies:
            target.copy_(source, non_blocking=source.is_cuda)
            if source.is_cuda:
                streams.setdefault(source.device, torch.cuda.current_stream(source.device))
    for stream in streams.values():
        stream.synchronize()  # the copies must land before the caller touches its tensors


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
    host = buffer.reserve(total, pinned=any(t.is_cuda for _, flat in files for t in flat.tensors.values()))
    copies = []
    for _, flat, slots, header, start, _ in layouts:
        host[start : start + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        data_start = start + len(header)
        for slot in slots:
            if slot.end > slot.begin:
                target = host[data_start + slot.begin : data_start + slot.end].view(slot.dtype).view(slot.shape)
                copies.append((target, flat.tensors[slot.name].detach()))
    copy_to_host(copies)
    host_bytes = memoryview(host.numpy()).cast("B")  # type: ignore[arg-type]  # an ndarray is a buffer
    return [StagedFile(name, host_bytes[start : start + size]) for name, _, _, _, start, size in layouts]


TENSOR_ALIGN = 64  # each staged tensor starts at a cache-line boundary (any dtype's alignment)


def stage_tensors(tensors: dict[str, torch.Tensor], buffer: HostBuffer) -> dict[str, torch.Tensor]:
    """Copies of tensors in the host buffer, same names, shapes and dtypes (contiguous), for
    an async sharded save: returns when the copies are done, so the caller may modify its
    tensors right away. A DTensor's local shard is copied and wrapped again with its mesh
    and placements, so DCP still records which part of the global tensor it holds."""
    from torch.distributed.tensor import DTensor  # lazy: +500 ms to a saving script

    plan = []
    total = 0
    for name, tensor in tensors.items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        start = -(-total // TENSOR_ALIGN) * TENSOR_ALIGN
        nbytes = local.numel() * local.element_size()
        plan.append((name, tensor, local.detach(), start, nbytes))
        total = start + nbytes
    host = buffer.reserve(total, pinned=any(local.is_cuda for _, _, local, _, _ in plan))
    staged: dict[str, torch.Tensor] = {}
    copies = []
    for name, _, local, start, nbytes in plan:
        if nbytes:
            staged[name] = host[start : start + nbytes].view(local.dtype).view(local.shape)
            copies.append((staged[name], local))
        else:
            staged[name] = torch.empty(local.shape, dtype=local.dtype)
    copy_to_host(copies)
    for name, tensor, _, _, _ in plan:
        if isinstance(tensor, DTensor):
            # After the copies: from_local moves a host copy to a GPU mesh's device (an extra
            # copy of the shard in GPU memory while the save runs; docs/results-archive.md).
            staged[name] = DTensor.from_local(
                staged[name], tensor.device_mesh, tensor.placements, run_check=False,
                shape=tensor.shape, stride=tensor.stride(),
            )
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
