"""One process per GPU on this node, HAI style: `spawn(fn, args=(), nprocs=N, bind_numa=False,
start_method="spawn")`.

Each process runs fn(local_rank, *args) with LOCAL_RANK, LOCAL_WORLD_SIZE and the global
rank HAI_GLOBAL_RANK = RANK * nprocs + local_rank (RANK is the node rank of the HAI
contract) and HAI_GLOBAL_WORLD_SIZE = WORLD_SIZE * nprocs in its environment. If one
process fails, the others are stopped (SIGTERM, then SIGKILL) and spawn exits with its code.

start_method "spawn" (the default, as torch.multiprocessing.spawn) starts each process as a
fresh interpreter, which imports torch again at every start of the job. "fork" makes each a
copy of this process, imports included (so a job starts sooner: benchmarks/spawn_bench.py,
figures in docs/figures.md), and is safe only while this process has run no parallel torch
operation and not touched CUDA: forked processes then hang in OpenMP (seen) or fail in CUDA.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable, cast

STOP_GRACE_SECONDS = 5.0


def _numa_cpus(index: int, nprocs: int) -> set[int] | None:
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    if not nodes:
        return None
    node = nodes[index * len(nodes) // nprocs]
    cpus: set[int] = set()
    for part in (node / "cpulist").read_text().strip().split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus & os.sched_getaffinity(0) or None


def _entry(fn: Callable, local_rank: int, nprocs: int, args: tuple, bind_numa: bool) -> None:
    node_rank = int(os.environ.get("RANK", "0"))
    nodes = int(os.environ.get("WORLD_SIZE", "1"))
    os.environ.update(LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(nprocs),
                      HAI_GLOBAL_RANK=str(node_rank * nprocs + local_rank),
                      HAI_GLOBAL_WORLD_SIZE=str(nodes * nprocs))
    if bind_numa:
        cpus = _numa_cpus(local_rank, nprocs)
        if cpus:
            os.sched_setaffinity(0, cpus)
    try:
        fn(local_rank, *args)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # the traceback from the user's function on, as `python train.py` shows it
        print(f"local rank {local_rank}:", file=sys.stderr)
        traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        sys.stderr.flush()
        raise SystemExit(1) from None


def default_nprocs() -> int:
    for key in ("SLURM_GPUS_ON_NODE", "HAI_GPUS_PER_NODE"):
        if os.environ.get(key, "").isdigit() and int(os.environ[key]) > 0:
            return int(os.environ[key])
    return 1


START_METHODS = ("spawn", "fork")


def spawn(fn: Callable, args: tuple = (), nprocs: int | None = None, bind_numa: bool = False,
          start_method: str = "spawn") -> None:
    """Run fn(local_rank, *args) in `nprocs` processes; return when all succeeded."""
    if start_method not in START_METHODS:
        raise ValueError(f"spawn: start_method {start_method!r}: use one of {', '.join(START_METHODS)}")
    torch = sys.modules.get("torch")
    if start_method == "fork" and torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("spawn: this process has used CUDA, so forked processes cannot: "
                           "use start_method='spawn', or call spawn before anything touches CUDA")
    nprocs = nprocs or default_nprocs()
    ctx = mp.get_context("fork") if start_method == "fork" else mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(fn, i, nprocs, tuple(args), bind_numa), name=f"hai-rank{i}")
             for i in range(nprocs)]
    for p in procs:
        p.start()
    live = {p.sentinel: p for p in procs}
    failed = None
    while live and failed is None:
        for sentinel in wait(list(live)):
            p = live.pop(cast(int, sentinel))  # wait() gives back the sentinels it was given
            p.join()
            if p.exitcode != 0:
                failed = p
                break
    if failed is not None:
        for p in live.values():
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for p in live.values():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                assert p.pid is not None  # started above
                os.kill(p.pid, signal.SIGKILL)
                p.join()
        exitcode = failed.exitcode
        assert exitcode is not None  # joined above
        code = exitcode if exitcode > 0 else 128 - exitcode
        print(f"slurm-hai spawn: local rank {procs.index(failed)} exited with {exitcode}; "
              f"stopped the other {nprocs - 1}", file=sys.stderr, flush=True)
        sys.exit(code)
