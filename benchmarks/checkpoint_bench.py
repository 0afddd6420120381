"""Checkpoint benchmark: slurm_hai.checkpoint against baselines measured in the same run.

    .venv/bin/python benchmarks/checkpoint_bench.py --gib 1 --repeats 3

Rows (medians over --repeats):
  * blocking time of save(blocking=False) vs one copy of the same bytes into preallocated
    buffers (the physical floor; target <= 1.5x) and vs torch.save + fsync (target >= 5x less);
  * durable persist throughput vs a plain sequential write + fsync of the same bytes to the
    same file system (target >= 70%), and vs the same write with O_DIRECT;
  * load from the fast tier (tmpfs) vs the durable tier with a cold page cache;
  * a single process's suspend_save() into node memory (tmpfs) reserved ahead
    (reserve_node_memory) vs into fresh pages, each against the copy into preallocated buffers;
  * torch.distributed.checkpoint save and async_save (single process) as the peer anchor;
  * --ranks N (default 4) gloo processes on this host, each holding its 1/N shard of every
    tensor (DTensors sharded on dim 0, as under FSDP): how long save(blocking=False) blocks vs one copy of the rank's
    tensors into preallocated buffers (target <= 1.5x) and vs save(blocking=True); the
    slowest rank's median (a synchronous training step waits for the slowest rank).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout too

from slurm_hai.checkpoint import CheckpointManager  # noqa: E402
from slurm_hai.checkpoint.manifest import step_dir_name  # noqa: E402

CHUNK = 64 << 20
TENSOR_BYTES = 16 << 20  # a model's worth of 16 MiB tensors plus a few small ones


@dataclass
class Row:
    what: str
    ours: str
    baseline: str
    ratio: str
    target: str


def print_table(title: str, rows: list[Row]) -> None:
    """The title, then the rows as a markdown table."""
    print(f"\n{title}\n")
    header = ["what", "ours", "baseline", "ratio", "target"]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print(f"| {row.what} | {row.ours} | {row.baseline} | {row.ratio} | {row.target} |")


def make_state(nbytes: int, device: str) -> dict[str, torch.Tensor]:
    state = {}
    for i in range(max(1, nbytes // TENSOR_BYTES)):
        raw = torch.randint(0, 256, (TENSOR_BYTES,), dtype=torch.uint8)
        state[f"layers.{i}.weight"] = raw.view(torch.float32).view(1024, -1).to(device)
    for i in range(8):  # biases, step counters: many small tensors are realistic
        state[f"small.{i}"] = torch.randn(1000, device=device)
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def remove_steps(root: Path) -> None:
    """Remove the committed steps under root (the store itself stays)."""
    for step_dir in root.glob("step-*"):
        shutil.rmtree(step_dir)


def stand_in_for_persist_agent(spool: Path) -> None:
    """This process poses as the node's persist agent (its pid file in spool, which
    $HAI_PERSIST_SPOOL names), so that suspend_save() writes into node memory; no agent
    runs, so nothing is copied on."""
    from slurm_hai.checkpoint import memory

    spool.mkdir(exist_ok=True)
    os.environ["HAI_PERSIST_SPOOL"] = str(spool)
    memory.write_agent_pidfile(spool)


def median_time(fn: Callable[[], None], repeats: int, before: Callable[[], None] | None = None) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_from_page_cache(root: Path) -> None:
    """Evict only our own files (no global drop_caches on a shared machine)."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def plain_write_fsync(path: Path, data: memoryview, direct: bool = False) -> None:
    """The baseline: sequential 64 MiB writes + fsync (O_DIRECT: data must be page-aligned)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o600)
    try:
        for start in range(0, len(data), CHUNK):
            view = data[start : start + CHUNK]
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _multi_rank_worker(rank: int, world_size: int, port: int, work: str, per_rank: int, repeats: int) -> None:
    """One rank of the --ranks case: interleaved, barrier-aligned measurements."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        shards = make_state(per_rank, "cpu")  # this rank's shard of each tensor
        state = {name: DTensor.from_local(shard, mesh, [Shard(0)], run_check=False) for name, shard in shards.items()}
        staging = torch.empty(state_bytes(shards), dtype=torch.uint8)

        def copy_once() -> None:
            offset = 0
            for tensor in shards.values():
                n = tensor.numel() * tensor.element_size()
                staging[offset : offset + n].view(tensor.dtype).view(tensor.shape).copy_(tensor)
                offset += n

        copy_once()  # first touch
        mgr = CheckpointManager(Path(work) / "multi-rank", keep_last=1)
        step = 1
        mgr.save(step, state, blocking=False)  # makes the checkpoint group, allocates host buffers
        mgr.wait()
        copies, blocking, persist, sync = [], [], [], []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            copy_once()
            copies.append(time.perf_counter() - start)
            dist.barrier()
            step += 1
            start = time.perf_counter()
            handle = mgr.save(step, state, blocking=False)
            returned = time.perf_counter()
            handle.wait()
            blocking.append(returned - start)
            persist.append(time.perf_counter() - returned)
            mgr.wait()
            dist.barrier()
            step += 1
            start = time.perf_counter()
            mgr.save(step, state)
            sync.append(time.perf_counter() - start)
        mgr.close()
        medians = [statistics.median(x) for x in (copies, blocking, persist, sync)]
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, medians)
        if rank == 0:
            (Path(work) / "multi-rank.json").write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.repeats = args.repeats
        self.work = Path(tempfile.mkdtemp(prefix="slurm-hai-bench-", dir=args.dir))
        fast_parent = args.fast_dir if args.fast_dir else ("/dev/shm" if Path("/dev/shm").is_dir() else None)
        self.fast = Path(tempfile.mkdtemp(prefix="slurm-hai-bench-", dir=fast_parent)) if fast_parent else None
        self.step = 0
        self.rows: list[Row] = []

    def next_step(self) -> int:
        self.step += 1
        return self.step

    def cleanup(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
        if self.fast is not None:
            shutil.rmtree(self.fast, ignore_errors=True)

    def save_rows(self, state: dict[str, torch.Tensor], label: str) -> None:
        nbytes = state_bytes(state)
        staging = torch.empty(nbytes, dtype=torch.uint8)

        def copy_once() -> None:
            offset = 0
            for tensor in state.values():
                n = tensor.numel() * tensor.element_size()
                staging[offset : offset + n].view(tensor.dtype).view(tensor.shape).copy_(tensor)  # noqa: F821 - deleted below, after its last call
                offset += n

        copy_once()  # first touch of fresh pages is not part of a steady-state copy
        mgr = CheckpointManager(self.work / f"ours-{label}", keep_last=1)
        mgr.save(self.next_step(), state)  # first save allocates the reusable host buffer
        # Interleaved, so that every baseline sees the same machine state as ours.
        copies, blocking, persist, plain, direct = [], [], [], [], []
        for _ in range(self.repeats):
            start = time.perf_counter()
            copy_once()
            copies.append(time.perf_counter() - start)
            start = time.perf_counter()
            handle = mgr.save(self.next_step(), state, blocking=False)
            returned = time.perf_counter()
            handle.wait()  # committed: written, checksummed, fsynced, renamed, dir fsynced
            blocking.append(returned - start)
            persist.append(time.perf_counter() - returned)
            mgr.wait()  # retention of the previous checkpoint, outside the measurement
            start = time.perf_counter()
            plain_write_fsync(self.work / "plain.bin", memoryview(staging.numpy()))
            plain.append(time.perf_counter() - start)
            (self.work / "plain.bin").unlink()
            aligned = mgr._buffer.reserve(nbytes // 4096 * 4096)  # page-aligned, as O_DIRECT needs
            start = time.perf_counter()
            plain_write_fsync(self.work / "direct.bin", memoryview(aligned.numpy()), direct=True)
            direct.append(time.perf_counter() - start)
            (self.work / "direct.bin").unlink()
        copy_s, ours_block, ours_persist, plain_s, direct_s = (
            statistics.median(x) for x in (copies, blocking, persist, plain, direct)
        )
        del staging  # copy_once, which reads it, is not called again
        gc.collect()

        torch_dir = self.work / f"torch-save-{label}"
        torch_dir.mkdir()

        def torch_save() -> None:
            path = torch_dir / f"{self.next_step()}.pt"
            with open(path, "wb") as fh:
                torch.save(state, fh)
                fh.flush()
                os.fsync(fh.fileno())
            path.unlink()

        torch_s = median_time(torch_save, self.repeats)
        self.rows += [
            Row(f"{label}: save(blocking=False) blocking vs copy into preallocated buffers",
                ms(ours_block), ms(copy_s), f"{ours_block / copy_s:.2f}x", "<= 1.5x"),
            Row(f"{label}: save(blocking=False) blocking vs torch.save + fsync",
                ms(ours_block), ms(torch_s), f"{torch_s / ours_block:.1f}x less", ">= 5x less"),
            Row(f"{label}: durable persist (write + xxh3 + fsync + commit) vs plain write + fsync",
                gbps(nbytes, ours_persist), gbps(nbytes, plain_s), f"{plain_s / ours_persist:.0%}", ">= 70%"),
            Row(f"{label}: durable persist vs plain O_DIRECT write + fsync (the device's best)",
                gbps(nbytes, ours_persist), gbps(nbytes // 4096 * 4096, direct_s),
                f"{direct_s / ours_persist * nbytes / (nbytes // 4096 * 4096):.0%}", "-"),
        ]
        self.load_rows(state, nbytes)
        self.suspend_rows(state, nbytes, copy_s)
        self.dcp_rows(state, nbytes, ours_block, ours_persist)

    def load_rows(self, state: dict[str, torch.Tensor], nbytes: int) -> None:
        if self.fast is None:
            return
        durable = self.work / "two-tier"
        mgr = CheckpointManager(durable, fast_dir=self.fast, keep_last=1)
        step = self.next_step()
        mgr.save(step, state)
        fast_mgr = CheckpointManager(self.fast)
        durable_mgr = CheckpointManager(durable)
        fast_mgr.load(step=step)  # warm-up: the allocator maps its pages once
        fast, cold = [], []
        for _ in range(self.repeats):
            gc.collect()
            start = time.perf_counter()
            fast_mgr.load(step=step)
            fast.append(time.perf_counter() - start)
            gc.collect()
            drop_from_page_cache(durable / step_dir_name(step))
            start = time.perf_counter()
            durable_mgr.load(step=step)
            cold.append(time.perf_counter() - start)
        fast_s, cold_s = statistics.median(fast), statistics.median(cold)
        self.rows.append(Row("load (verify + read) from fast tier (tmpfs) vs durable tier, cold cache",
                             gbps(nbytes, fast_s), gbps(nbytes, cold_s), f"{cold_s / fast_s:.1f}x faster", "-"))

    def suspend_rows(self, state: dict[str, torch.Tensor], nbytes: int, copy_s: float) -> None:
        """suspend_save() of one process into node memory, with this process standing in for
        the node's persist agent (which never runs here): into fresh tmpfs pages, and into
        the spare reserve_node_memory() wrote ahead. Interleaved; the host buffer is warm."""
        if self.fast is None:
            return
        stand_in_for_persist_agent(self.fast / "spool")
        mgr = CheckpointManager(self.work / "suspend", fast_dir=self.fast / "node")
        fresh, reserved = [], []
        for i in range(self.repeats + 1):  # the first round warms the host buffer up
            shutil.rmtree(self.fast / "node" / "spares", ignore_errors=True)
            for times, reserve in ((fresh, False), (reserved, True)):
                if reserve:
                    mgr.reserve_node_memory(state, wait=True)
                elapsed = median_time(lambda: mgr.suspend_save(self.next_step(), state), 1)
                if i:
                    times.append(elapsed)
                remove_steps(self.fast / "node" / "parts")
        del os.environ["HAI_PERSIST_SPOOL"]
        fresh_s, reserved_s = statistics.median(fresh), statistics.median(reserved)
        self.rows += [
            Row("suspend_save() into node memory reserved ahead vs copy into preallocated buffers",
                ms(reserved_s), ms(copy_s), f"{reserved_s / copy_s:.2f}x", "-"),
            Row("suspend_save() into node memory reserved ahead vs into fresh tmpfs pages",
                ms(reserved_s), ms(fresh_s), f"{fresh_s / reserved_s:.1f}x faster", "-"),
        ]

    def dcp_rows(self, state: dict[str, torch.Tensor], nbytes: int, ours_block: float, ours_persist: float) -> None:
        import torch.distributed.checkpoint as dcp

        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        root = self.work / "dcp"

        def sync_save() -> None:
            dcp.save(state, checkpoint_id=str(root / str(self.next_step())), no_dist=True)

        sync_s = median_time(sync_save, self.repeats, before=lambda: shutil.rmtree(root, ignore_errors=True))
        blocking, total = [], []
        for _ in range(self.repeats):
            shutil.rmtree(root, ignore_errors=True)
            start = time.perf_counter()
            future = dcp.async_save(state, checkpoint_id=str(root / str(self.next_step())), no_dist=True)
            returned = time.perf_counter()
            future.result()
            blocking.append(returned - start)
            total.append(time.perf_counter() - returned)
        async_block, async_persist = statistics.median(blocking), statistics.median(total)
        self.rows += [
            Row("peer: DCP save (sync) blocking vs ours async blocking",
                ms(ours_block), ms(sync_s), f"{sync_s / ours_block:.1f}x less", "-"),
            Row("peer: DCP async_save blocking vs ours async blocking",
                ms(ours_block), ms(async_block), f"{async_block / ours_block:.2f}x less", "-"),
            Row("peer: DCP async_save background persist vs ours (ours also checksums)",
                gbps(nbytes, ours_persist), gbps(nbytes, async_persist), f"{async_persist / ours_persist:.0%}", "-"),
        ]

    def multi_rank_rows(self, nbytes: int, ranks: int) -> None:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        per_rank = nbytes // ranks
        mp.start_processes(_multi_rank_worker, args=(ranks, port, str(self.work), per_rank, self.repeats),
                           nprocs=ranks, start_method="fork")
        per_rank_medians = json.loads((self.work / "multi-rank.json").read_text())
        copy_s, block_s, persist_s, sync_s = (max(column) for column in zip(*per_rank_medians))
        label = f"{ranks} ranks x {per_rank / 2**20:.0f} MiB shards"
        self.rows += [
            Row(f"{label}: save(blocking=False) blocking vs copy of the rank's tensors into preallocated buffers",
                ms(block_s), ms(copy_s), f"{block_s / copy_s:.2f}x", "<= 1.5x"),
            Row(f"{label}: save(blocking=False) blocking vs save(blocking=True) (sharded DCP + commit)",
                ms(block_s), ms(sync_s), f"{sync_s / block_s:.1f}x less", "-"),
            Row(f"{label}: background persist (DCP write + xxh3 + agreement + commit), all ranks' bytes",
                gbps(per_rank * ranks, persist_s), "-", "-", "-"),
        ]

    def print_table(self, nbytes: int) -> None:
        print_table(f"slurm_hai.checkpoint benchmark, {time.strftime('%Y-%m-%d')}, {platform.node()}, "
                    f"{os.cpu_count()} CPUs, torch {torch.__version__}, {nbytes / 2**30:.2f} GiB state, "
                    f"median of {self.repeats}; durable dir {self.work}, fast dir {self.fast}", self.rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats per measurement (median; default 5)")
    parser.add_argument("--dir", default=None, help="durable file system to test (default: the temp dir)")
    parser.add_argument("--fast-dir", default=None, help="fast tier parent (default /dev/shm)")
    parser.add_argument("--ranks-only", action="store_true", help="only the multi-rank case")
    parser.add_argument("--ranks", type=int, default=4,
                        help="gloo processes for the multi-rank async save case (0: skip; default 4)")
    args = parser.parse_args()
    bench = Bench(args)
    try:
        nbytes = int(args.gib * 2**30)
        if not args.ranks_only:
            state = make_state(int(args.gib * 2**30), "cpu")
            bench.save_rows(state, "cpu")
            nbytes = state_bytes(state)
            del state
        gc.collect()
        if args.ranks > 1:
            bench.multi_rank_rows(nbytes, args.ranks)
        bench.print_table(nbytes)
    finally:
        bench.cleanup()


if __name__ == "__main__":
    main()
