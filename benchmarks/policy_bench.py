"""Policy daemon benchmark: one decision cycle over a large synthetic queue.

    .venv/bin/python benchmarks/policy_bench.py --jobs 1000 10000 50000 --repeats 5

The queue is synthetic squeue text in the fields the CLI backend asks for
(`records.QUEUE_FORMAT`), made from full `squeue --json` records (Slurm 22.05, OpenAPI
v0.0.38), with a realistic mix of running and pending jobs over every level, requeued jobs
out of submission order, AUTO jobs, demoted jobs, quota waits and held jobs. A cycle is
what the daemon does between squeue returning and the first scontrol call: read the text
into JobInfo records, decide.
Rows are medians over --repeats; the target is <= 1 s per cycle at 10,000 jobs.

--explain: `hai-admin explain` over every pending and running job of the same queue: one
Explainer against explain() per job.

--live: the same cycle on a live cluster, with each backend (the CLI backend is the
baseline). Needs SLURM_CONF (and PATH) of the cluster, and pyslurm for the pyslurm backend:

    source $HAI_CLUSTER_DIR/etc/env
    $PYSLURM_VENV/bin/python benchmarks/policy_bench.py --live --jobs 10000 50000 --repeats 3

It fills the queue up to each size with held batch jobs (priority 0, so nothing runs), spread
over every level's QOS with `hai-level=` admin comments, submitted through pyslurm (about
2 ms a job; where pyslurm is not installed, `sbatch --hold`, a process each: `fill_queue`,
which benchmarks/list_bench.py uses too). A cycle is `PolicyDaemon(backend, policy,
dry_run=True).cycle()`: the backend's `jobs()` (squeue's text of the fields slurm-hai reads,
or pyslurm.Jobs.load), `decide`, and the actions logged, not done; `jobs()` and `decide` are
also timed on their own, and slurmctld's time in job-info RPCs per cycle (sdiag) beside them. `--cleanup` cancels what it submitted at the end.

Slurm's default MaxJobCount is 10000 (slurmctld refuses more jobs): for the measured table
in docs/results-archive.md, MaxJobCount was raised by hand in the bench cluster's own rendered
slurm.conf (/var/lib/slurm-hai/lc-pyslurm/etc/slurm.conf, MaxJobCount=60000) and its
slurmctld restarted; `contrib/localcluster/up` renders the default again.
"""

from __future__ import annotations

import argparse
import copy
import platform
import random
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout too

from slurm_hai.policy.model import load_policy  # noqa: E402
from slurm_hai.policy.levels import level_base  # noqa: E402
from slurm_hai.policy.explain import Explainer, explain  # noqa: E402
from slurm_hai.policy.rules import decide  # noqa: E402
from slurm_hai.slurm.records import QUEUE_FORMAT, jobs_from_json, jobs_from_text  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NOW = 1_800_000_000

# One record as squeue --json prints it on the local 22.05 cluster (fields trimmed of nothing).
TEMPLATE = {
    "account": "hai", "accrue_time": 0, "admin_comment": "", "array_job_id": 0, "array_task_id": None,
    "array_max_tasks": 0, "array_task_string": "", "association_id": 4, "batch_features": "", "batch_flag": True,
    "batch_host": "", "flags": ["JOB_ACCRUE_OVER"], "burst_buffer": "", "burst_buffer_state": "", "cluster": "hai",
    "cluster_features": "", "command": "/home/u/train.sh", "comment": "hai-dir=/home/u/.hai/jobs", "container": "",
    "contiguous": False, "core_spec": None, "thread_spec": None, "cores_per_socket": None, "billable_tres": 2.0,
    "cpus_per_task": None, "cpu_frequency_minimum": None, "cpu_frequency_maximum": None,
    "cpu_frequency_governor": None, "cpus_per_tres": "", "deadline": 0, "delay_boot": 0, "dependency": "",
    "derived_exit_code": 0, "eligible_time": 0, "end_time": 0, "excluded_nodes": "", "exit_code": 0,
    "features": "", "federation_origin": "", "federation_siblings_active": "", "federation_siblings_viable": "",
    "gres_detail": [], "group_id": 1000, "group_name": "u", "job_id": 0,
    "job_resources": {"nodes": "", "allocated_cores": 1, "allocated_hosts": 1, "allocated_nodes": [
        {"sockets": {"0": {"cores": {"0": "allocated"}}, "1": {"cores": {"0": "allocated"}}}, "nodename": "n1",
         "cpus_used": 0, "memory_used": 0, "memory_allocated": 0}]},
    "job_state": "PENDING", "last_sched_evaluation": 0, "licenses": "", "max_cpus": 0, "max_nodes": 0,
    "mcs_label": "", "memory_per_tres": "", "name": "train", "nodes": "", "nice": None, "tasks_per_core": None,
    "tasks_per_node": 0, "tasks_per_socket": None, "tasks_per_board": 0, "cpus": 2, "node_count": 1, "tasks": 1,
    "het_job_id": 0, "het_job_id_set": "", "het_job_offset": 0, "partition": "gpu", "prefer": "",
    "memory_per_node": None, "memory_per_cpu": None, "minimum_cpus_per_node": 1, "minimum_tmp_disk_per_node": 0,
    "preempt_time": 0, "pre_sus_time": 0, "priority": 0, "profile": None, "qos": "normal", "reboot": False,
    "required_nodes": "", "requeue": True, "resize_time": 0, "restart_cnt": 0, "resv_name": "", "shared": "none",
    "show_flags": ["SHOW_ALL", "SHOW_DETAIL", "SHOW_LOCAL"], "sockets_per_board": 0, "sockets_per_node": None,
    "start_time": 0, "state_description": "", "state_reason": "Priority", "standard_error": "",
    "standard_input": "/dev/null", "standard_output": "/home/u/batch-%j.log", "submit_time": 0, "suspend_time": 0,
    "system_comment": "", "time_limit": None, "time_minimum": 0, "threads_per_core": None, "tres_bind": "",
    "tres_freq": "", "tres_per_job": "", "tres_per_node": "gres:gpu:8", "tres_per_socket": "", "tres_per_task": "",
    "tres_req_str": "cpu=1,mem=1000M,node=1,billing=1", "tres_alloc_str": "", "user_id": 1000, "user_name": "u",
    "wckey": "", "current_working_directory": "/home/u",
}


def synthetic_queue(n: int, policy, seed: int = 1) -> str:
    rnd = random.Random(seed)
    levels = list(policy.ladder)
    users = [f"user{i:03d}" for i in range(200)] + ["hai-bob"]
    demote_after = policy.demotion.after_seconds if policy.demotion else 1800
    jobs = []
    for i in range(n):
        rec = copy.deepcopy(TEMPLATE)
        jid = 100_000 + i
        lvl = rnd.choice(levels)
        user = rnd.choice(users)
        auto = rnd.random() < 0.05
        rec.update(job_id=jid, user_name=user, qos=lvl.qos, node_count=rnd.choice([1, 1, 2, 4, 8]),
                   admin_comment=f"hai-level={'AUTO' if auto else lvl.name}",
                   submit_time=NOW - 86_400 + i, eligible_time=NOW - 86_400 + i, priority=level_base(lvl))
        r = rnd.random()
        if r < 0.3:  # running; some above-normal ones past their demotion time
            rec.update(job_state="RUNNING", state_reason="None", start_time=NOW - rnd.randint(10, 2 * demote_after),
                       nodes="n[1-2]", batch_host="n1")
            if rnd.random() < 0.01:
                rec["preempt_time"] = NOW - rnd.randint(0, 20)
        else:
            reason = rnd.choices(["Priority", "Resources", "QOSMaxNodePerUserLimit", "BeginTime", "JobHeldUser",
                                  "Dependency"], [60, 10, 15, 5, 5, 5])[0]
            rec["state_reason"] = reason
            if rnd.random() < 0.1:  # requeued: submit time reset, place to be restored
                rec.update(restart_cnt=rnd.randint(1, 4), submit_time=NOW - rnd.randint(1, 60))
                rec["eligible_time"] = rec["submit_time"] + 5
            if reason == "JobHeldUser":
                rec["priority"] = 0
        jobs.append(rec)
    doc = {"meta": {"plugin": {"type": "openapi/v0.0.38"}}, "errors": [], "jobs": jobs}
    return as_squeue_text(jobs_from_json(doc)[0])


SEP = "~sep~"  # the backend makes one at random per call


def as_squeue_text(jobs) -> str:
    """What squeue prints of the QUEUE_FORMAT fields of these jobs."""
    def cell(name: str, value) -> str:
        if name == "exit_code":
            return "" if value is None else f"0:{value - 128}" if value > 128 else f"{value}:0"
        if name.endswith("_time"):
            return str(value) if value else "N/A"
        return str(value)
    return "".join("".join(cell(name, getattr(j, name)) + SEP for name, _, _ in QUEUE_FORMAT) + "\n" for j in jobs)


def cycle(text: str, policy) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    jobs, _ = jobs_from_text(text, SEP)
    t1 = time.perf_counter()
    actions = decide(jobs, policy, NOW, idle_nodes={"gpu": 0})
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, len(actions)


def explain_all(text: str, policy, sample: int = 20) -> tuple[float, float, int]:
    """`hai-admin explain` (and `hai list --all`) over every live job: one Explainer (one
    snapshot, each group's line sorted once) against explain() per job (the baseline: a
    snapshot and a scan of the queue for each; timed on `sample` jobs, times the job count)."""
    jobs = [j for j in jobs_from_text(text, SEP)[0] if j.state in ("PENDING", "RUNNING")]
    t0 = time.perf_counter()
    why = Explainer(jobs, policy, NOW)
    words = [why(j) for j in jobs]
    t1 = time.perf_counter()
    step = max(1, len(jobs) // sample)
    picked = jobs[::step][:sample]
    assert [explain(j, jobs, policy, NOW) for j in picked] == [words[jobs.index(j)] for j in picked]
    t2 = time.perf_counter()
    return t1 - t0, (t2 - t1) / len(picked) * len(jobs), len(jobs)


# ------------------------------------------------------------------ --live


BENCH_NAME = "hai-bench"


def fill_queue(n: int, policy, account: str, user: str | None = None) -> int:
    """Submit held jobs until the cluster has `n` of ours; returns how many it submitted.
    Through pyslurm where it is installed; else, or for another `user` (root submits as them),
    with `sbatch --hold`, a process each (Slurm 22.05 has no pyslurm)."""
    try:
        import pyslurm
    except ImportError:
        pyslurm = None
    if pyslurm is None or user:
        return _fill_with_sbatch(n, policy, account, user)
    have = sum(1 for j in pyslurm.Jobs.load().values() if j.name == BENCH_NAME)
    levels = list(policy.ladder)
    rnd = random.Random(n)
    for i in range(have, n):
        lvl = rnd.choice(levels)
        desc = pyslurm.JobSubmitDescription(
            name=BENCH_NAME, script="#!/bin/sh\ntrue\n", priority=0, qos=lvl.qos, account=account,
            nodes=1, standard_output="/dev/null", working_directory="/tmp",
            comment=f"hai-dir=/tmp/bench/{i}", admin_comment=f"hai-level={lvl.name}", environment="HAI_BENCH=1")
        desc.submit()
        if (i + 1) % 5000 == 0:
            print(f"  ... {i + 1} jobs in the queue", flush=True)
    return max(0, n - have)


def _fill_with_sbatch(n: int, policy, account: str, user: str | None) -> int:
    """fill_queue with sbatch: the same held jobs, 4 submissions at a time; job_submit.lua
    stamps the level into the admin comment (users cannot set it)."""
    import getpass
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    user = user or getpass.getuser()
    mine = subprocess.run(["squeue", "-h", f"--name={BENCH_NAME}", f"--user={user}", "-o", "%i"],
                          capture_output=True, text=True, check=True).stdout.split()
    rnd = random.Random(n)
    levels = [rnd.choice(list(policy.ladder)) for _ in range(n)]

    def submit(i: int) -> None:
        subprocess.run(["sbatch", "--parsable", "--hold", f"--job-name={BENCH_NAME}", f"--qos={levels[i].qos}",
                        f"--account={account}", f"--uid={user}", "--nodes=1", "--output=/dev/null", "--chdir=/tmp",
                        f"--comment=hai-dir=/tmp/bench/{i}", "--export=NONE,HAI_BENCH=1", "--wrap=true"],
                       capture_output=True, text=True, check=True)
        if (i + 1) % 1000 == 0:
            print(f"  ... {i + 1} jobs of {user} in the queue", flush=True)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(submit, range(len(mine), n)))
    return max(0, n - len(mine))


JOB_INFO_RPC = re.compile(r"(REQUEST_JOB_INFO|REQUEST_JOB_INFO_SINGLE|REQUEST_JOB_USER_INFO)\s+\(\s*\d+\)\s+"
                          r"count:(\d+)\s+ave_time:\d+\s+total_time:(\d+)")


def job_info_rpcs() -> tuple[int, float]:
    """How many job-info RPCs slurmctld has answered, and the seconds it spent on them (sdiag)."""
    import subprocess

    out = subprocess.run(["sdiag"], capture_output=True, text=True, check=True).stdout
    found = [(int(m.group(2)), int(m.group(3))) for m in JOB_INFO_RPC.finditer(out)]
    return sum(c for c, _ in found), sum(t for _, t in found) / 1e6


def time_live(backend, policy, repeats: int) -> tuple[float, float, float, int, int, float]:
    """Medians of jobs(), decide and a whole dry-run cycle; the job count, the action count,
    and slurmctld's seconds of job-info RPCs per cycle (sdiag, over the cycles alone)."""
    from slurm_hai.controller.daemon import PolicyDaemon

    daemon = PolicyDaemon(backend, policy=policy, dry_run=True)
    read, dec, cyc, rpc_seconds = [], [], [], 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        jobs = backend.jobs()
        t1 = time.perf_counter()
        actions = decide(jobs, policy, time.time(), idle_nodes=backend.idle_nodes)
        t2 = time.perf_counter()
        before = job_info_rpcs()[1]
        result = daemon.cycle()
        rpc_seconds += job_info_rpcs()[1] - before
        read.append(t1 - t0)
        dec.append(t2 - t1)
        cyc.append(result.seconds)
    return (statistics.median(read), statistics.median(dec), statistics.median(cyc), len(jobs), len(actions),
            rpc_seconds / repeats)


def live(args, policy) -> int:
    import logging
    import os

    from slurm_hai.slurm.cli import CliBackend

    logging.getLogger("hai-policyd").setLevel(logging.WARNING)  # dry-run "would:" lines are not the point
    if "SLURM_CONF" not in os.environ:
        print("policy_bench --live: set SLURM_CONF (source $HAI_CLUSTER_DIR/etc/env)", file=sys.stderr)
        return 2
    # the daemon's commands backend remembers the last read's records ("cli"); "cli-new" reads
    # every record anew, as its first cycle does (and every cycle did before)
    backends = {"cli-new": CliBackend, "cli": lambda: CliBackend(remember_queue=True)}
    if "pyslurm" in args.backends:
        from slurm_hai.slurm.pyslurm_backend import PyslurmBackend, why_not

        if why_not():
            print(f"policy_bench --live: {why_not()}", file=sys.stderr)
            return 2
        backends["pyslurm"] = PyslurmBackend
    backends = {k: v for k, v in backends.items() if k.split("-")[0] in args.backends}
    limit = int(CliBackend().config().get("MaxJobCount", "10000"))
    release = CliBackend().version()
    print(f"policy daemon cycle on a live Slurm {release} cluster (MaxJobCount {limit}), median of "
          f"{args.repeats}; Python {platform.python_version()}, {os.cpu_count()} CPUs")
    header = (f"{'jobs':>7}  {'backend':>8}  {'jobs()':>8}  {'decide':>8}  {'cycle':>8}  {'vs cli':>7}  {'actions':>7}"
              f"  {'ctld RPC/cycle':>14}")
    print(header)
    print("-" * len(header))
    for n in args.jobs:
        if n > limit - 50:
            print(f"{n:>7}  skipped: MaxJobCount is {limit} (raise it in slurm.conf, restart slurmctld)")
            continue
        t0 = time.perf_counter()
        added = fill_queue(n, policy, args.account)
        if added:
            print(f"  ({added} jobs submitted in {time.perf_counter() - t0:.0f} s)", flush=True)
        base = None
        for name, cls in backends.items():
            read, dec, cyc, count, actions, rpc = time_live(cls(), policy, args.repeats)
            base = base or cyc
            print(f"{count:>7}  {name:>8}  {read * 1e3:>6.0f}ms  {dec * 1e3:>6.0f}ms  {cyc * 1e3:>6.0f}ms  "
                  f"{cyc / base:>6.2f}x  {actions:>7}  {rpc * 1e3:>12.0f}ms", flush=True)
    if args.cleanup:
        import subprocess

        subprocess.run(["scancel", f"--name={BENCH_NAME}"], check=False)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, nargs="+", default=[1000, 10000, 50000])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--policy", default=str(REPO / "contrib" / "localcluster" / "policy.toml"))
    ap.add_argument("--live", action="store_true", help="time each backend on the live cluster of SLURM_CONF")
    ap.add_argument("--explain", action="store_true", help="time explaining every live job (hai-admin explain)")
    ap.add_argument("--backends", nargs="+", default=["cli", "pyslurm"], choices=["cli", "pyslurm"])
    ap.add_argument("--account", default="hai", help="--live: the account the held jobs are submitted under")
    ap.add_argument("--cleanup", action="store_true", help="--live: cancel the submitted jobs at the end")
    args = ap.parse_args()
    policy = load_policy(args.policy)
    if args.live:
        return live(args, policy)
    if args.explain:
        print(f"explain every pending and running job, median of {args.repeats} runs (baseline: explain() per job)")
        print(f"{'jobs':>7}  {'explained':>9}  {'Explainer':>10}  {'per job':>10}  {'ratio':>7}")
        for n in args.jobs:
            text = synthetic_queue(n, policy)
            runs = [explain_all(text, policy) for _ in range(args.repeats)]
            new, old = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
            print(f"{n:>7}  {runs[0][2]:>9}  {new:>9.2f}s  {old:>9.2f}s  {old / new:>6.0f}x")
        return 0
    print(f"policy daemon cycle, median of {args.repeats} runs; Python {platform.python_version()}, "
          f"{platform.machine()}, policy {Path(args.policy).name}")
    header = f"{'jobs':>7}  {'text MB':>7}  {'JobInfo':>8}  {'decide':>8}  {'cycle':>8}  {'actions':>7}  target"
    print(header)
    print("-" * len(header))
    worst = 0.0
    for n in args.jobs:
        text = synthetic_queue(n, policy)
        runs = [cycle(text, policy) for _ in range(args.repeats)]
        read, dec = (statistics.median(r[i] for r in runs) for i in range(2))
        total = statistics.median(sum(r[:2]) for r in runs)
        target = "<= 1 s" if n == 10000 else ""
        ok = " ok" if n == 10000 and total <= 1.0 else (" MISSED" if n == 10000 else "")
        if n == 10000:
            worst = total
        print(f"{n:>7}  {len(text) / 1e6:>7.1f}  {read * 1e3:>6.0f}ms  {dec * 1e3:>6.0f}ms  "
              f"{total * 1e3:>6.0f}ms  {runs[0][2]:>7}  {target}{ok}")
    return 0 if worst <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
