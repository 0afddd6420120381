"""The bandwidths that bound checkpoints of GPU state on this machine (needs a CUDA GPU):

    python benchmarks/gpu_probe.py      # ~30 s; writes 4 GiB to /dev/shm and /var/tmp

device-to-host and host-to-device copies (pinned by torch, pinned in place with
cudaHostRegister, pageable), xxh3_128 in 1-16 threads, writes into fresh tmpfs pages in
1-16 threads, and the disk's O_DIRECT write and cold read. docs/results-archive.md reads
gpu_bench.py's table with them.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

SIZE = 4 << 30
PIECE = 64 << 20


def timed(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def gbps(seconds: float, nbytes: int = SIZE) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def copies() -> memoryview:
    device = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, device="cuda")
    pinned = torch.empty(SIZE, dtype=torch.uint8, pin_memory=True)
    registered = torch.frombuffer(mmap.mmap(-1, SIZE), dtype=torch.uint8)
    registered.fill_(1)  # touched first, as a reused buffer is
    print("cudaHostRegister of 4 GiB:", f"{timed(lambda: torch.cuda.cudart().cudaHostRegister(registered.data_ptr(), SIZE, 0)):.2f} s")
    pageable = torch.empty(SIZE, dtype=torch.uint8)
    pageable.fill_(1)
    for name, host in (("pin_memory", pinned), ("registered", registered), ("pageable", pageable)):
        host.copy_(device, non_blocking=True)
        torch.cuda.synchronize()
        print(f"device-to-host, {name}:", gbps(min(timed(lambda: host.copy_(device, non_blocking=True)) for _ in range(3))))
        print(f"host-to-device, {name}:", gbps(min(timed(lambda: device.copy_(host, non_blocking=True)) for _ in range(3))))
    return memoryview(pinned.numpy())


def hashing(data: memoryview) -> None:
    start = time.perf_counter()
    xxhash.xxh3_128(data).digest()
    print("xxh3_128, 1 thread:", gbps(time.perf_counter() - start))
    pieces = [data[i:i + (16 << 20)] for i in range(0, SIZE, 16 << 20)]
    for threads in (4, 8, 16):
        with ThreadPoolExecutor(threads) as pool:
            start = time.perf_counter()
            list(pool.map(lambda piece: xxhash.xxh3_128(piece).digest(), pieces))
            print(f"xxh3_128, {threads} threads on 16 MiB pieces:", gbps(time.perf_counter() - start))


def parallel_write(path: str, data: memoryview, threads: int) -> float:
    """Write data into a new file, each thread its own range; the file is removed after."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    share = len(data) // threads

    def write_range(index: int) -> None:
        offset = index * share
        view = data[offset:offset + share]
        while view:
            written = os.pwrite(fd, view[:PIECE], offset)
            offset += written
            view = view[written:]

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(write_range, range(threads)))
    seconds = time.perf_counter() - start
    os.close(fd)
    os.unlink(path)
    return seconds


def disk(data: memoryview, path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    start = time.perf_counter()
    view = data
    while view:
        view = view[os.write(fd, view[:PIECE]):]
    os.fsync(fd)
    print("disk, O_DIRECT write + fsync:", gbps(time.perf_counter() - start))
    os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    buffer = bytearray(PIECE)
    start = time.perf_counter()
    total = 0
    while got := os.readv(fd, [buffer]):
        total += got
    print("disk, read after POSIX_FADV_DONTNEED:", gbps(time.perf_counter() - start, total))
    os.close(fd)
    os.unlink(path)


def main() -> None:
    data = copies()
    hashing(data)
    for threads in (1, 4, 8, 16):
        print(f"tmpfs, fresh pages, {threads} threads:", gbps(parallel_write("/dev/shm/hai-probe.bin", data, threads)))
    disk(data, "/var/tmp/hai-probe.bin")


if __name__ == "__main__":
    main()
