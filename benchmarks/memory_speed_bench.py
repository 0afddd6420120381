"""Suspend at memory speed on the CPU (issue 56): an in-process micro benchmark of
CheckpointManager's node memory tier, without the Slurm cluster.

One process holds GIB of state (16 float32 matrices). Per repeat, alternating:

- memcpy: the baseline of the save: the same tensors copied into preallocated, already
  faulted memory (torch copy_, as the save's own copy);
- suspend_save(): into node memory (fast_dir in /dev/shm), after reserve_node_memory()
  finished in the background (as in a job between its saves); this process stands in for
  the node's persist agent (its pid file), and then makes the durable copy itself
  (memory.persist_part, what the agent runs), which also frees the pages for the next save;
- load from node memory: a fresh manager with the same fast_dir, load(into=state);
- load from the durable directory with a cold page cache: a fresh manager without fast_dir,
  after posix_fadvise(DONTNEED) on every file of the checkpoint (the baseline of the load).

Medians of --repeats; every load is checked against the saved values.

    .venv/bin/python benchmarks/memory_speed_bench.py [--gib 2] [--repeats 3] [--durable DIR]

The durable directory must be on a disk, not tmpfs (default: a new directory in /var/tmp).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slurm_hai.checkpoint import CheckpointManager, memory  # noqa: E402
from slurm_hai.checkpoint.agent import prepare_spool  # noqa: E402
from slurm_hai.checkpoint.manifest import step_dir_name  # noqa: E402
from slurm_hai.checkpoint.staging import HostBuffer, copy_to_host  # noqa: E402

MATRICES = 16


def drop_cache(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(fn) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--durable", default=None, help="parent of the durable directory (a disk)")
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="hai-memspeed-", dir=args.durable or "/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="hai-memspeed-", dir="/dev/shm"))
    os.environ["SLURMD_NODENAME"] = "bench"
    os.environ["HAI_PERSIST_SPOOL"] = str(base / "spool")
    prepare_spool(base / "spool")
    memory.write_agent_pidfile(base / "spool")  # this process stands in for the node's agent
    durable, fast = base / "durable", shm / "fast"

    numel = int(args.gib * 2**30) // (4 * MATRICES)
    state = {f"w{i}": torch.full((numel,), float(i)) for i in range(MATRICES)}
    nbytes = sum(t.nbytes for t in state.values())
    print(f"state: {nbytes / 2**30:.2f} GiB in {MATRICES} tensors; durable {durable}; node memory {fast}; "
          f"torch threads {torch.get_num_threads()}", flush=True)

    host = HostBuffer()
    flat = host.reserve(nbytes)
    flat.fill_(1)  # fault the baseline's pages in once, as the save's reserved memory is
    views, at = [], 0
    for t in state.values():
        views.append((flat[at:at + t.nbytes].view(torch.float32), t))
        at += t.nbytes

    rows: dict[str, list[float]] = {k: [] for k in ("memcpy", "save", "load_memory", "load_durable")}
    try:
        mgr = CheckpointManager(durable, fast_dir=fast)
        for r in range(args.repeats):
            step = r + 1
            for t in state.values():
                t.fill_(float(step))
            took, _ = timed(lambda: copy_to_host(views))
            rows["memcpy"].append(took)

            mgr.reserve_node_memory(state, wait=True)  # in a job: in the background, long before
            took, handle = timed(lambda: mgr.suspend_save(step, state))
            assert handle.where == "node memory", handle.where
            rows["save"].append(took)
            assert memory.persist_part(fast / "parts" / step_dir_name(step)) == "committed"

            for t in state.values():
                t.zero_()
            restart = CheckpointManager(durable, fast_dir=fast)
            took, _ = timed(lambda: restart.load(into=state))
            assert restart.loaded_from == "node memory" and restart.loaded_step == step, restart.loaded_from
            assert all(bool(t.eq(float(step)).all()) for t in state.values())
            restart.close()
            rows["load_memory"].append(took)

            for t in state.values():
                t.zero_()
            drop_cache(durable)
            cold = CheckpointManager(durable)
            took, _ = timed(lambda: cold.load(into=state))
            assert cold.loaded_from == str(durable) and cold.loaded_step == step, cold.loaded_from
            assert all(bool(t.eq(float(step)).all()) for t in state.values())
            cold.close()
            rows["load_durable"].append(took)
            print(f"repeat {r + 1}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in rows.items()), flush=True)
        mgr.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in rows.items()}
    gib = nbytes / 2**30
    print(f"\nmedians of {args.repeats}, {gib:.2f} GiB\n")
    print("| what | ours | baseline | ratio | goal |")
    print("|---|---|---|---|---|")
    ratio = med["save"] / med["memcpy"]
    print(f"| suspend_save() of {gib:.0f} GiB into node memory vs a memcpy into preallocated memory | "
          f"{med['save']:.3f} s | {med['memcpy']:.3f} s | {ratio:.2f}x | <= 1.5x: {'met' if ratio <= 1.5 else 'NOT met'} |")
    speedup = med["load_durable"] / med["load_memory"]
    print(f"| restart load(into=) of {gib:.0f} GiB: node memory vs the durable directory, cold cache | "
          f"{med['load_memory']:.3f} s | {med['load_durable']:.3f} s | {speedup:.1f}x faster | "
          f">= 3x: {'met' if speedup >= 3 else 'NOT met'} |")


if __name__ == "__main__":
    main()
