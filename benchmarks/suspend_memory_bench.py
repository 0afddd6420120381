"""Suspend in memory time (issue 12), on the live local cluster: a 2-node job holding GIB of
state per node (32 weight matrices, each a DTensor sharded by rows over the 2 ranks, as under
FSDP) is suspended with `hai suspend`, twice per repeat, alternating:

- memory: CheckpointManager(fast_dir=$HAI_NODE_MEMORY).suspend_save(): each node's shard
  to its own memory (into spares that reserve_node_memory() wrote ahead) and (without
  --no-peer) a copy to the next node's, go_suspend(); the nodes' persist agents make the
  durable copy;
- durable: a blocking save to the durable directory (what jobs did before), go_suspend().

The job holds its nodes across the requeue (a filler job holds the other two), so the
restart lands on the same nodes: the memory restart loads from node memory, the durable one
from the durable directory after its pages were dropped from the cache (posix_fadvise).

Baselines measured in the same run, in this process: one copy of GIB into preallocated
memory (memcpy), and GIB written and fsynced to the durable file system by 2 writers at once
(what the 2 agents write). Printed as a table; medians of --repeats.

    .venv/bin/python benchmarks/suspend_memory_bench.py [--gib 2] [--repeats 3] [--no-peer]

Needs the local cluster idle, with its persist agents (contrib/localcluster/up), as root;
after each job the agents remove its node memory, which the benchmark waits for.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import threading
import time
from pathlib import Path

import torch
from cluster_bench import WORK, drain, read_text, restarts, run, start_daemon, stop_daemon, wait_for

JOB = r"""
import os, sys, time
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
import slurm_hai as hai
from slurm_hai.checkpoint import CheckpointManager

mode, gib, peer = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "peer"
torch.set_num_threads(1)
hai.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
# 32 weight matrices of 4096 columns, each sharded by rows over the ranks (FSDP's layout). (One
# huge 1-D tensor would measure a torch quirk instead: DTensor's shard offsets build an
# arange of the whole dimension, 1.3 s for 2**27 rows.)
rows = max(1, int(gib * 2**30) // (32 * 4096 * 4))
locals_ = [torch.full((rows, 4096), float(rank + 1)) for _ in range(32)]
state = {f"w{i}": DTensor.from_local(t, mesh, [Shard(0)]) for i, t in enumerate(locals_)}
ckpt = os.path.join(os.environ["HAI_JOB_DIR"], "ckpt")
mgr = CheckpointManager(ckpt, fast_dir=os.environ.get("HAI_NODE_MEMORY") if mode == "memory" else None)
def cold():  # drop the checkpoint's pages from the page cache: a read from the disk
    for root, _, names in os.walk(ckpt):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    dist.barrier()

def timed_load(m):
    for t in locals_:
        t.zero_()
    dist.barrier()
    t0 = time.monotonic()
    m.load(into=state)
    took = time.monotonic() - t0
    return took, all(bool(state[f"w{i}"].to_local().eq(rank + 1).all()) for i in range(32))

if hai.restart_count() > 0:
    if mode == "durable":
        cold()
    took, ok = timed_load(mgr)
    print(f"loaded in {took:.3f} s from {mgr.loaded_from} ok={ok}", flush=True)
    if mode == "memory":  # the baseline, in the same run: the agents' durable copy of the same step
        while not os.path.isdir(os.path.join(ckpt, "step-000000000001")):
            time.sleep(0.1)
        cold()
        took, ok = timed_load(CheckpointManager(ckpt))
        print(f"durable loaded in {took:.3f} s ok={ok}", flush=True)
    mgr.close()
    sys.exit(0)
if mode == "memory":  # what a job does after building its model: node memory for the suspend save
    mgr.reserve_node_memory(state, wait=True)
print("ready", flush=True)
flag = torch.zeros(1)
while True:
    flag[0] = 1.0 if hai.receive_suspend_command() else 0.0
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        t0 = time.monotonic()
        h = mgr.suspend_save(1, state, peer_copy=peer) if mode == "memory" else mgr.save(1, state)
        print(f"committed in {time.monotonic() - t0:.3f} s to {h.where or ckpt}", flush=True)
        if rank == 0:
            hai.go_suspend()
        while True:
            time.sleep(1)
    time.sleep(0.01)
"""


def events(job_dir: Path) -> list[dict]:
    return [json.loads(line) for line in read_text(job_dir / "events.jsonl").splitlines() if line.strip()]


def event_t(job_dir: Path, name: str) -> float | None:
    return next((e["t"] for e in events(job_dir) if e["event"] == name), None)


def memcpy_s(gib: float) -> float:
    src = torch.ones(int(gib * 2**30) // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def write_fsync_s(gib: float, writers: int = 2) -> float:
    data = memoryview(torch.ones(int(gib * 2**30) // 4).numpy()).cast("B")

    def write(k: int) -> None:
        path = WORK / f"baseline-{k}"
        with open(path, "wb") as f:
            for start in range(0, len(data), 64 << 20):
                f.write(data[start:start + (64 << 20)])
            f.flush()
            os.fsync(f.fileno())
        path.unlink()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=write, args=(k,)) for k in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def shmem_gib() -> float:
    """Memory held by tmpfs on this host (every node's /dev/shm)."""
    kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("Shmem:"))
    return kib / 2**20


def finish(jobs: list[int]) -> None:
    """Cancel the jobs, and wait for the persist agents to remove their node memory (the
    next repeat must not start with less memory)."""
    drain(jobs)
    wait_for("the agents to free the jobs' node memory", lambda: shmem_gib() < 0.5, 120, 0.5)


def one(mode: str, gib: float, peer: bool) -> dict[str, float]:
    script = WORK / "memjob.py"
    script.write_text(JOB)
    filler = int(run(["sbatch", "--parsable", "-N2", "--qos=low", "--gres=gpu:8", "--output=/dev/null",
                      "--job-name=bench-filler", "--wrap", "sleep 3600"]).stdout.strip().split(";")[0])
    wait_for("the filler job", lambda: "RUNNING" in run(["squeue", "-h", "-j", str(filler), "-o", "%T"]).stdout, 60)
    info = json.loads(run(["hai-submit", "--json", "-n", "2", "-p", "LOW", "--gpus-per-node", "8",
                           "--name", f"bench-{mode}", str(script), "--", mode, str(gib),
                           "peer" if peer else "no-peer"]).stdout)
    job, job_dir = int(info["job_id"]), Path(info["job_dir"])
    log = job_dir / "logs" / "rank-0.log"
    wait_for(f"the {mode} job to be ready", lambda: "ready" in read_text(log), 300)
    before = restarts(job)
    run(["hai", "suspend", str(job)])
    requeued = wait_for("the requeue", lambda: restarts(job) > before and time.time(), 120, 0.01)
    notice = event_t(job_dir, "notice")
    if event_t(job_dir, "forced_suspend") is not None:  # the save did not make the grace
        finish([job, filler])
        return {"requeued": requeued - notice, "forced": 1.0}
    durable_step = job_dir / "ckpt" / "step-000000000001"
    durable_at = wait_for("the durable commit", lambda: durable_step.exists() and time.time(), 300, 0.01)
    loaded = wait_for("the restart's load", lambda: re.search(r"loaded in ([\d.]+) s from (\S+.*) ok=(\w+)",
                                                                 read_text(log)), 300)
    committed = re.search(r"committed in ([\d.]+) s to (.*)", read_text(log))
    got = {"requeued": requeued - notice, "forced": 0.0, "save": float(committed.group(1)),
           "where": committed.group(2), "durable_after_go": max(0.0, durable_at - event_t(job_dir, "go_suspend")),
           "load": float(loaded.group(1)), "from": loaded.group(2)}
    oks = [loaded.group(3)]
    if mode == "memory":
        durable = wait_for("the durable load", lambda: re.search(r"durable loaded in ([\d.]+) s ok=(\w+)",
                                                                  read_text(log)), 300)
        got["durable_load"] = float(durable.group(1))
        oks.append(durable.group(2))
    if oks != ["True"] * len(oks):
        raise SystemExit(f"{mode}: the restart loaded wrong values")
    finish([job, filler])
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0, help="state per node")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-peer", action="store_true", help="suspend_save(peer_copy=False): no copy in the next node")
    args = ap.parse_args()
    WORK.mkdir(mode=0o755, parents=True)
    if run(["squeue", "-h", "-o", "%i"]).stdout.split():
        raise SystemExit("the cluster is busy: the benchmark needs it idle (squeue shows jobs)")
    r: dict[str, list] = {}
    daemon = start_daemon()
    try:
        for i in range(args.repeats):
            r.setdefault("memcpy", []).append(memcpy_s(args.gib))
            r.setdefault("write", []).append(write_fsync_s(args.gib))
            for mode in ("memory", "durable"):
                got = one(mode, args.gib, not args.no_peer)
                for key, value in got.items():
                    r.setdefault(f"{mode}.{key}", []).append(value)
                print(f"repeat {i + 1}/{args.repeats} {mode}: " + ", ".join(
                    f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in got.items()), flush=True)
    finally:
        stop_daemon(daemon)

    forced = {mode: sum(r[f"{mode}.forced"]) for mode in ("memory", "durable")}
    if any(forced.values()):
        print(f"\nforced off after the grace (the save did not finish): {forced} of {args.repeats}")
    if "memory.save" not in r:
        raise SystemExit("no suspend to node memory made its grace: nothing more to compare")

    def m(key: str) -> float:
        return statistics.median(r[key])

    g = args.gib
    durable_forced = " (forced off at the grace)" if forced["durable"] == args.repeats else ""
    rows = [
        (f"notice -> requeued, 2 nodes x {g:g} GiB: suspend_save to node memory vs one memcpy of {g:g} GiB",
         m("memory.requeued"), m("memcpy"), f"{m('memory.requeued') / m('memcpy'):.1f}x (goal <= 1.5x)"),
        ("  the save itself (in the job) vs one memcpy",
         m("memory.save"), m("memcpy"), f"{m('memory.save') / m('memcpy'):.1f}x"),
        (f"notice -> requeued: node memory vs blocking durable save{durable_forced}",
         m("memory.requeued"), m("durable.requeued"), f"{m('durable.requeued') / m('memory.requeued'):.1f}x faster"),
        (f"agents' durable commit (go_suspend -> committed) vs 2 writers x {g:g} GiB write + fsync",
         m("memory.durable_after_go"), m("write"),
         f"{100 * m('write') / m('memory.durable_after_go'):.0f}% (goal >= 80%)"),
        ("restart on the same nodes: load from node memory vs the same step from the durable directory (cold cache)",
         m("memory.load"), m("memory.durable_load"),
         f"{m('memory.durable_load') / m('memory.load'):.1f}x faster (goal >= 3x)"),
    ]
    if "durable.save" in r:
        rows.insert(3, ("  the save itself (in the job): node memory vs durable", m("memory.save"), m("durable.save"),
                        f"{m('durable.save') / m('memory.save'):.1f}x faster"))
    print(f"\nsuspend in memory time, {time.strftime('%Y-%m-%d')}, medians of {args.repeats}; memory restarts "
          f"loaded from: {sorted(set(r['memory.from']))}")
    print("| what | ours | baseline | ratio |\n|---|---|---|---|")
    for what, ours, base, ratio in rows:
        print(f"| {what} | {ours:.2f} s | {base:.2f} s | {ratio} |")


if __name__ == "__main__":
    main()
