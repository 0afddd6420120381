"""What the persist agents' sweeps cost slurmctld: 1,000 agents, simulated, on a live queue.

    source $HAI_CLUSTER_DIR/etc/env
    .venv/bin/python benchmarks/agent_sweep_bench.py --agents 1000 --jobs 10000

A site runs a persist agent on every node (`hai-admin persist-agent`). Each sweep, an agent
asks Slurm whether the jobs it holds node memory for have ended (`cli/admin.py`
`_jobs_over`: squeue of one job id, one small RPC, per job it holds). Here one process plays
--agents agents, each holding the memory of one job of the queue (the queue is policy_bench's
held jobs, filled up to --jobs), --parallel sweeps at a time, as agents whose sweeps fall
together would. Measured, for the whole sweep of all agents: the wall time, and slurmctld's
job-info RPCs (count and seconds, from `sdiag`), against the same sweep done the way it was
before (`squeue --json --states=all --jobs=ID`, timed on --sample agents and scaled to all).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from policy_bench import BENCH_NAME, fill_queue, job_info_rpcs  # noqa: E402


def sweep(ask, job_ids: list[int], parallel: int) -> tuple[float, int, float]:
    """(wall seconds, job-info RPCs, slurmctld seconds in them) of asking about each job."""
    n0, s0 = job_info_rpcs()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(ask, job_ids))
    wall = time.perf_counter() - t0
    n1, s1 = job_info_rpcs()
    return wall, n1 - n0, s1 - s0


def json_way(job_id: int) -> None:
    subprocess.run(["squeue", "--json", "--states=all", f"--jobs={job_id}"], capture_output=True, check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--jobs", type=int, default=10000, help="held bench jobs in the queue")
    ap.add_argument("--parallel", type=int, default=16, help="agents sweeping at the same moment")
    ap.add_argument("--sample", type=int, default=20, help="agents timed the JSON way (it is slow)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--account", default="hai")
    ap.add_argument("--policy", default=str(REPO / "contrib" / "localcluster" / "policy.toml"))
    args = ap.parse_args()
    if "SLURM_CONF" not in os.environ:
        print("agent_sweep_bench: set SLURM_CONF (source $HAI_CLUSTER_DIR/etc/env)", file=sys.stderr)
        return 2
    from slurm_hai.cli.admin import _jobs_over
    from slurm_hai.policy.model import load_policy

    added = fill_queue(args.jobs, load_policy(args.policy), args.account)
    if added:
        print(f"({added} held jobs submitted)", flush=True)
    ids = sorted(int(j) for j in subprocess.run(["squeue", "-h", f"--name={BENCH_NAME}", "-o", "%i"],
                                                 capture_output=True, text=True, check=True).stdout.split())
    in_ctld = len(subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split())
    held = [ids[i * len(ids) // args.agents] for i in range(args.agents)]  # one job per agent
    release = subprocess.run(["scontrol", "--version"], capture_output=True, text=True).stdout.split()[-1]
    print(f"{args.agents} agents, one job each, {args.parallel} at a time; {in_ctld} jobs in slurmctld, "
          f"Slurm {release}, {os.cpu_count()} CPUs; median of {args.repeats}")
    now = [sweep(lambda j: _jobs_over([j]), held, args.parallel) for _ in range(args.repeats)]
    sample = held[:: max(1, len(held) // args.sample)][:args.sample]
    scale = len(held) / len(sample)
    before = [sweep(json_way, sample, args.parallel) for _ in range(args.repeats)]
    rows = {"squeue of one job (text), per job held: now": now,
            f"squeue --json --jobs=ID, per job held: before (x{scale:.0f} from {len(sample)} agents)":
                [(w * scale, round(n * scale), s * scale) for w, n, s in before]}
    print("\n| one sweep of every agent | wall | job-info RPCs | slurmctld time in them | vs now |")
    print("|---|---:|---:|---:|---:|")
    base = statistics.median(s for _, _, s in now)
    for name, runs in rows.items():
        wall, rpcs, ctld = (statistics.median(r[i] for r in runs) for i in range(3))
        print(f"| {name} | {wall:.1f} s | {rpcs:.0f} | {ctld:.2f} s | {ctld / base:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
