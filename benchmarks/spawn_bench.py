"""What starting the ranks costs a job at every start: N ranks on one node, each with torch.

    .venv/bin/python benchmarks/spawn_bench.py [--ranks 4] [--repeats 5]

A training script imports torch at its top and starts one process per GPU. `hai.spawn` uses
the "spawn" start method (as `torch.multiprocessing.spawn` does): each rank is a fresh
interpreter that imports torch again. Measured: the script's start (a new Python process,
as the job's launcher starts it) -> every rank in its function, alternating in one run,
medians of --repeats, for
- spawn: what `hai.spawn` does;
- forkserver: a fork server that imports the script (and so torch) once, each rank a fork of it;
- fork: each rank a fork of the script's own process, which imported torch already;
- fork after a parallel op: the same once the script has run one matmul (torch's OpenMP
  threads then exist): whether the ranks finish at all within --hang-after s.
On this 2-core VM every rank shares the 2 cores.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = '''
import multiprocessing as mp, sys, time
import torch  # what every training script does first

def train(local_rank, out):
    x = torch.randn(256, 256)
    x @ x  # a rank at work
    with open(out, "a") as f:
        f.write(f"{time.time()}\\n")

if __name__ == "__main__":
    out, ranks, method = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if method == "fork after a parallel op":
        x = torch.randn(512, 512)
        x @ x
    ctx = mp.get_context(method.split()[0])
    if method == "forkserver":
        ctx.set_forkserver_preload(["__main__"])
    procs = [ctx.Process(target=train, args=(i, out)) for i in range(ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
'''


def one(script: Path, ranks: int, method: str, work: Path, hang_after: float) -> float | None:
    """Seconds until every rank ran, or None if they had not within hang_after."""
    out = work / f"ranks-{time.monotonic_ns()}.txt"
    t0 = time.time()
    p = subprocess.Popen([sys.executable, str(script), str(out), str(ranks), method], start_new_session=True)
    try:
        p.wait(hang_after)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        return None
    times = [float(x) for x in out.read_text().split()] if out.exists() else []
    return max(times) - t0 if len(times) == ranks and p.returncode == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hang-after", type=float, default=60.0)
    args = ap.parse_args()
    methods = ("spawn", "forkserver", "fork", "fork after a parallel op")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        script = work / "train.py"
        script.write_text(SCRIPT)
        res: dict[str, list[float | None]] = {m: [] for m in methods}
        for k in range(args.repeats):
            for m in (methods if k % 2 == 0 else methods[::-1]):
                res[m].append(one(script, args.ranks, m, work, args.hang_after))
    ran = {m: [x for x in xs if x is not None] for m, xs in res.items()}
    base = statistics.median(ran["spawn"])
    print(f"\n{args.ranks} ranks on one node, {os.cpu_count()} cores, medians of {args.repeats}")
    print("| start method | script start -> every rank ran | range | vs spawn | runs that hung |")
    print("|---|---|---|---|---|")
    for m in methods:
        hung = f"{len(res[m]) - len(ran[m])} of {len(res[m])}"
        if not ran[m]:
            print(f"| {m} | - | - | - | {hung} (killed after {args.hang_after:.0f} s) |")
            continue
        med = statistics.median(ran[m])
        print(f"| {m} | {med:.2f} s | {min(ran[m]):.2f}-{max(ran[m]):.2f} s | {med / base:.2f}x | {hung} |")


if __name__ == "__main__":
    main()
