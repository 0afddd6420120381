"""Suspend at memory speed on the CPU (issue 56): CheckpointManager's node memory tier as a
job uses it across its runs, without the Slurm cluster.

This process stands in for the node and its persist agent (its pid file). Each repeat is one
run of a job, a fresh Python process holding GIB of state (16 float32 matrices), as after a
requeue:

- its restart (from the second run on), from one tier as a job's is: alternately from node
  memory (restarted on the same nodes: the previous run's suspend save) and from the durable
  directory with a cold page cache (restarted elsewhere: posix_fadvise(DONTNEED) on every
  file of the checkpoint first; the baseline of the load), load(into=state) each time;
- reserve_node_memory(wait=True): in a job it runs in the background, long before a notice
  (the previous run's part, committed durably, is recycled as the spare);
- memcpy: the baseline of the save: the same tensors copied into preallocated, already
  faulted memory (torch copy_, as the save's own copy);
- suspend_save() into node memory (fast_dir in /dev/shm); the run then exits, and this
  process makes the durable copy (memory.persist_part, what the agent runs).

Medians over the runs of each kind; every load is checked against the saved values. Each
run imports the checkpoint package's modules before it times anything (among them
torch.distributed.checkpoint: about 1.1 s here, once per process, whichever tier it then
loads from).

    .venv/bin/python benchmarks/memory_speed_bench.py [--gib 2] [--repeats 5] [--durable DIR]

The durable directory must be on a disk, not tmpfs (default: a new directory in /var/tmp).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
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


def one_run(step: int, gib: float, durable: Path, fast: Path) -> dict[str, float]:
    """A run of the job (in a process of its own): its timings, by name. Its restart loads the
    previous run's checkpoint from node memory on even steps, from the durable tier on odd ones."""
    numel = int(gib * 2**30) // (4 * MATRICES)
    state = {f"w{i}": torch.zeros(numel) for i in range(MATRICES)}
    nbytes = sum(t.nbytes for t in state.values())
    took: dict[str, float] = {}
    import slurm_hai.checkpoint.node_memory  # noqa: F401  # the process's imports (1.1 s here) are not a load's
    tier = "" if step == 1 else "memory" if step % 2 == 0 else "durable"
    if tier:
        if tier == "durable":
            drop_cache(durable)
        restart = CheckpointManager(durable, fast_dir=fast if tier == "memory" else None)
        took[f"load_{tier}"], _ = timed(lambda: restart.load(into=state))
        assert restart.loaded_from == ("node memory" if tier == "memory" else str(durable)), restart.loaded_from
        assert restart.loaded_step == step - 1 and all(bool(t.eq(float(step - 1)).all()) for t in state.values())
        restart.close()
    for t in state.values():
        t.fill_(float(step))

    host = HostBuffer()
    flat = host.reserve(nbytes)
    flat.fill_(1)  # fault the baseline's pages in once, as the save's reserved memory is
    views, at = [], 0
    for t in state.values():
        views.append((flat[at:at + t.nbytes].view(torch.float32), t))
        at += t.nbytes
    mgr = CheckpointManager(durable, fast_dir=fast)
    mgr.reserve_node_memory(state, wait=True)  # in a job: in the background, long before
    took["memcpy"], _ = timed(lambda: copy_to_host(views))
    took[f"save_{tier or 'first'}"], handle = timed(lambda: mgr.suspend_save(step, state))
    assert handle.where == "node memory", handle.where
    mgr.close()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--durable", default=None, help="parent of the durable directory (a disk)")
    parser.add_argument("--run", type=int, default=0, help=argparse.SUPPRESS)  # a run: its step
    parser.add_argument("--dirs", nargs=2, default=None, help=argparse.SUPPRESS)  # a run: durable, fast
    args = parser.parse_args()
    if args.run:
        print(json.dumps(one_run(args.run, args.gib, Path(args.dirs[0]), Path(args.dirs[1]))))
        return

    base = Path(tempfile.mkdtemp(prefix="hai-memspeed-", dir=args.durable or "/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="hai-memspeed-", dir="/dev/shm"))
    os.environ["SLURMD_NODENAME"] = "bench"
    os.environ["HAI_PERSIST_SPOOL"] = str(base / "spool")
    prepare_spool(base / "spool")
    memory.write_agent_pidfile(base / "spool")  # this process stands in for the node's agent
    durable, fast = base / "durable", shm / "fast"
    print(f"state: {args.gib:g} GiB in {MATRICES} tensors; durable {durable}; node memory {fast}; "
          f"torch threads {torch.get_num_threads()}; a process per run", flush=True)

    rows: dict[str, list[float]] = {}
    try:
        for step in range(1, args.repeats + 1):
            out = subprocess.run([sys.executable, __file__, "--gib", str(args.gib), "--run", str(step),
                                  "--dirs", str(durable), str(fast)], check=True, capture_output=True, text=True)
            took = json.loads(out.stdout.splitlines()[-1])
            for k, v in took.items():
                rows.setdefault(k, []).append(v)
            assert memory.persist_part(fast / "parts" / step_dir_name(step)) == "committed"
            print(f"run {step}: " + ", ".join(f"{k} {v:.3f} s" for k, v in took.items()), flush=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"\nmedians ({', '.join(f'{k}: {len(v)}' for k, v in rows.items())} runs), {args.gib:g} GiB\n")
    print("| what | ours | baseline | ratio | goal |")
    print("|---|---|---|---|---|")
    for kind, after in (("memory", "restarted from node memory"), ("durable", "restarted from the durable tier"),
                        ("first", "first run, its spare reserved new")):
        if f"save_{kind}" in med:
            ratio = med[f"save_{kind}"] / med["memcpy"]
            print(f"| suspend_save() of {args.gib:g} GiB into node memory, a run {after}, vs a memcpy into "
                  f"preallocated memory | {med[f'save_{kind}']:.3f} s | {med['memcpy']:.3f} s | {ratio:.2f}x | "
                  f"<= 1.5x: {'met' if ratio <= 1.5 else 'NOT met'} |")
    speedup = med["load_durable"] / med["load_memory"]
    print(f"| restart load(into=) of {args.gib:g} GiB: node memory vs the durable directory, cold cache | "
          f"{med['load_memory']:.3f} s | {med['load_durable']:.3f} s | {speedup:.1f}x faster | "
          f">= 3x: {'met' if speedup >= 3 else 'NOT met'} |")

if __name__ == "__main__":
    main()
