"""Elastic in place, measured on the way to building it (issue 31, docs/elastic-in-place.md).

The shape the design chose: an elastic job as one Slurm job array of one-node tasks ("parts"),
each a torchft replica group of one process (slurm_hai/runtime/parts.py), under the job's
lighthouse from `hai-admin lighthouse`, which outlives the parts. The array is plain sbatch
(hai-submit does not make one yet), its parts slurm-hai's; on the live local cluster:

1. a part's leave: the 4-task LOW array trains; a 2-node HIGH job arrives; Slurm preempts
   two tasks (PreemptMode=REQUEUE): their parts get the notice and leave, Slurm requeues the
   tasks. Measured: the survivors' longest step around the leave against their median step,
   and the time from the HIGH submission to the quorum of 2.
2. a rejoin: the HIGH job ends; the requeued tasks start again, their parts heal from a live
   peer (--state-mb of ballast each, copied by torchft) and train on. Measured: from the HIGH
   job's end to the rejoined parts' first step in a quorum of 4, and the heal itself.
3. exact: every part ends with weights bitwise equal to the others' (healed ones included);
   the parts split a global batch of 64 rows by their participating rank.

Each repeat runs the parts, then the fixed job: the baseline, measured in the same run, for
the HIGH job's start. Each part's process is started by Slurm in the part's step (`srun`), as
part_task starts it: Python's start and torch's import are part of every rejoin.

Run as root on an idle local cluster (torchft installed: pip install 'slurm-hai[elastic]'):

    .venv/bin/python benchmarks/elastic_parts_bench.py --repeats 3 --steps 200 [--state-mb 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import cluster_bench as cb  # the bench cluster's environment and helpers (benchmarks/)

PARTS = 4

PART = r'''
import json, os, sys, time
out, steps, state_mb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
index = int(os.environ["SLURM_ARRAY_TASK_ID"])
log = open(os.path.join(out, f"part{index}.log"), "a")
def note(**kw):
    log.write(json.dumps({"t": time.time(), "part": index, **kw}) + "\n"); log.flush()
note(event="start", restart=int(os.environ.get("SLURM_RESTART_COUNT", "0")))
from slurm_hai.runtime.parts import join, leave_on
leave_on()  # the notice, even during the imports: this part leaves
import torch
from torch import nn, optim
from torchft.optim import OptimizerWrapper
note(event="imported")
BATCH = 64
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
cpu = time.process_time()
ballast = torch.zeros(state_mb * 2**18)  # float32: state_mb MiB the heal must copy
inner = optim.SGD(model.parameters(), lr=0.01)
note(event="allocated", cpu_s=time.process_time() - cpu, load=os.getloadavg()[0])
def load(sd):
    t0 = time.time()
    model.load_state_dict(sd["model"]); inner.load_state_dict(sd["opt"]); ballast.copy_(sd["ballast"])
    note(event="healed", load_s=time.time() - t0)
def save():
    return {"model": model.state_dict(), "opt": inner.state_dict(), "ballast": ballast}
part = join(save, load)
note(event="manager")
opt = OptimizerWrapper(part.manager, inner)
while part.manager.current_step() < steps:
    opt.zero_grad()  # starts this step's quorum
    share = part.share(BATCH)
    step = part.manager.current_step()
    x = torch.randn(BATCH, 256, generator=torch.Generator().manual_seed(step))
    if share is not None:
        (model(x[share]).pow(2).sum() / BATCH).backward()
    part.sum_gradients(model.parameters())
    opt.step()  # commits only if the whole quorum's allreduce went through
    note(event="step", step=step, n=part.manager.num_participants())
    time.sleep(0.1)
w = torch.cat([p.detach().flatten() for p in model.parameters()])
import hashlib
note(event="end", bits=hashlib.sha256(w.numpy().tobytes()).hexdigest())
'''

# The part runs as a step: at preemption Slurm signals a job's steps, not its batch shell (a
# part run by the batch shell itself heard nothing until the grace time ran out).
BATCH = """#!/bin/bash
echo '{{"event": "task", "part": '$SLURM_ARRAY_TASK_ID', "restart": '${{SLURM_RESTART_COUNT:-0}}', "t": '$(date +%s.%N)'}}' >> {out}/part$SLURM_ARRAY_TASK_ID.log
srun {python} {script} {out} {steps} {state_mb}
"""


def start_lighthouse_service(out: Path, state: Path) -> tuple[subprocess.Popen, str, Path]:
    """`hai-admin lighthouse` beside slurmctld, as a site runs it: (its process, its URL, its
    state directory)."""
    log = out / "lighthouse-service.log"
    service = subprocess.Popen([str(cb.BIN / "hai-admin"), "lighthouse", "--listen", "127.0.0.1", "--port", "0",
                                "--state-dir", str(state)], env=cb.ENV, stdout=open(log, "w"),
                               stderr=subprocess.STDOUT)
    found = cb.wait_for("the lighthouse service", lambda: service.poll() is not None or
                        re.findall(r"lighthouse service on 127\.0\.0\.1:(\d+)", cb.read_text(log)), 30, 0.05)
    if service.poll() is not None:
        raise SystemExit(f"elastic_parts_bench: hai-admin lighthouse exited: {cb.read_text(log)}")
    return service, f"http://127.0.0.1:{found[-1]}", state


def submit_high(out: Path, hold: float) -> tuple[float, float, int]:
    """The 2-node HIGH job: (when submitted, when its script ran, its id)."""
    mark = out / "high.start"
    mark.unlink(missing_ok=True)
    t_high = time.time()
    high = int(cb.run(["sbatch", "--parsable", "-N2", "--qos=high", "--gres=gpu:8", "--output=/dev/null",
                       "--job-name=bench-high", "--wrap", f"date +%s.%N > {mark}; sleep {hold}"]).stdout
               .strip().split(";")[0])
    cb.wait_for("the HIGH job to run", lambda: cb.read_text(mark).strip(), 120, 0.05)
    return t_high, float(cb.read_text(mark)), high


def fixed_round(n: int) -> float:
    """The baseline: the same HIGH job against a fixed 4-node LOW job (plain sbatch --requeue,
    its step dies of the notice): seconds from the HIGH submission to its script running."""
    out = cb.WORK / f"fixed-{n}"
    out.mkdir(parents=True)
    low, _ = cb.submit_stock("dies", 0, 4, f"fixed-{n}")
    try:
        t_high, t_started, _ = submit_high(out, 0)
    finally:
        cb.run(["scancel", "--name=bench-high"], check=False)
        cb.drain([low])
    return t_started - t_high


def process_cost(pid: int) -> tuple[float, float]:
    """(resident MiB, CPU seconds used so far) of a live process, from /proc."""
    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
               if line.startswith("VmRSS:"))
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return rss / 1024, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def last_after(rows: list[dict], event: str, t: float) -> float:
    """Seconds from t to the last part's `event` after t (the parts that rejoined)."""
    return max((r["t"] for r in rows if r["event"] == event and r["t"] > t), default=float("nan")) - t


def records(out: Path) -> list[dict]:
    rows = []
    for f in out.glob("part*.log"):
        rows += [json.loads(line) for line in cb.read_text(f).splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["t"])


def one_round(args, n: int) -> dict:
    out = cb.WORK / f"round-{n}"
    out.mkdir(parents=True)
    out.chmod(0o777)
    script = out / "part.py"
    script.write_text(PART)
    # the service's state directory where only root writes (it refuses one under round-N)
    service, url, state = start_lighthouse_service(out, cb.WORK / f"lighthouses-{n}")
    try:
        batch = BATCH.format(python=sys.executable, script=script, out=out, steps=args.steps, state_mb=args.state_mb)
        # in sbatch's environment with --export=ALL: any other --export (ALL,VAR=...) implies
        # --get-user-env, and slurmd then runs the user's login shell before each launch (1.1 s
        # per task here: `_get_user_env` in slurmd's log at debug)
        env = {**cb.ENV, "HAI_LIGHTHOUSE_SERVICE": url, "OMP_NUM_THREADS": str(args.threads)}
        array = int(cb.run(["sbatch", "--parsable", f"--array=0-{PARTS - 1}", "-N1", "--qos=low", "--gres=gpu:8",
                            "--requeue", "--export=ALL", f"--output={out}/slurm-%A_%a.out",
                            "--job-name=bench-parts"], input=batch, env=env).stdout.strip().split(";")[0])
        cb.wait_for("four parts in one quorum", lambda: any(r.get("n") == PARTS for r in records(out)), 240, 0.2)
        time.sleep(args.warmup)
        t_high, t_started, high = submit_high(out, args.hold)
        cb.wait_for("the HIGH job to end", lambda: cb.slurm_state(high) in ("COMPLETED", ""), args.hold + 120, 0.1)
        t_ended = t_started + args.hold  # the script's own end; Slurm's record has whole seconds
        cb.wait_for("four parts in one quorum again",
                    lambda: any(r.get("n") == PARTS and r["t"] > t_ended for r in records(out)), 240, 0.2)
        cb.wait_for("every part to end", lambda: len([r for r in records(out) if r["event"] == "end"]) == PARTS,
                    args.steps * 2 + 240, 0.5)
        rows = records(out)
        (record,) = state.glob("*.json")
        lighthouse_cost = process_cost(json.loads(record.read_text())["pid"])
    finally:
        cb.run(["scancel", "--name=bench-parts"], check=False)
        cb.drain([])
        service.terminate()
        service.wait(10)
        for record in state.glob("*.json"):  # the service leaves its lighthouses running
            os.kill(json.loads(record.read_text())["pid"], signal.SIGTERM)
    left = {r["part"] for r in rows if r["event"] == "start" and r["restart"] > 0}
    survivors = sorted(set(range(PARTS)) - left)
    steps = {p: [r["t"] for r in rows if r["event"] == "step" and r["part"] == p] for p in survivors}
    gaps = {p: [b - a for a, b in zip(ts, ts[1:])] for p, ts in steps.items()}
    median_step = statistics.median(g for gs in gaps.values() for g in gs)
    around = [b - a for p, ts in steps.items() for a, b in zip(ts, ts[1:]) if a <= t_started + 5 and b >= t_high]
    two = next(r["t"] for r in rows if r["event"] == "step" and r["t"] > t_high and r["n"] == PARTS - len(left))
    back = next(r["t"] for r in rows if r["event"] == "step" and r["t"] > t_ended and r["n"] == PARTS)
    healed = [r for r in rows if r["event"] == "healed" and r["t"] > t_ended]
    ends = {r["part"]: r["bits"] for r in rows if r["event"] == "end"}
    return {
        "left": sorted(left), "median_step": median_step, "longest_around": max(around),
        "lost": max(around) - median_step, "to_quorum_of_survivors": two - t_high,
        "high_start": t_started - t_high, "rejoin": back - t_ended,
        "rejoin_task_started": min(r["t"] for r in rows if r["event"] == "task" and r["restart"] > 0) - t_ended,
        "rejoin_process_started": min(r["t"] for r in rows if r["event"] == "start" and r["restart"] > 0) - t_ended,
        "rejoin_allocated": last_after(rows, "allocated", t_ended),
        "rejoin_imported": last_after(rows, "imported", t_ended), "rejoin_manager": last_after(rows, "manager", t_ended),
        "rejoin_healed": max(r["t"] for r in healed) - t_ended if healed else float("nan"),
        "heal_load": max((r["load_s"] for r in healed), default=float("nan")),
        "restarts_in_place": sum(1 for r in rows if r["event"] == "start" and r["restart"] > 0),
        "bitwise": len(set(ends.values())) == 1 and len(ends) == PARTS,
        "array": array, "lighthouse_rss_mb": lighthouse_cost[0], "lighthouse_cpu_s": lighthouse_cost[1],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--state-mb", type=int, default=256)
    p.add_argument("--hold", type=float, default=10.0, help="seconds the HIGH job holds its 2 nodes")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=1, help="torch's threads in each part (OMP_NUM_THREADS): the "
                   "local cluster's nodes share the host's cores, and torch's OpenMP threads, more of them than "
                   "cores, spin (zeroing 1 GiB took 2.2 s of CPU with 2 threads a part on 2 cores, 0.5 s with 1)")
    args = p.parse_args(argv)
    if not (cb.BIN / "torchft_lighthouse").exists():
        raise SystemExit("elastic_parts_bench: torchft is not installed: pip install 'slurm-hai[elastic]'")
    shutil.rmtree(cb.WORK, ignore_errors=True)
    cb.WORK.mkdir(mode=0o755, parents=True)  # the daemon's lock is in it: only root writes there
    daemon = cb.start_daemon()
    try:
        results = []
        for n in range(args.repeats):  # alternating: the parts, then the fixed job
            results.append(one_round(args, n))
            results[-1]["high_start_fixed"] = fixed_round(n)
    finally:
        cb.stop_daemon(daemon)
    for r in results:
        print(json.dumps(r))
    keys = ("median_step", "longest_around", "lost", "to_quorum_of_survivors", "high_start", "rejoin_task_started",
            "rejoin_process_started", "rejoin_imported", "rejoin_allocated", "rejoin_manager", "rejoin_healed", "rejoin", "heal_load")
    med = {k: statistics.median(r[k] for r in results) for k in keys}
    fixed = statistics.median(r["high_start_fixed"] for r in results)
    print(f"\nparts=4, HIGH takes 2 nodes for {args.hold:g} s, {args.state_mb} MiB of state a part, "
          f"medians of {args.repeats}")
    print("| measure | seconds |\n|---|---:|")
    for k in keys:
        print(f"| {k.replace('_', ' ')} | {med[k]:.2f} |")
    print("\n| against the baseline of the same run | parts | baseline | parts / baseline |\n|---|---:|---:|---:|")
    print(f"| HIGH submitted -> HIGH running, against a fixed 4-node job | {med['high_start']:.2f} | {fixed:.2f} "
          f"| {med['high_start'] / fixed:.2f}x |")
    print(f"| the survivors' longest step around the leave, against their median step | {med['longest_around']:.2f} "
          f"| {med['median_step']:.2f} | {med['longest_around'] / med['median_step']:.2f}x |")
    print(f"every part bitwise equal at the end {sum(r['bitwise'] for r in results)}/{len(results)}")
    print(f"\nthe lighthouse, one job of 4 parts, at the end of a round: "
          f"{statistics.median(r['lighthouse_rss_mb'] for r in results):.1f} MiB resident, "
          f"{statistics.median(r['lighthouse_cpu_s'] for r in results):.2f} s of CPU (medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
