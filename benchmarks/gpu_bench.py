"""GPU checkpoint benchmark: CheckpointManager with its state in CUDA memory, against
baselines measured in the same run (needs a CUDA GPU; no Slurm).

    python benchmarks/gpu_bench.py --gib 1 8 32 --repeats 3 [--dir DISK_DIR] [--fast-dir TMPFS_DIR]

For each size of GPU state (tensors of 256 MiB, plus a few small ones):
  * save(blocking=False) blocking time vs one pinned device-to-host copy of the same bytes
    (the floor; target <= 1.2x), steady state (the first save also allocates the host buffer);
  * suspend_save() (into node memory, fast-dir) vs that copy (target <= 1.5x);
  * a restart's load from node memory back into the GPU tensors vs a load from the durable
    directory (DISK_DIR) with a cold page cache (target >= 3x faster).
Then a GPT-2-sized transformer (transformers' GPT2LMHeadModel, 124M parameters, bf16
autocast, fused AdamW) trains: its step rate while a background save runs vs undisturbed
(target >= 95%).
The table comes last; --json FILE keeps every figure.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout too

from checkpoint_bench import (Row, drop_from_page_cache, gbps, ms, print_table, remove_steps,  # noqa: E402
                              stand_in_for_persist_agent, state_bytes)

from slurm_hai.checkpoint import CheckpointManager, SaveHandle  # noqa: E402
from slurm_hai.checkpoint.serialize import flatten_state  # noqa: E402

TENSOR_BYTES = 256 << 20


def gpu_state(nbytes: int) -> dict[str, torch.Tensor]:
    """nbytes of random-bit GPU tensors (fp32 and bf16, as a model and its optimizer hold)."""
    state = {}
    for i in range(max(1, nbytes // TENSOR_BYTES)):
        raw = torch.randint(0, 256, (TENSOR_BYTES,), dtype=torch.uint8, device="cuda")
        dtype = torch.bfloat16 if i % 4 == 0 else torch.float32
        state[f"layers.{i}.weight"] = raw.view(dtype).view(4096, -1)
    for i in range(8):
        state[f"small.{i}"] = torch.randn(1000, device="cuda")
    return state


def timed(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.repeats = args.repeats
        self.disk = Path(tempfile.mkdtemp(prefix="hai-gpu-bench-", dir=args.dir))
        self.fast = Path(tempfile.mkdtemp(prefix="hai-gpu-bench-", dir=args.fast_dir or "/dev/shm"))
        stand_in_for_persist_agent(self.fast / "spool")
        self.rows: list[Row] = []
        self.json = args.json
        self.figures: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                           "cpus": os.cpu_count(), "repeats": self.repeats}
        self.step = 0

    def next_step(self) -> int:
        self.step += 1
        return self.step

    def cleanup(self) -> None:
        shutil.rmtree(self.disk, ignore_errors=True)
        shutil.rmtree(self.fast, ignore_errors=True)

    def size_rows(self, gib: float) -> None:
        state = gpu_state(int(gib * 2**30))
        nbytes = state_bytes(state)
        label = f"{nbytes / 2**30:.3g} GiB"
        figures: dict[str, Any] = {"bytes": nbytes}
        self.figures[label] = figures
        mgr = CheckpointManager(self.fast / "async", keep_last=1)
        copy_s, stall_s, persist_s = self.async_save(mgr, state, figures)
        first_s = figures["first_save_blocking_s"]
        self.add(
            Row(f"{label}: save(blocking=False) blocking vs pinned device-to-host copy",
                ms(stall_s), ms(copy_s), f"{stall_s / copy_s:.2f}x", "<= 1.2x"),
            Row(f"{label}: first save(blocking=False) (maps and pins the host buffer) vs that copy",
                ms(first_s), ms(copy_s), f"{first_s / copy_s:.1f}x", "-"),
            Row(f"{label}: background persist (write + xxh3 + commit, tmpfs)", gbps(nbytes, persist_s), "-", "-", "-"),
        )
        suspend_s, memory_load_s = self.suspend_and_restart(mgr, state, figures)
        mgr._buffer.release()
        self.add(Row(f"{label}: suspend_save() into node memory vs pinned device-to-host copy",
                     ms(suspend_s), ms(copy_s), f"{suspend_s / copy_s:.2f}x", "<= 1.5x"))
        cold_s = self.durable_load(state, figures)
        self.add(Row(f"{label}: restart load to the GPU from node memory vs durable dir, cold cache",
                     ms(memory_load_s), ms(cold_s), f"{cold_s / memory_load_s:.1f}x faster", ">= 3x"))

    def async_save(self, mgr: CheckpointManager, state: dict[str, torch.Tensor],
                   figures: dict[str, Any]) -> tuple[float, float, float]:
        """save(blocking=False)'s stall vs the copy, into the manager's own pinned buffer. The
        durable tier is in memory too (the stall is measured here); each step is removed
        once committed, so that one state's worth of memory holds it."""
        nbytes = state_bytes(state)
        figures["first_save_blocking_s"] = timed(lambda: mgr.save(self.next_step(), state, blocking=False))
        mgr.wait()
        host = mgr._buffer.reserve(nbytes)

        def copy_once() -> None:
            offset = 0
            for tensor in state.values():
                n = tensor.numel() * tensor.element_size()
                host[offset:offset + n].view(tensor.dtype).view(tensor.shape).copy_(tensor, non_blocking=True)
                offset += n
            torch.cuda.synchronize()

        copies, stalls, persists = [], [], []
        for _ in range(self.repeats):  # interleaved: the baseline sees the machine ours sees
            remove_steps(mgr.durable.root)
            copies.append(timed(copy_once))
            step = self.next_step()
            stalls.append(timed(lambda: mgr.save(step, state, blocking=False)))
            persists.append(timed(mgr.wait))
        remove_steps(mgr.durable.root)
        figures.update(copy_s=copies, stall_s=stalls, persist_s=persists)
        return statistics.median(copies), statistics.median(stalls), statistics.median(persists)

    def suspend_and_restart(self, mgr: CheckpointManager, state: dict[str, torch.Tensor],
                            figures: dict[str, Any]) -> tuple[float, float]:
        """suspend_save() into node memory (with the host buffer the job's saves made), then a
        restart's load from there back into the GPU tensors."""
        suspends, loads = [], []
        for _ in range(self.repeats):
            suspending = CheckpointManager(self.disk / "suspend", fast_dir=self.fast / "node")
            suspending._buffer = mgr._buffer
            step = self.next_step()
            suspends.append(timed(lambda: suspending.suspend_save(step, state)))
            restart = CheckpointManager(self.disk / "suspend", fast_dir=self.fast / "node")
            loads.append(timed(lambda: restart.load(into=state)))
            assert restart.loaded_from == "node memory", restart.loaded_from
            shutil.rmtree(self.fast / "node")
            shutil.rmtree(self.disk / "suspend")
        figures.update(suspend_s=suspends, memory_load_s=loads)
        return statistics.median(suspends), statistics.median(loads)

    def durable_load(self, state: dict[str, torch.Tensor], figures: dict[str, Any]) -> float:
        """The same state saved to the durable directory, loaded with its pages evicted."""
        durable = CheckpointManager(self.disk / "durable", keep_last=1)
        step = self.next_step()
        figures["durable_save_s"] = timed(lambda: durable.save(step, state))
        durable._buffer.release()
        loads = []
        for _ in range(self.repeats):
            drop_from_page_cache(self.disk / "durable")
            loads.append(timed(lambda: CheckpointManager(self.disk / "durable").load(into=state)))
        shutil.rmtree(self.disk / "durable")
        figures["cold_load_s"] = loads
        return statistics.median(loads)

    def training_rows(self, steps: int, every: int) -> None:
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024)).cuda()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        tokens = torch.randint(0, 50257, (8, 1024), device="cuda")

        def train_step() -> float:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()  # a training loop logs its loss: one synchronisation per step

        state = {"model": model, "optimizer": optimizer}
        mgr = CheckpointManager(self.disk / "train", keep_last=2)
        for _ in range(10):
            train_step()
        mgr.save(self.next_step(), state, blocking=False)  # allocates the host buffer
        mgr.wait()
        nbytes = state_bytes(flatten_state(state)[0].tensors)
        quiet: list[float] = []
        busy: list[float] = []
        stalls: list[float] = []
        for _ in range(steps):  # undisturbed
            quiet.append(timed(train_step))
        handles: list[SaveHandle] = []
        for i in range(steps):  # a background save every `every` steps: the steps it overlaps
            if i % every == 0:
                mgr.wait()
                step = self.next_step()
                stalls.append(timed(lambda: handles.append(mgr.save(step, state, blocking=False))))
            elapsed = timed(train_step)
            if not handles[-1].done():
                busy.append(elapsed)
        mgr.wait()
        quiet_rate, busy_rate = 1 / statistics.median(quiet), 1 / statistics.median(busy) if busy else 0.0
        self.figures["gpt2"] = {"state_bytes": nbytes, "quiet_step_s": quiet, "busy_step_s": busy,
                                "stall_s": stalls}
        self.add(
            Row(f"GPT-2 124M bf16 (batch 8 x 1024): step rate during a background save vs undisturbed "
                f"({len(busy)} steps overlapped)", f"{busy_rate:.2f} steps/s", f"{quiet_rate:.2f} steps/s",
                f"{busy_rate / quiet_rate:.0%}" if busy else "no overlap", ">= 95%"),
            Row(f"GPT-2 124M: save(blocking=False) blocking ({nbytes / 2**30:.2f} GiB of state) vs one step",
                ms(statistics.median(stalls)), ms(statistics.median(quiet)),
                f"{statistics.median(stalls) / statistics.median(quiet):.2f} steps", "-"),
        )

    def add(self, *rows: Row) -> None:
        """Keep rows for the table, and print them at once: a run cut short still shows them."""
        self.rows += rows
        for row in rows:
            print(f"[gpu_bench] {row.what}: {row.ours} vs {row.baseline} = {row.ratio} (target {row.target})",
                  flush=True)
        if self.json:
            Path(self.json).write_text(json.dumps(self.figures, indent=1))

    def print_table(self) -> None:
        print_table(f"slurm_hai.checkpoint on the GPU, {time.strftime('%Y-%m-%d')}, {self.figures['device']}, "
                    f"{os.cpu_count()} CPUs, torch {torch.__version__}, median of {self.repeats}; "
                    f"durable dir {self.disk}, node memory {self.fast}", self.rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, nargs="*", default=[1.0],
                        help="GPU state sizes in GiB (default 1; none: only the training loop)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats per measurement (median; default 3)")
    parser.add_argument("--dir", default=None, help="durable file system (default: the temp dir)")
    parser.add_argument("--fast-dir", default=None, help="node memory, a tmpfs (default /dev/shm)")
    parser.add_argument("--train-steps", type=int, default=60, help="GPT-2 steps, undisturbed and with saves")
    parser.add_argument("--save-every", type=int, default=15, help="GPT-2 steps between background saves")
    parser.add_argument("--json", default=None, help="write every figure to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_bench: no CUDA GPU here (torch.cuda.is_available() is False); run it on a GPU machine")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: clean up, print what was measured
    bench = Bench(args)
    try:
        for gib in args.gib:
            bench.size_rows(gib)
            gc.collect()
            torch.cuda.empty_cache()
            print(f"[gpu_bench] {gib} GiB done", flush=True)
        if args.train_steps:
            bench.training_rows(args.train_steps, args.save_every)
    finally:
        bench.cleanup()
        bench.print_table()


if __name__ == "__main__":
    main()
