"""How fast a requeued job runs again, per way of asking, on the live local cluster.

A plain `sbatch --requeue` job (one node) notes when each run's script starts; the bench
requeues it with `scontrol requeue` and measures requeue request -> script running again,
in one run, medians of --repeats, for each way this Slurm offers, against an idle start
(sbatch -> script running) measured in the same run:

- slurm:        nothing more: Slurm holds a requeued job for cred_expire + 1 s (22.05) or
                requeue_delay + 1 s (25.11+, requeue_delay defaults to cred_expire), then
                waits for a scheduling pass;
- start-now:    what the policy daemon does: `scontrol update StartTime=uts<S+1>` as soon as
                the job pends, S being the second of its new submit time by slurmctld's clock
                (`policy.rules.start_now_at`; a relaunch in the requeue's own second is killed,
                "Job credential revoked");
- start-now +2 s: the daemon's rule before: `StartTime=now` 2 s after the requeue request;
- requeue_delay=0 (25.11+): slurmctld restarted with `SchedulerParameters=...,requeue_delay=0`
                (read once per slurmctld lifetime), Slurm's own hold is then 1 s;
- requeue_delay=0 + start-now.

Expedited requeue (25.11 `--requeue=expedite`) is not measured: it applies to a job
requeued for an epilog or node failure, and a job requeued otherwise is put on hold
(src/slurmctld/job_mgr.c, batch_requeue_fini: "holding expedited requeue ... as no
epilogs failed"), which is not what a suspend wants.

    .venv/bin/python benchmarks/requeue_bench.py [--repeats 5]

Uses $HAI_CLUSTER_DIR (default /var/lib/slurm-hai/localcluster), as root, cluster idle.
The slurm.conf of that cluster is changed for the rows (with and without requeue_delay;
slurmctld reads it once per lifetime, so it is restarted) and put back after.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "contrib" / "localcluster"))

import localcluster  # noqa: E402

from slurm_hai.policy.rules import start_now_at  # noqa: E402
from slurm_hai.slurm.version import SlurmVersion  # noqa: E402

OLD_SETTLE = 2.0  # the daemon's wait after a requeue before StartTime=now, before start_now_at


def sh(c: localcluster.Cluster, *argv: str, check: bool = True) -> str:
    return localcluster.run(list(argv), c, check=check).stdout


def job_state(c: localcluster.Cluster, job: int) -> str:
    m = re.search(r"JobState=(\S+)", sh(c, "scontrol", "show", "job", "-o", str(job), check=False))
    return m.group(1) if m else ""


def submit_time(c: localcluster.Cluster, job: int) -> float:
    p = subprocess.run(["squeue", "--noheader", "--jobs", str(job), "--format=%V"], text=True, capture_output=True,
                       env={**c.env(), "SLURM_TIME_FORMAT": "%s"}, check=True)
    return float(p.stdout)


class Requeued:
    """What the daemon's rule reads of a requeued job (policy.rules.start_now_at)."""

    def __init__(self, submit_time: float):
        self.submit_time = submit_time


def starts(out: Path) -> list[float]:
    try:
        return [float(line.split()[2]) for line in out.read_text().splitlines() if line.startswith("start ")]
    except OSError:
        return []


def wait(what: str, cond, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            sys.exit(f"requeue_bench: timed out waiting for {what}")
        time.sleep(0.05)


def measure(c: localcluster.Cluster, repeats: int, start_now: str, work: Path) -> list[float]:
    out = work / f"runs-{time.monotonic_ns()}.txt"
    script = f"#!/bin/bash\necho start ${{SLURM_RESTART_COUNT:-0}} $(date +%s.%N) >> {out}\nexec sleep 600\n"
    job = int(localcluster.run(["sbatch", "--parsable", "--requeue", "-N1", "--qos=low", "-o", "/dev/null",
                                f"--chdir={work}"], c, input=script).stdout.split(";")[0])
    wait("the first run", lambda: len(starts(out)) == 1)
    latencies = []
    try:
        for k in range(1, repeats + 1):
            time.sleep(1.5 + random.random())  # never in a run's first second; any phase of a second
            t0 = time.time()
            sh(c, "scontrol", "requeue", str(job))
            if start_now:
                wait("the job to pend", lambda: job_state(c, job) == "PENDING")
                if start_now == "old":
                    time.sleep(max(0.0, t0 + OLD_SETTLE - time.time()))
                    sh(c, "scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
                else:
                    at = start_now_at(Requeued(submit_time(c, job)))
                    sh(c, "scontrol", "update", f"JobId={job}", f"StartTime=uts{at}", check=False)
            wait(f"run {k}", lambda: len(starts(out)) > k)
            latencies.append(starts(out)[k] - t0)
    finally:
        sh(c, "scancel", str(job), check=False)
    wait("the job to end", lambda: job_state(c, job) in ("CANCELLED", "COMPLETED", ""), 60)
    return latencies


def idle_starts(c: localcluster.Cluster, repeats: int, work: Path) -> list[float]:
    """sbatch -> the script running, on the idle cluster: what a restart is held against."""
    latencies = []
    for _ in range(repeats):
        out = work / f"idle-{time.monotonic_ns()}.txt"
        script = f"#!/bin/bash\necho start 0 $(date +%s.%N) >> {out}\n"
        t0 = time.time()
        localcluster.run(["sbatch", "--parsable", "-N1", "--qos=low", "-o", "/dev/null", f"--chdir={work}"], c,
                         input=script)
        wait("the idle start", lambda: len(starts(out)) == 1)
        latencies.append(starts(out)[0] - t0)
        wait("idle nodes", lambda: localcluster.nodes_idle(c), 60)
    return latencies


def restart_slurmctld(c: localcluster.Cluster) -> None:
    ctld = localcluster.daemons(c)[3]
    localcluster.stop(ctld)
    localcluster.start(ctld, [c.tool("slurmctld"), "-f", str(c.slurm_conf)], c)
    wait("slurmctld", lambda: localcluster.run(["scontrol", "ping"], c, check=False).returncode == 0, 60)
    wait("idle nodes", lambda: localcluster.nodes_idle(c), 60)


def with_requeue_delay(text: str) -> str:
    return re.sub(r"^(SchedulerParameters=.*)$", r"\1,requeue_delay=0", text, count=1, flags=re.M)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    c = localcluster.cluster_from_env()
    version = SlurmVersion.parse(localcluster.run([c.tool("scontrol"), "--version"], c).stdout)
    work = c.state / "shared" / f"requeue-bench-{os.getpid()}"  # every node sees it (/tmp is each node's own)
    work.mkdir(mode=0o755)
    rows: list[tuple[str, list[float]]] = []
    t_start = time.monotonic()
    original = c.slurm_conf.read_text()
    plain = re.sub(r",requeue_delay=\d+", "", original)  # a site may have set it
    try:
        if plain != original:
            c.slurm_conf.write_text(plain)
            restart_slurmctld(c)
        idle = idle_starts(c, args.repeats, work)
        rows.append(("slurm", measure(c, args.repeats, "", work)))
        rows.append(("start-now: `StartTime=now` 2 s after the requeue (the daemon's rule before)",
                     measure(c, args.repeats, "old", work)))
        rows.append(("start-now: `StartTime=uts<submit second + 1>` at once (the daemon's rule)",
                     measure(c, args.repeats, "new", work)))
        if version.requeue_delay:
            c.slurm_conf.write_text(with_requeue_delay(plain))
            restart_slurmctld(c)
            rows.append(("requeue_delay=0", measure(c, args.repeats, "", work)))
            rows.append(("requeue_delay=0 + start-now", measure(c, args.repeats, "new", work)))
    finally:
        if c.slurm_conf.read_text() != original:
            c.slurm_conf.write_text(original)
            restart_slurmctld(c)
    base = statistics.median(rows[0][1])
    print(f"\nSlurm {version}, {args.repeats} requeues each, {time.monotonic() - t_start:.0f} s in all")
    idle_med = statistics.median(idle)
    print(f"idle start (sbatch -> script running): {idle_med:.2f} s [{min(idle):.2f}-{max(idle):.2f}]")
    print("| restart after `scontrol requeue` | median | range | vs slurm | x idle start |")
    print("|---|---|---|---|---|")
    for name, xs in rows:
        med = statistics.median(xs)
        print(f"| {name} | {med:.2f} s | {min(xs):.2f}-{max(xs):.2f} s | {base / med:.2f}x faster "
              f"| {med / idle_med:.2f}x |")


if __name__ == "__main__":
    main()
