"""Elastic in place: who coordinates the parts, measured before it is built (issue 31,
docs/elastic-in-place.md, "Who coordinates").

The design runs a torchft lighthouse per elastic job from a service that outlives the parts.
A torchft lighthouse holds one quorum (its participants are every replica that talks to it),
so one lighthouse cannot serve two jobs. How to run N of them; measured without Slurm:

1. cost: N jobs of 4 parts each, every part a real torchft `ManagerServer` (heartbeats every
   100 ms) whose `ManagerClient` asks for a quorum at every step, against
   - `torchft_lighthouse` per job: torchft's own command, one process per job (the baseline);
   - torch-free per job: one process per job that loads only torchft's Rust extension
     (`LighthouseServer`), not the torchft package, whose import imports torch;
   - one torch-free host: one process hosting the N lighthouses (one port each);
   the lighthouses' resident memory and CPU over a window of steady steps.
2. restart: one job of 4 parts; its lighthouse is killed (SIGKILL) mid-run and started again
   on the same port after --restart-gap seconds. Per part: whether its quorum loop lived
   through it (with torchft's `quorum_retries` 0 and --retries), the longest wait for a
   quorum, and whether the quorum ids after the restart repeat ids the job already used
   (a torchft Manager names its process group's store keys by quorum id).

Run (torchft installed: pip install torchft==0.2.0); nothing else should run:

    .venv/bin/python benchmarks/lighthouse_bench.py --jobs 1,8,32 --window 10
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from slurm_hai.controller.lighthouse import HEARTBEAT_TIMEOUT_MS, JOIN_TIMEOUT_MS, QUORUM_TICK_MS  # the service's

PARTS = 4
PORT_BASE = 29700  # lighthouse of job j: PORT_BASE + j
STEP_S = 0.2  # a part's step: one quorum, then this long "training"

# A process that hosts the lighthouses of the ports in argv[1]. It loads only torchft's Rust
# extension: importing the torchft package imports torch (what makes torchft_lighthouse 228 MiB).
HOST = r'''
import importlib.machinery, importlib.util, signal, sys
so, ports = sys.argv[1], [int(p) for p in sys.argv[2].split(",")]
heartbeat_ms, join_ms, tick_ms = (int(a) for a in sys.argv[3:6])
loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", so)
ext = importlib.util.module_from_spec(importlib.util.spec_from_file_location("torchft._torchft", so, loader=loader))
loader.exec_module(ext)
servers = [ext.LighthouseServer(bind=f"[::]:{p}", min_replicas=1, join_timeout_ms=join_ms, quorum_tick_ms=tick_ms,
                                heartbeat_timeout_ms=heartbeat_ms) for p in ports]
print("ready", "torch" in sys.modules, flush=True)
signal.sigwait({signal.SIGTERM, signal.SIGINT})
'''
MODES = ("torchft_lighthouse per job", "torch-free per job", "one torch-free host")


def lighthouse_cli() -> str:
    return str(Path(sys.executable).with_name("torchft_lighthouse"))


def extension_path() -> str:
    spec = importlib.util.find_spec("torchft")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("lighthouse_bench: needs torchft (pip install torchft==0.2.0)")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("_torchft*.so"))
    if not found:
        raise SystemExit("lighthouse_bench: torchft has no _torchft extension here")
    return str(found[0])


def host(ports: list[int]) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOST, extension_path(), ",".join(map(str, ports)),
                          str(HEARTBEAT_TIMEOUT_MS), str(JOIN_TIMEOUT_MS), str(QUORUM_TICK_MS)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline().split() if p.stdout else []
    if line != ["ready", "False"]:
        raise SystemExit(f"lighthouse_bench: the lighthouse host did not start torch-free ({line})")
    return p


def start_lighthouses(mode: str, jobs: int) -> list[subprocess.Popen]:
    ports = [PORT_BASE + j for j in range(jobs)]
    if mode == MODES[0]:
        return [subprocess.Popen([lighthouse_cli(), "--min_replicas", "1", "--bind", f"[::]:{p}",
                                  "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS),
                                  "--join_timeout_ms", str(JOIN_TIMEOUT_MS), "--quorum_tick_ms", str(QUORUM_TICK_MS)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in ports]
    if mode == MODES[1]:
        return [host([p]) for p in ports]
    return [host(ports)]


@dataclass
class Part:
    job: int
    index: int
    retries: int
    quorums: list[tuple[float, int]] = field(default_factory=list)  # (time, quorum id)
    error: str = ""

    def run(self, stop: threading.Event) -> None:
        from torchft._torchft import ManagerClient, ManagerServer
        server = ManagerServer(replica_id=f"job{self.job}-part{self.index}:{uuid.uuid4()}",
                               lighthouse_addr=f"http://localhost:{PORT_BASE + self.job}", hostname="localhost",
                               bind="[::]:0", store_addr="localhost:1", world_size=1,
                               heartbeat_interval=timedelta(milliseconds=100), connect_timeout=timedelta(seconds=10),
                               quorum_retries=self.retries)
        client = ManagerClient(server.address(), connect_timeout=timedelta(seconds=10))
        step = 0
        try:
            while not stop.is_set():
                q = client._quorum(group_rank=0, step=step, checkpoint_metadata="", shrink_only=False,
                                   timeout=timedelta(seconds=30), init_sync=True, commit_failures=0)
                self.quorums.append((time.monotonic(), q.quorum_id))
                step += 1
                time.sleep(STEP_S)
        except Exception as e:  # noqa: BLE001 - what a part's Manager would raise is what we report
            self.error = str(e).splitlines()[0][:120]
        finally:
            server.shutdown()


def start_parts(jobs: int, retries: int) -> tuple[list[Part], list[threading.Thread], threading.Event]:
    stop = threading.Event()
    parts = [Part(j, i, retries) for j in range(jobs) for i in range(PARTS)]
    threads = [threading.Thread(target=p.run, args=(stop,), daemon=True) for p in parts]
    for t in threads:
        t.start()
    return parts, threads, stop


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def wait_steady(parts: list[Part], timeout: float) -> None:
    """Until every part has had 3 quorums (all lighthouses answer, every part joined)."""
    deadline = time.monotonic() + timeout
    while any(len(p.quorums) < 3 for p in parts):
        if time.monotonic() > deadline or any(p.error for p in parts):
            bad = [f"job{p.job}-part{p.index}: {p.error or f'{len(p.quorums)} quorums'}" for p in parts
                   if p.error or len(p.quorums) < 3]
            raise SystemExit(f"lighthouse_bench: parts did not reach steady steps: {bad[:4]}")
        time.sleep(0.1)


def stop_all(procs: list[subprocess.Popen], stop: threading.Event, threads: list[threading.Thread]) -> None:
    stop.set()
    for t in threads:
        t.join(timeout=40)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def measure_cost(mode: str, jobs: int, window: float) -> dict:
    procs = start_lighthouses(mode, jobs)
    parts, threads, stop = start_parts(jobs, retries=0)
    try:
        wait_steady(parts, timeout=60 + 2 * jobs)
        before = [len(p.quorums) for p in parts]
        cpu0 = sum(cpu_s(p.pid) for p in procs)
        t0 = time.monotonic()
        time.sleep(window)
        cpu = sum(cpu_s(p.pid) for p in procs) - cpu0
        elapsed = time.monotonic() - t0
        rss = sum(rss_mib(p.pid) for p in procs)
        steps = sum(len(p.quorums) - b for p, b in zip(parts, before)) / len(parts) / elapsed
    finally:
        stop_all(procs, stop, threads)
    return {"rss": rss, "cpu": cpu / elapsed, "steps": steps}


def measure_restart(gap: float, retries: int) -> dict:
    procs = start_lighthouses(MODES[2], 1)
    parts, threads, stop = start_parts(1, retries=retries)
    try:
        wait_steady(parts, timeout=60)
        time.sleep(1.0)
        ids_before = {q for p in parts for _, q in p.quorums}
        killed = time.monotonic()
        procs[0].kill()
        procs[0].wait()
        time.sleep(gap)
        procs = start_lighthouses(MODES[2], 1)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(p.error or any(t > killed + gap for t, _ in p.quorums)
                                                          for p in parts):
            time.sleep(0.1)
        time.sleep(2.0)
        after = [[(t, q) for t, q in p.quorums if t > killed] for p in parts]
        lived = [not p.error and bool(a) for p, a in zip(parts, after)]
        first = [a[0][0] - killed for a in after if a]
        ids_after = {q for a in after for _, q in a}
    finally:
        stop_all(procs, stop, threads)
    return {"lived": sum(lived), "first": max(first) if first else None,
            "errors": sorted({p.error for p in parts if p.error}),
            "ids_before": (min(ids_before), max(ids_before)), "ids_after": sorted(ids_after)[:6],
            "repeated": sorted(ids_after & ids_before)[:6]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", default="1,8,32", help="job counts for the cost table (comma-separated)")
    ap.add_argument("--window", type=float, default=10.0, help="seconds of steady steps measured per row")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--restart-gap", type=float, default=2.0, help="seconds the host stays down")
    ap.add_argument("--retries", type=int, default=3, help="torchft quorum_retries for the second restart run")
    args = ap.parse_args()
    extension_path()  # torchft is there

    print(f"## Lighthouses for N jobs of {PARTS} parts (a quorum every {STEP_S} s a part; medians of "
          f"{args.repeats}, {args.window:.0f} s windows; ratios against {MODES[0]})\n")
    print("| jobs | how | memory | CPU (of a core) | memory ratio | CPU ratio | steps/s a part |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for jobs in [int(j) for j in args.jobs.split(",")]:
        rows: dict[str, list[dict]] = {m: [] for m in MODES}
        for _ in range(args.repeats):
            for mode in MODES:  # alternating, so that drift hits every mode
                rows[mode].append(measure_cost(mode, jobs, args.window))
        med = {m: {k: statistics.median(r[k] for r in rs) for k in ("rss", "cpu", "steps")} for m, rs in rows.items()}
        base = med[MODES[0]]
        for mode in MODES:
            m = med[mode]
            cpu_ratio = f"{m['cpu'] / base['cpu']:.2f}x" if base["cpu"] else "-"
            print(f"| {jobs} | {mode} | {m['rss']:.0f} MiB | {m['cpu'] * 100:.1f}% | {m['rss'] / base['rss']:.2f}x | "
                  f"{cpu_ratio} | {m['steps']:.2f} |", flush=True)

    print(f"\n## The lighthouse killed and started again after {args.restart_gap:.1f} s (one job of {PARTS} parts)\n")
    print("| quorum_retries | parts that lived | first quorum after the kill | quorum ids before -> after | "
          "ids repeated | errors |")
    print("|---:|---:|---:|---|---|---|")
    for retries in (0, args.retries):
        r = measure_restart(args.restart_gap, retries)
        first = f"{r['first']:.2f} s" if r["first"] is not None else "-"
        print(f"| {retries} | {r['lived']}/{PARTS} | {first} | {r['ids_before'][0]}..{r['ids_before'][1]} -> "
              f"{r['ids_after']} | {r['repeated'] or 'none'} | {'; '.join(r['errors']) or '-'} |", flush=True)


if __name__ == "__main__":
    main()
