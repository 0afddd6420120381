"""Suspend protocol costs, printed as a table.

1. receive_suspend_command() per call (polled every training step; target < 5 us), against
   two baselines measured in the same run: an empty Python function call and os.path.exists()
   on the flag file (what a naive file-polling client would do).
2. notice-to-requeued latency on the live local cluster (`--cluster`): from `hai suspend`
   to Slurm showing the job requeued, for a job that commits nothing and calls go_suspend()
   at once, against a job that ignores the notice (forced by the launcher after the grace).

    .venv/bin/python benchmarks/suspend_bench.py [--cluster] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path


def per_call_us(stmt: str, setup: str, number: int = 200_000, repeats: int = 7) -> float:
    times = timeit.repeat(stmt, setup=setup, number=number, repeat=repeats)
    return statistics.median(times) / number * 1e6


def bench_poll() -> list[tuple[str, float]]:
    d = tempfile.mkdtemp()
    flag = os.path.join(d, "flag")
    Path(flag).write_bytes(b"0")
    os.environ["HAI_SUSPEND_FLAG"] = flag
    setup = "import os, slurm_hai.runtime.client as c; c.receive_suspend_command()\ndef empty(): return False"
    return [
        ("empty Python call (floor)", per_call_us("empty()", setup)),
        ("os.path.exists(flag) (naive poll)", per_call_us(f"os.path.exists({flag!r})", setup)),
        ("receive_suspend_command()", per_call_us("c.receive_suspend_command()", setup)),
    ]


JOB = """
import time, slurm_hai.runtime.client as client
if client.restart_count() == 0:
    while True:
        if {cooperate} and client.receive_suspend_command():
            client.go_suspend()
        time.sleep(0.01)
"""


def run(argv: list[str]) -> str:
    return subprocess.run(argv, text=True, capture_output=True, check=True).stdout


def requeue_latency(cooperate: bool, grace: int) -> float:
    d = Path(tempfile.mkdtemp(prefix="hai-bench-", dir="/tmp"))
    d.chmod(0o755)
    script = d / "job.py"
    script.write_text(JOB.format(cooperate=cooperate))
    bindir = Path(sys.executable).parent
    job = json.loads(run([str(bindir / "hai-submit"), "--json", "-p", "LOW", "--gpus-per-node", "0",
                          "--grace", str(grace), "--workdir", str(d), str(script)]))["job_id"]
    while run(["squeue", "-h", "-j", str(job), "-o", "%T"]).strip() != "RUNNING":
        time.sleep(0.05)
    time.sleep(1.0)
    t0 = time.monotonic()
    run([str(bindir / "hai"), "suspend", str(job)])
    while "Restarts=1" not in run(["scontrol", "show", "job", str(job)]):
        time.sleep(0.02)
    latency = time.monotonic() - t0
    subprocess.run(["scancel", str(job)], check=False)
    return latency


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", action="store_true", help="also measure on the live cluster (SLURM_CONF)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rows = bench_poll()
    floor = rows[0][1]
    print("| measurement | median per call | vs empty call |")
    print("|---|---|---|")
    for name, us in rows:
        print(f"| {name} | {us * 1000:.0f} ns | {us / floor:.1f}x |")
    if args.cluster:
        grace = 3
        coop = [requeue_latency(True, grace) for _ in range(args.repeats)]
        forced = [requeue_latency(False, grace) for _ in range(args.repeats)]
        print()
        print(f"| notice -> requeued (live cluster, {args.repeats} runs) | median | min | max |")
        print("|---|---|---|---|")
        for name, xs in ((f"ignores the notice (forced after {grace} s grace)", forced),
                         ("go_suspend() at once", coop)):
            print(f"| {name} | {statistics.median(xs):.2f} s | {min(xs):.2f} s | {max(xs):.2f} s |")
        print(f"\ncooperative job requeued {statistics.median(forced) / statistics.median(coop):.1f}x sooner")


if __name__ == "__main__":
    main()
