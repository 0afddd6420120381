"""slurm-hai against stock Slurm on the live local cluster: preemption, restart, suspend.

Measured in one run, on the same cluster, medians of --repeats:

1. preemption latency: a HIGH job (plain sbatch, 1 node) is submitted while a LOW job
   holds all 4 nodes; from the HIGH submission to the HIGH job's script running.
   slurm-hai: the LOW job is a hai-submit job that cooperates (polls
   receive_suspend_command(), commits a small checkpoint, go_suspend()).
   stock: the LOW job is a plain `sbatch --requeue` job under PreemptMode=REQUEUE that
   does not cooperate (its step ignores SIGTERM and goes on working); Slurm ends it after
   the QOS GraceTime, on its own timer, then KillWait.
   Also shown: a stock job that simply dies of the SIGTERM (fast, but all work since its
   last checkpoint is lost).
2. restart latency: from the requeue request to the job's script running again, on an
   idle cluster. slurm-hai: `hai suspend` -> go_suspend(); stock: `scontrol requeue`.
3. suspend-to-requeue with 1 GiB of state: as 1, but rank 0 of the LOW job holds 1 GiB
   of tensors; from the HIGH submission to Slurm counting the LOW job's requeue.
   slurm-hai commits the 1 GiB checkpoint first (the time is printed); stock saves nothing.

slurm-hai runs with its policy daemon (`hai-admin daemon`, as deployed); the stock runs
without it (the daemon would also hurry the stock jobs).

    .venv/bin/python benchmarks/cluster_bench.py [--repeats 3] [--gib 1] [--markdown]

--latency (issue 19) measures instead, alternating baseline and --lever in one run: the idle
start of a 2-node HIGH hai-submit job, the same job while a cooperative LOW job holds all 4
nodes, and a restart (go_suspend -> the script running again), each cut into phases from the
job events and Slurm's log lines; --sched-cost N what a SchedulerParameters lever costs
slurmctld with N held jobs (sdiag); --soak (issue 18) the goodput of a 4-node LOW training
job while a 2-node HIGH job takes nodes for --hold s every --period s, against the same job
undisturbed in the same run, and what each preemption costs beyond the HIGH job's hold and
its own run (--with-elastic: the same job as an elastic 2:4 job too; --with-in-place: an elastic job
in place, hai-submit --in-place -n 2:4, against itself undisturbed); --first-step (issues 32, 57)
a 4-node job's first step that imports torch, at its start and after a restart, against the same
step in a plain `sbatch --requeue` job (`srun`, `scontrol requeue`). See docs/figures.md (current
figures) and docs/results-archive.md (every run).

    .venv/bin/python benchmarks/cluster_bench.py --latency --repeats 7 --lever before-19
    .venv/bin/python benchmarks/cluster_bench.py --latency --repeats 7 --lever conf=Epilog=/bin/true
    .venv/bin/python benchmarks/cluster_bench.py --sched-cost 3000 --lever sched=+defer_batch
    .venv/bin/python benchmarks/cluster_bench.py --first-step --repeats 5
    .venv/bin/python benchmarks/cluster_bench.py --soak --with-elastic --with-in-place --minutes 10 [--period 60 --hold 10]

Uses $HAI_CLUSTER_DIR (default /var/lib/slurm-hai/localcluster) or $SLURM_CONF; needs the
cluster idle, as root.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

STATE = Path(os.environ.get("HAI_CLUSTER_DIR", "/var/lib/slurm-hai/localcluster"))
BIN = Path(sys.executable).parent
ENV = dict(os.environ)
ENV.setdefault("SLURM_CONF", str(STATE / "etc" / "slurm.conf"))
ENV["PATH"] = f"{BIN}:{ENV.get('PATH', '/usr/bin:/bin')}"
WORK = STATE / "shared" / f"cluster-bench-{os.getpid()}"  # every node sees it (/tmp is each node's own)
ENV["HAI_HOME"] = str(WORK / "hai")

# The cooperative slurm-hai job: rank 0 may hold GIB of state; on the notice it commits a
# checkpoint of it and calls go_suspend(). Reruns only report that they started.
OURS = """
import os, sys, time
import slurm_hai as hai
run = hai.restart_count()
print(f"start run={run} t={time.time():.3f}", flush=True)
if run > 0:
    sys.exit(0)
import torch
from slurm_hai.checkpoint import CheckpointManager
gib = float(sys.argv[1])
rank = int(os.environ["RANK"])
state = {"w": torch.ones(max(1, int(gib * 2**30) // 4)) if rank == 0 else torch.zeros(1), "step": 0}
mgr = CheckpointManager(os.path.join(os.environ["HAI_JOB_DIR"], "ckpt")) if rank == 0 else None
print("ready", flush=True)
while True:
    if rank == 0 and hai.receive_suspend_command():
        t0 = time.monotonic()
        mgr.save(state["step"], state)
        print(f"committed {gib} GiB in {time.monotonic() - t0:.3f} s", flush=True)
        hai.go_suspend()
    state["step"] += 1
    time.sleep(0.01)
"""

# The stock job: same state, no slurm-hai; MODE "ignores" keeps working through SIGTERM,
# "dies" has Python's default SIGTERM behaviour.
STOCK = """
import os, signal, sys, time
mode, gib, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
if mode == "ignores":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
import torch
rank = int(os.environ.get("SLURM_NODEID", "0"))
state = torch.ones(max(1, int(gib * 2**30) // 4)) if rank == 0 else torch.zeros(1)
if rank == 0:
    open(out, "w").write("ready")
while True:
    time.sleep(0.01)
"""

STOCK_BATCH = """#!/bin/bash
echo "start run=${{SLURM_RESTART_COUNT:-0}} t=$(date +%s.%N)" >> {log}
[ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ] && exit 0
srun {python} {script} {mode} {gib} {ready}
"""


def run(argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run([str(a) for a in argv], env=kw.pop("env", ENV), text=True, capture_output=True, cwd=WORK, **kw)
    if check and p.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, argv))} failed: {(p.stderr or p.stdout).strip()}")
    return p


def wait_for(what: str, cond, timeout: float = 120, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(interval)


def restarts(job: int) -> int:
    out = run(["scontrol", "show", "job", "-o", str(job)], check=False).stdout
    for part in out.split():
        if part.startswith("Restarts="):
            return int(part.split("=")[1])
    return -1


def drain(jobs: list[int]) -> None:
    for job in jobs:
        run(["scancel", str(job)], check=False)
    wait_for("the cluster to drain", lambda: not run(["squeue", "-h", "-o", "%i"]).stdout.split()
             and not run(["sinfo", "-h", "-t", "alloc,mix,comp", "-o", "%N"]).stdout.split(), 120, 0.3)


def read_text(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def start_times(log: Path) -> dict[int, float]:
    out = {}
    for line in read_text(log).splitlines():
        if line.startswith("start run="):
            fields = dict(f.split("=") for f in line.split()[1:])
            out[int(fields["run"])] = float(fields["t"])
    return out


# ------------------------------------------------------------------ the LOW jobs


def submit_ours(gib: float, nodes: int) -> tuple[int, Path]:
    script = WORK / "ours.py"
    script.write_text(OURS)
    info = json.loads(run(["hai-submit", "--json", "-n", str(nodes), "-p", "LOW", "--gpus-per-node", "8",
                           "--name", "bench-ours", str(script), "--", str(gib)]).stdout)
    log = Path(info["job_dir"]) / "logs" / "rank-0.log"
    wait_for("the slurm-hai job to be ready", lambda: "ready" in read_text(log), 180)
    return int(info["job_id"]), log


def submit_stock(mode: str, gib: float, nodes: int, tag: str) -> tuple[int, Path]:
    script = WORK / "stock.py"
    script.write_text(STOCK)
    log, ready = WORK / f"stock-{tag}.log", WORK / f"stock-{tag}.ready"
    ready.unlink(missing_ok=True)
    batch = STOCK_BATCH.format(log=log, python=sys.executable, script=script, mode=mode, gib=gib, ready=ready)
    job = int(run(["sbatch", "--parsable", "-N", str(nodes), "--qos=low", "--gres=gpu:8", "--requeue",
                   "--open-mode=append", f"--output={WORK}/slurm-%j.out", "--job-name=bench-stock"],
                  input=batch).stdout.strip().split(";")[0])
    wait_for("the stock job to be ready", lambda: ready.exists(), 180)
    return job, log


def slurm_state(job: int) -> str:
    out = run(["scontrol", "show", "job", "-o", str(job)], check=False).stdout
    return next((p.split("=")[1] for p in out.split() if p.startswith("JobState=")), "")


def preempt(low: int, requeue_expected: bool = True) -> tuple[float, float | None]:
    """Submit the HIGH job; (seconds to the HIGH script running, to the LOW job's requeue;
    None when Slurm ended the LOW job instead of requeueing it)."""
    mark = WORK / f"high-{low}.start"
    before = restarts(low)
    t0 = time.time()
    high = int(run(["sbatch", "--parsable", "-N1", "--qos=high", "--gres=gpu:8", "--output=/dev/null",
                    "--job-name=bench-high", "--wrap", f"date +%s.%N > {mark}"]).stdout.strip().split(";")[0])
    requeued = None
    while not read_text(mark).strip():
        if requeued is None and restarts(low) > before:
            requeued = time.time()
        if time.time() - t0 > 180:
            raise SystemExit("the HIGH job did not start within 180 s")
        time.sleep(0.05)
    started = float(read_text(mark))
    if requeued is None and requeue_expected:
        requeued = wait_for("the LOW job's requeue", lambda: restarts(low) > before and time.time(), 60)
    if not requeue_expected:
        wait_for("the LOW job to end", lambda: slurm_state(low) in ("FAILED", "COMPLETED", "CANCELLED")
                 or restarts(low) > before, 60)
        r_dies_state.append(slurm_state(low) if restarts(low) == before else "requeued")
    drain([low, high])
    return started - t0, (requeued - t0) if requeued else None


r_dies_state: list[str] = []  # what Slurm did with a stock job that died of its notice


def restart_latency_ours() -> float:
    job, log = submit_ours(0, 1)
    run(["hai", "suspend", str(job)])
    job_dir = log.parent.parent
    wait_for("run 1", lambda: 1 in start_times(log), 120)
    asked = next(json.loads(line)["t"] for line in read_text(job_dir / "events.jsonl").splitlines()
                 if json.loads(line)["event"] == "go_suspend")
    drain([job])
    return start_times(log)[1] - asked


def restart_latency_stock() -> float:
    job, log = submit_stock("ignores", 0, 1, f"restart-{time.time_ns()}")
    t0 = time.time()
    run(["scontrol", "requeue", str(job)])
    wait_for("run 1", lambda: 1 in start_times(log), 120)
    drain([job])
    return start_times(log)[1] - t0


# ------------------------------------------------------------------ the daemon


def start_daemon(interval: float = 0.5) -> subprocess.Popen:
    log = open(WORK / "daemon.log", "a")
    started = read_text(WORK / "daemon.log").count("policy daemon started")
    proc = subprocess.Popen([str(BIN / "hai-admin"), "daemon", "--policy", str(STATE / "etc" / "policy.toml"),
                             "--interval", str(interval), "--lock", str(WORK / "policyd.lock")], env=ENV, stdout=log,
                            stderr=subprocess.STDOUT, cwd=WORK)
    wait_for("the policy daemon", lambda: read_text(WORK / "daemon.log").count("policy daemon started") > started, 20, 0.1)
    return proc


def stop_daemon(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


# ------------------------------------------------------------------ latency (issue 19)
#
# --latency: the 2-node HIGH hai-submit job (the same command every time), measured in one
# run, alternating: (a) its start on the idle cluster, (b) its start while a cooperative
# LOW job holds all 4 nodes, (c) the restart of a preempted job (requeue -> its script
# running again). Each preemption is cut into phases from the job events (events.jsonl) and
# Slurm's own log lines (slurmctld, slurmd; millisecond timestamps). --lever NAME=VALUE
# runs every repeat once as the baseline and once with the lever, alternating.

# It holds its nodes for argv[1] seconds (--soak), none in --latency.
HIGH_SCRIPT = "import sys, time\nprint('high running', flush=True)\ntime.sleep(float(sys.argv[1]))\n"
# The LOW job of (b) and the job of (c): cooperates like OURS, without torch (the checkpoint
# is a small JSON file written atomically), so that a repeat is short.
COOP = """
import json, os, sys, time
import slurm_hai as hai
run = hai.restart_count()
print(f"start run={run} t={time.time():.3f}", flush=True)
if run > 0:
    sys.exit(0)
rank = int(os.environ["RANK"])
print("ready", flush=True)
step = 0
while True:
    if rank == 0 and hai.receive_suspend_command():
        path = os.path.join(os.environ["HAI_JOB_DIR"], "ckpt.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"step": step}, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(path + ".tmp", path)
        hai.go_suspend()
    step += 1
    time.sleep(0.01)
"""

LOG_TIME = "%Y-%m-%dT%H:%M:%S"


def nan_median(values) -> float:
    """The median of the values that were measured (a mark not found is NaN)."""
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def events(job_dir: Path) -> list[dict]:
    out = []
    for line in read_text(job_dir / "events.jsonl").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def event_time(job_dir: Path, name: str, **match) -> float | None:
    return next((e["t"] for e in events(job_dir) if e.get("event") == name
                 and all(e.get(k) == v for k, v in match.items())), None)


class SlurmLogs:
    """Slurm's own timestamps: the lines slurmctld and slurmd write from a mark on."""

    def __init__(self) -> None:
        self.files = [STATE / "log" / "slurmctld.log", *sorted((STATE / "log").glob("slurmd-n*.log"))]
        self.offsets: dict[Path, int] = {}

    def mark(self) -> None:
        self.offsets = {f: f.stat().st_size if f.exists() else 0 for f in self.files}

    def lines(self) -> list[tuple[float, str, str]]:
        """(epoch, file stem, text) of every line written since mark()."""
        out = []
        for f in self.files:
            with open(f, errors="replace") as fh:
                fh.seek(self.offsets.get(f, 0))
                for line in fh:
                    if line.startswith("[") and "]" in line:
                        stamp, _, text = line[1:].partition("] ")
                        try:
                            base, _, ms = stamp.partition(".")
                            t = time.mktime(time.strptime(base, LOG_TIME)) + float(f"0.{ms or 0}")
                        except ValueError:
                            continue
                        out.append((t, f.stem, text.strip()))
        return sorted(out)

    def first(self, lines, *needles: str, after: float = 0.0, source: str = "slurmctld") -> float | None:
        return next((t for t, src, text in lines if t >= after and src.startswith(source)
                     and all(n in text for n in needles)), None)

    def last(self, lines, *needles: str, after: float = 0.0, source: str = "slurmd") -> float | None:
        hits = [t for t, src, text in lines if t >= after and src.startswith(source) and all(n in text for n in needles)]
        return max(hits) if hits else None


LOGS = SlurmLogs()


def submit_high(nodes: int = 2, hold: float = 0.0) -> tuple[float, int, Path]:
    script = WORK / "high.py"
    script.write_text(HIGH_SCRIPT)
    t0 = time.time()
    info = json.loads(run(["hai-submit", "--json", "-n", str(nodes), "-p", "HIGH", "--gpus-per-node", "8",
                           "--name", "bench-high", str(script), "--", str(hold)]).stdout)
    return t0, int(info["job_id"]), Path(info["job_dir"])


def submit_coop(nodes: int | str, level: str, script_text: str = COOP, args: tuple = (),
                name: str = "bench-coop") -> tuple[int, Path]:
    """A cooperative hai-submit job, once its rank 0 printed "ready"."""
    script = WORK / f"{name}.py"
    script.write_text(script_text)
    info = json.loads(run(["hai-submit", "--json", "-n", str(nodes), "-p", level, "--gpus-per-node", "8",
                           "--name", name, str(script), "--", *map(str, args)]).stdout)
    job_dir = Path(info["job_dir"])
    wait_for("the cooperative job to be ready", lambda: "ready" in read_text(job_dir / "logs" / "rank-0.log"), 180)
    return int(info["job_id"]), job_dir


def idle_start() -> tuple[float, dict[str, float]]:
    LOGS.mark()
    t0, high, hdir = submit_high()
    t = wait_for("the HIGH job's script", lambda: event_time(hdir, "start", run=0), 120, 0.02)
    lines = LOGS.lines()
    marks = {
        "submitted": LOGS.first(lines, "_slurm_rpc_submit_batch_job:", f"JobId={high} "),
        "HIGH allocated": LOGS.first(lines, f"JobId={high} ", "Allocate") or LOGS.first(lines, f"JobId={high} ",
                                                                                            "Started"),
        "HIGH script running": t,
    }
    drain([high])
    return t - t0, {k: (v - t0 if v else float("nan")) for k, v in marks.items()}


# requeued: slurmd's first "CANCELLED ... DUE TO JOB REQUEUE" line (Slurm acts on the
# requeue); nodes released: slurmctld's "Requeuing JobId" (batch_requeue_fini: the last
# epilog is complete, the nodes are free in slurmctld's books).
PHASES = ("submitted", "notice", "checkpoint committed (go_suspend)", "requeued", "nodes released",
          "HIGH allocated", "HIGH script running")
IDLE_PHASES = ("submitted", "HIGH allocated", "HIGH script running")
RESTART_PHASES = ("requeued", "nodes released", "start-now (daemon)", "allocated", "script running")


def preemption() -> tuple[float, dict[str, float]]:
    """HIGH while a cooperative LOW job holds all 4 nodes: (total, phase -> seconds from t0)."""
    low, ldir = submit_coop(4, "LOW")
    LOGS.mark()
    t0, high, hdir = submit_high()
    t_run = wait_for("the HIGH job's script", lambda: event_time(hdir, "start", run=0), 120, 0.02)
    time.sleep(0.3)  # slurmd's "done with job" lines of the LOW job
    lines = LOGS.lines()
    marks = {
        "submitted": LOGS.first(lines, "_slurm_rpc_submit_batch_job:", f"JobId={high} "),
        "notice": event_time(ldir, "notice", run=0),
        "checkpoint committed (go_suspend)": event_time(ldir, "go_suspend", run=0),
        "requeued": LOGS.first(lines, f"JOB {low} ", "DUE TO JOB REQUEUE", source="slurmd"),
        "nodes released": LOGS.first(lines, f"Requeuing JobId={low}"),
        "HIGH allocated": LOGS.first(lines, f"JobId={high} ", "Allocate") or LOGS.first(lines, f"JobId={high} ",
                                                                                            "Started"),
        "HIGH script running": t_run,
    }
    (WORK / "preempt-lines.log").open("a").write(
        f"--- low {low} high {high} t0 {t0:.3f}\n" + "".join(f"{t:.3f} {s} {x}\n" for t, s, x in lines
                                                              if str(low) in x or str(high) in x))
    drain([low, high])
    return t_run - t0, {k: (v - t0 if v else float("nan")) for k, v in marks.items()}


def restart() -> tuple[float, dict[str, float]]:
    """A 2-node HIGH job suspended (`hai suspend` -> go_suspend -> requeue) on the idle
    cluster: requeue request (go_suspend) -> its script running again."""
    job, jdir = submit_coop(2, "HIGH")
    LOGS.mark()
    run(["hai", "suspend", str(job)])
    t_run = wait_for("run 1", lambda: event_time(jdir, "start", run=1), 120, 0.02)
    asked = event_time(jdir, "go_suspend", run=0)
    lines = LOGS.lines()
    marks = {
        "requeued": LOGS.first(lines, f"JOB {job} ", "DUE TO JOB REQUEUE", source="slurmd"),
        "nodes released": LOGS.first(lines, f"Requeuing JobId={job}"),
        "start-now (daemon)": LOGS.first(lines, f"JobId={job}", "StartTime") or LOGS.first(
            lines, "update_job", f"JobId={job}"),
        "allocated": LOGS.first(lines, f"JobId={job} ", "Allocate", after=asked) or LOGS.first(
            lines, f"JobId={job} ", "Started", after=asked),
        "script running": t_run,
    }
    (WORK / "restart-lines.log").open("a").write(
        f"--- job {job} asked {asked:.3f}\n" + "".join(f"{t:.3f} {s} {x}\n" for t, s, x in lines if str(job) in x))
    drain([job])
    return t_run - asked, {k: (v - asked if v else float("nan")) for k, v in marks.items()}


SCHED_LINE = "SchedulerParameters="


def slurm_conf() -> Path:
    return Path(ENV["SLURM_CONF"])


def set_sched(params: str) -> None:
    """Rewrite SchedulerParameters in the cluster's slurm.conf and reconfigure slurmctld."""
    conf = slurm_conf()
    lines = [f"{SCHED_LINE}{params}" if line.startswith(SCHED_LINE) else line for line in conf.read_text().splitlines()]
    conf.write_text("\n".join(lines) + "\n")
    run(["scontrol", "reconfigure"])
    wait_for("slurmctld to take the new SchedulerParameters", lambda: f"= {params}\n" in run(
        ["scontrol", "show", "config"]).stdout, 60, 0.3)
    time.sleep(1)


def current_sched() -> str:
    return next(line[len(SCHED_LINE):] for line in slurm_conf().read_text().splitlines() if line.startswith(SCHED_LINE))


def set_conf(key: str, value: str | None) -> None:
    """Set (or with None remove) one slurm.conf line KEY=VALUE and reconfigure."""
    conf = slurm_conf()
    old = conf.read_text().splitlines()
    at = next((i for i, line in enumerate(old) if line.startswith(f"{key}=")), None)
    lines = [line for line in old if not line.startswith(f"{key}=")]
    if value is not None:  # in the line's old place, else before SchedulerType
        at = at if at is not None else next((i for i, x in enumerate(lines) if x.startswith("SchedulerType=")),
                                            len(lines))
        lines.insert(at, f"{key}={value}")
    if "\n".join(lines) + "\n" == conf.read_text():
        return
    conf.write_text("\n".join(lines) + "\n")
    run(["scontrol", "reconfigure"])
    wait_for(f"slurmctld to take {key}", lambda: (value or "(null)") in next(
        (x for x in run(["scontrol", "show", "config"]).stdout.splitlines() if x.startswith((key + " ", key + "["))),
        "(null)"), 60, 0.3)
    time.sleep(1)


def conf_value(key: str) -> str | None:
    return next((line.split("=", 1)[1] for line in slurm_conf().read_text().splitlines()
                 if line.startswith(f"{key}=")), None)


def apply_variant(variant: dict, base_sched: str) -> subprocess.Popen | None:
    """Set the variant's Slurm settings; start the policy daemon with its interval."""
    sched = variant.get("sched", base_sched)
    if sched != current_sched():
        set_sched(sched)
    for key in variant.get("conf_keys", {}):
        set_conf(key, variant.get("conf", {}).get(key))
    return start_daemon(variant.get("daemon_interval", 2.0))


def parse_lever(text: str) -> dict:
    key, _, value = text.partition("=")
    if key == "sched":  # sched=+batch_sched_delay=0 adds, sched=LIST replaces
        return {"sched": value}
    if key == "daemon-interval":
        return {"daemon_interval": float(value)}
    if key == "conf":  # conf=Epilog=/bin/true: one slurm.conf line, absent in the baseline
        k, _, v = value.partition("=")
        return {"conf": {k: v}, "conf_keys": {k: None}}
    if key == "before-19":  # the Slurm settings before issue 19: defer_batch, no epilog
        return {"sched": "+defer_batch", "conf": {"Epilog": None}, "conf_keys": {"Epilog": None}}
    raise SystemExit(f"unknown lever {text!r} (sched=..., daemon-interval=S, conf=KEY=VALUE, before-19)")


def latency_main(args) -> None:
    base_sched = current_sched()
    variants = [("baseline", {})]
    if args.lever:
        lever = parse_lever(args.lever)
        if lever.get("sched", "").startswith("+"):
            lever["sched"] = f"{base_sched},{lever['sched'][1:]}"
        variants.append((args.lever, lever))
        if "conf_keys" in lever:  # the baseline has the cluster's own value of each key
            variants[0][1]["conf_keys"] = lever["conf_keys"]
            variants[0][1]["conf"] = {k: conf_value(k) for k in lever["conf_keys"]}
    res = {name: {"idle": [], "pre": [], "restart": [], "iphases": [], "phases": [], "rphases": []}
           for name, _ in variants}
    t_start = time.time()
    print(f"Slurm {run(['sinfo', '-V']).stdout.strip()}; SchedulerParameters={base_sched}", flush=True)
    try:
        for i in range(args.repeats):
            for name, variant in (variants if i % 2 == 0 else variants[::-1]):
                daemon = apply_variant(variant, base_sched)
                try:
                    r = res[name]
                    total, phases = idle_start()
                    r["idle"].append(total)
                    r["iphases"].append(phases)
                    total, phases = preemption()
                    r["pre"].append(total)
                    r["phases"].append(phases)
                    total, phases = restart()
                    r["restart"].append(total)
                    r["rphases"].append(phases)
                finally:
                    stop_daemon(daemon)
                print(f"repeat {i + 1}/{args.repeats} {name}: idle {r['idle'][-1]:.2f} s, preemption "
                      f"{r['pre'][-1]:.2f} s, restart {r['restart'][-1]:.2f} s", flush=True)
    finally:
        if current_sched() != base_sched:
            set_sched(base_sched)
        for key, value in variants[0][1].get("conf", {}).items():
            set_conf(key, value)
    print(f"\nlatency, medians of {args.repeats}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{platform.node()}, {os.cpu_count()} cores, took {time.time() - t_start:.0f} s")

    names = [n for n, _ in variants]
    rows = []
    for name in names:
        r = res[name]
        idle = nan_median(r["idle"])
        pre, rs = nan_median(r["pre"]), nan_median(r["restart"])
        rows.append((name, idle, pre, pre / idle, rs, rs / idle))
    print("| variant | idle start | preemption | preemption / idle | restart | restart / idle |\n|---|---|---|---|---|---|")
    for name, idle, pre, pr, rs, rr in rows:
        print(f"| {name} | {idle:.2f} s | {pre:.2f} s | {pr:.2f}x | {rs:.2f} s | {rr:.2f}x |")
    # An idle start waits 0-1 s for slurmctld's 1 s tick, and repeats drift slowly through
    # that phase: the idle starts of all variants together are the steadier reference when a
    # lever does not change the idle start.
    pooled = nan_median([x for r in res.values() for x in r["idle"]])
    print(f"idle start of all variants together: {pooled:.2f} s; " + "; ".join(
        f"{name}: preemption {pre / pooled:.2f}x, restart {rs / pooled:.2f}x" for name, _, pre, _, rs, _ in rows))
    for title, key, phases in (("idle start: HIGH command at 0", "iphases", IDLE_PHASES),
                               ("preemption: HIGH command at 0", "phases", PHASES),
                               ("restart: go_suspend (requeue request) at 0", "rphases", RESTART_PHASES)):
        print(f"\n{title}; median time of each mark (and the phase since the previous mark)\n"
              f"| mark | {' | '.join(names)} |\n|---|{'---|' * len(names)}")
        for ph in phases:
            cells = []
            for name in names:
                at = nan_median([p[ph] for p in res[name][key]])
                prev = phases.index(ph)
                gap = nan_median([p[ph] - (p[phases[prev - 1]] if prev else 0.0) for p in res[name][key]])
                cells.append(f"{at:.2f} s (+{gap:.2f})")
            print(f"| {ph} | {' | '.join(cells)} |")
    print("raw: " + json.dumps({n: {k: [round(x, 3) for x in v] for k, v in r.items() if k in ("idle", "pre", "restart")}
                                for n, r in res.items()}))
    print(f"Slurm's log lines of each job: {WORK}/preempt-lines.log, {WORK}/restart-lines.log")


# ------------------------------------------------------------------ the first step (issue 32, item 5; issue 57)
#
# --first-step: a 4-node job whose script imports torch and makes one training step on each
# node, as a real job's would before it trains, as a hai-submit job and as a plain
# `sbatch --requeue` job whose batch script runs the same step with `srun`, alternating, in
# one run: its first step on the idle cluster (submission -> the last node's first step) and
# after a restart (slurm-hai: go_suspend; stock: `scontrol requeue` -> the last node's first
# step of run 1). Both start cold, in the job's step, as every job does since issue 57. All
# four nodes share this machine's cores, as in the soak.

TORCH_STEP = """
import os, sys, time
t_script = time.time()
import torch
stock = len(sys.argv) > 1  # the plain sbatch job: its logs' folder
if stock:
    run = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
else:
    import slurm_hai as hai
    run = hai.restart_count()
model = torch.nn.Linear(512, 512)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
model(torch.randn(64, 512)).square().mean().backward()
opt.step()
line = f"first step run={run} t={time.time():.3f} script={t_script:.3f}"
if stock:
    with open(os.path.join(sys.argv[1], f"rank-{os.environ['SLURM_NODEID']}.log"), "a") as log:
        log.write(line + "\\n")
else:
    print(line, flush=True)
if run > 0:
    sys.exit(0)
print("ready", flush=True)
while True:
    if not stock and int(os.environ["RANK"]) == 0 and hai.receive_suspend_command():
        hai.go_suspend()
    time.sleep(0.02)
"""
FIRST_STEP_NODES = 4
STOCK_FIRST_STEP_BATCH = """#!/bin/bash
echo "start run=${{SLURM_RESTART_COUNT:-0}} t=$(date +%s.%N)" >> {logs}/batch.log
srun {python} {script} {logs}
"""


def first_steps(logs: Path, run_: int) -> list[tuple[float, float]] | None:
    """(script started, first step) of every node's run `run_`, once each node printed it."""
    found = []
    for rank in range(FIRST_STEP_NODES):
        line = next((x for x in read_text(logs / f"rank-{rank}.log").splitlines()
                     if x.startswith(f"first step run={run_} ")), None)
        if line is None:
            return None
        fields = dict(f.split("=") for f in line.split()[2:])
        found.append((float(fields["script"]), float(fields["t"])))
    return found


def first_step_round(stock: bool) -> dict[str, float]:
    """One job: its first step on the idle cluster, then after a restart (seconds)."""
    script = WORK / "torch_step.py"
    script.write_text(TORCH_STEP)
    t0 = time.time()
    if stock:
        logs = WORK / f"first-step-{time.time_ns()}"
        logs.mkdir(mode=0o755)
        batch = STOCK_FIRST_STEP_BATCH.format(logs=logs, python=sys.executable, script=script)
        job = int(run(["sbatch", "--parsable", "-N", str(FIRST_STEP_NODES), "--qos=low", "--gres=gpu:8", "--requeue",
                       f"--output={WORK}/slurm-%j.out", "--open-mode=append", "--job-name=bench-first-step-stock"],
                      input=batch).stdout.strip().split(";")[0])
    else:
        info = json.loads(run(["hai-submit", "--json", "-n", str(FIRST_STEP_NODES), "-p", "LOW", "--gpus-per-node",
                               "8", "--name", "bench-first-step", str(script)]).stdout)
        job, logs = int(info["job_id"]), Path(info["job_dir"]) / "logs"
    first = wait_for("run 0's first steps", lambda: first_steps(logs, 0), 180)
    if stock:
        asked = time.time()
        run(["scontrol", "requeue", str(job)])
    else:
        run(["hai", "suspend", str(job)])
    again = wait_for("run 1's first steps", lambda: first_steps(logs, 1), 180)
    if stock:
        restarted = start_times(logs / "batch.log")[1]
    else:
        asked = event_time(logs.parent, "go_suspend", run=0)
        restarted = event_time(logs.parent, "start", run=1)
    drain([job])
    return {"start": max(t for _, t in first) - t0, "restart": max(t for _, t in again) - asked,
            "script->step (start)": statistics.median(t - s for s, t in first),
            "script->step (restart)": statistics.median(t - s for s, t in again),
            "batch script->step (restart)": max(t for _, t in again) - restarted}


def first_step_main(args) -> None:
    t_start = time.time()
    res: dict[str, list[dict[str, float]]] = {"slurm-hai": [], "stock": []}
    for i in range(args.repeats):
        for name in (("slurm-hai", "stock") if i % 2 == 0 else ("stock", "slurm-hai")):
            daemon = start_daemon() if name == "slurm-hai" else None  # the stock job without it, as in 1-3
            try:
                r = first_step_round(name == "stock")
            finally:
                if daemon:
                    stop_daemon(daemon)
            res[name].append(r)
            print(f"repeat {i + 1}/{args.repeats} {name}: " + ", ".join(f"{k} {v:.2f} s" for k, v in r.items()),
                  flush=True)
    print(f"\nfirst step of a {FIRST_STEP_NODES}-node job that imports torch, medians of {args.repeats}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, {os.cpu_count()} cores, "
          f"took {time.time() - t_start:.0f} s")
    print("| measure | slurm-hai | stock Slurm | slurm-hai / stock |\n|---|---:|---:|---:|")
    for key in res["slurm-hai"][0]:
        h, c = (statistics.median(r[key] for r in res[n]) for n in ("slurm-hai", "stock"))
        print(f"| {key} | {h:.2f} s | {c:.2f} s | {h / c:.2f}x |")
    print("raw: " + json.dumps({n: [{k: round(v, 3) for k, v in r.items()} for r in rs] for n, rs in res.items()}))


# ------------------------------------------------------------------ what a setting costs slurmctld
#
# --sched-cost N: with N held jobs in slurmctld (policy_bench.fill_queue), a churn of
# --churn short 1-node jobs submitted one after another, run with the baseline's and the
# lever's SchedulerParameters in turn (sdiag reset before each): the main scheduler's
# cycles and time (sdiag), the backfill cycles, and the churn's wall time.


def sdiag() -> dict[str, float]:
    out, section, stats = run(["sdiag"]).stdout, "", {}
    for line in out.splitlines():
        if line.strip().startswith("Main schedule statistics"):
            section = "main"
        elif line.strip().startswith("Backfilling stats"):
            section = "bf"
        elif section and ":" in line:
            key, _, value = line.partition(":")
            try:
                stats[f"{section} {key.strip()}"] = float(value.split()[0])
            except (ValueError, IndexError):
                pass
    return stats


def churn(count: int) -> float:
    t0 = time.time()
    jobs = [int(run(["sbatch", "--parsable", "-N1", "--qos=normal", "--output=/dev/null", "--job-name=bench-churn",
                     "--wrap", "true"]).stdout.strip().split(";")[0]) for _ in range(count)]
    wait_for("the churn to end", lambda: not set(run(["squeue", "-h", "--name=bench-churn", "-o", "%i"]).stdout.split())
             & {str(j) for j in jobs}, 600, 0.2)
    return time.time() - t0


def sched_cost_main(args) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from policy_bench import BENCH_NAME, fill_queue  # noqa: E402

    from slurm_hai.policy.model import load_policy

    base_sched = current_sched()
    lever = parse_lever(args.lever or "sched=" + ",".join(p for p in base_sched.split(",") if "defer" not in p))
    if lever.get("sched", "").startswith("+"):
        lever["sched"] = f"{base_sched},{lever['sched'][1:]}"
    variants = [("baseline", base_sched), (args.lever or "without defer", lever["sched"])]
    t_fill = time.time()
    fill_queue(args.sched_cost, load_policy(STATE / "etc" / "policy.toml"), "hai")
    print(f"{args.sched_cost} held jobs in {time.time() - t_fill:.0f} s", flush=True)
    res = {name: [] for name, _ in variants}
    try:
        for i in range(args.repeats):
            for name, sched in (variants if i % 2 == 0 else variants[::-1]):
                if sched != current_sched():
                    set_sched(sched)
                run(["sdiag", "-r"])
                wall = churn(args.churn)
                time.sleep(1)
                st = sdiag()
                res[name].append((wall, st.get("main Total cycles", 0), st.get("main Mean cycle", 0),
                                  st.get("bf Total backfilled jobs (since last slurm start)", 0), st.get("bf Total cycles", 0)))
                print(f"repeat {i + 1} {name}: churn {wall:.1f} s, main cycles {res[name][-1][1]:.0f}, "
                      f"mean cycle {res[name][-1][2]:.0f} us, backfill cycles {res[name][-1][4]:.0f}", flush=True)
    finally:
        if current_sched() != base_sched:
            set_sched(base_sched)
        run(["scancel", f"--name={BENCH_NAME}"], check=False)
    print(f"\n{args.sched_cost} held jobs, a churn of {args.churn} 1-node jobs; medians of {args.repeats}")
    print("| SchedulerParameters | churn wall time | main scheduler cycles | mean cycle | main scheduler busy "
          "| backfill cycles |\n|---|---|---|---|---|---|")
    for name, sched in variants:
        rows = res[name]
        wall, cyc, mean, bf = (statistics.median(r[k] for r in rows) for k in (0, 1, 2, 4))
        busy = statistics.median(r[1] * r[2] / 1e6 for r in rows)
        print(f"| `{sched}` | {wall:.1f} s | {cyc:.0f} | {mean / 1e3:.1f} ms | {busy:.2f} s | {bf:.0f} |")


# ------------------------------------------------------------------ preemption soak (issue 18)
#
# --soak: a 4-node LOW training job (SOAK_LOW) runs --minutes undisturbed (the baseline),
# then the same job again while a 2-node HIGH job takes nodes for --hold s every --period s
# (submitted at the middle of each period), and with --with-elastic once more as an elastic
# 2:4 job. The job checkpoints its step on the notice, calls go_suspend() and resumes from
# the checkpoint; goodput is the samples kept (steps x nodes, up to where the next run
# resumed) against the baseline's in the same time.

# Rank 0 trains: one step is STEP_S seconds of sleep (the accelerator's time, steady on a
# loaded host), logged as "s STEP EPOCH". Its clock is the first run's: the job ends at
# the deadline of run 0 whatever happened since. Other ranks hold their nodes until done.
SOAK_LOW = """
import json, os, sys, time
import slurm_hai as hai
step_s, seconds = float(sys.argv[1]), float(sys.argv[2])
run = hai.restart_count()
path, done = os.path.join(os.environ["HAI_JOB_DIR"], "ckpt.json"), os.path.join(os.environ["HAI_JOB_DIR"], "done")
if int(os.environ["RANK"]) > 0:
    while not os.path.exists(done):
        time.sleep(0.2)
    sys.exit(0)
state = {"step": 0, "deadline": time.time() + seconds}
if os.path.exists(path):
    with open(path) as f:
        state = json.load(f)
print(f"run {run} from {state['step']} deadline {state['deadline']:.3f} world {os.environ['WORLD_SIZE']}", flush=True)
print("ready", flush=True)
while time.time() < state["deadline"]:
    if hai.receive_suspend_command():
        with open(path + ".tmp", "w") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(path + ".tmp", path)
        hai.go_suspend()
    time.sleep(step_s)
    state["step"] += 1
    print(f"s {state['step']} {time.time():.3f}", flush=True)
print(f"final {state['step']}", flush=True)
open(done, "w").close()
"""

# Marks of each preemption, from the HIGH job's submission (hai-submit) on.
SOAK_PHASES = ("LOW last step", "notice", "checkpoint committed (go_suspend)", "LOW nodes released",
               "HIGH script running", "HIGH finished", "LOW script running again", "LOW first step again")


def soak_runs(log: Path) -> dict[int, dict]:
    """Per run of the soak job's rank 0: the step it resumed from, its first and last step
    (step, epoch), and its final step if it reached the deadline."""
    runs: dict[int, dict] = {}
    cur = None
    for line in read_text(log).splitlines():
        f = line.split()
        if line.startswith("run ") and len(f) >= 6:
            cur = runs[int(f[1])] = {"from": int(f[3]), "deadline": float(f[5]), "first": None, "last": None,
                                     "world": int(f[7]) if len(f) >= 8 else None}
        elif cur is not None and line.startswith("s ") and len(f) == 3:
            cur["last"] = (int(f[1]), float(f[2]))
            cur["first"] = cur["first"] or cur["last"]
        elif cur is not None and line.startswith("final "):
            cur["final"] = int(f[1])
    return runs


def kept_samples(runs: dict[int, dict]) -> tuple[int, int]:
    """(samples kept, samples computed) of a soak job: a run's steps up to where the next run
    resumed (its final step for the last), times the run's world size."""
    kept = computed = 0
    order = sorted(runs)
    for i, r in enumerate(order):
        run_ = runs[r]
        if not run_["last"]:
            continue
        done = run_["last"][0]
        upto = runs[order[i + 1]]["from"] if i + 1 < len(order) else run_.get("final", done)
        kept += (min(done, upto) - run_["from"]) * run_["world"]
        computed += (done - run_["from"]) * run_["world"]
    return kept, computed


def cycle_high(t0: float, seconds: float, period: float | None, hold: float) -> list[tuple[float, int, Path]]:
    """A 2-node HIGH job holding its nodes `hold` s at the middle of every `period` from t0 to
    t0 + seconds (none without a period): each one's (submitted at, job id, job dir)."""
    highs: list[tuple[float, int, Path]] = []
    while period and t0 + (len(highs) + 0.5) * period < t0 + seconds:
        time.sleep(max(0.0, t0 + (len(highs) + 0.5) * period - time.time()))
        highs.append(submit_high(2, hold))
        print(f"  HIGH {len(highs)} submitted at {highs[-1][0] - t0:.1f} s", flush=True)
    return highs


def soak_job(seconds: float, step_s: float, period: float | None, hold: float, nodes: str = "4") -> dict:
    """One soak job (4 nodes, or an elastic range), with the HIGH job cycling when period is given."""
    LOGS.mark()
    low, ldir = submit_coop(nodes, "LOW", SOAK_LOW, (step_s, seconds), "bench-soak")
    log = ldir / "logs" / "rank-0.log"
    t0 = soak_runs(log)[0]["deadline"] - seconds
    highs = cycle_high(t0, seconds, period, hold)
    runs = wait_for("the soak job's final step", lambda: (r := soak_runs(log)) and any("final" in x for x in r.values())
                    and r, seconds + 600, 1.0)
    time.sleep(1)  # the last slurmctld lines
    lines = LOGS.lines()
    drain([low] + [h[1] for h in highs])
    useful, computed = kept_samples(runs)
    phases, lost, own = [], [], []
    for t_sub, _high, hdir in highs if nodes == "4" else ():  # an elastic job runs on beside HIGH: no gap
        r = next((e["run"] for e in events(ldir) if e.get("event") == "notice" and e["t"] >= t_sub), None)
        if r is None or r + 1 not in runs or not runs[r]["last"] or not runs[r + 1]["first"]:
            continue  # the deadline came first
        marks = {
            "LOW last step": runs[r]["last"][1],
            "notice": event_time(ldir, "notice", run=r),
            "checkpoint committed (go_suspend)": event_time(ldir, "go_suspend", run=r),
            "LOW nodes released": LOGS.first(lines, f"Requeuing JobId={low}", after=t_sub),
            "HIGH script running": event_time(hdir, "start", run=0),
            "HIGH finished": event_time(hdir, "finished", run=0),
            "LOW script running again": event_time(ldir, "start", run=r + 1),
            "LOW first step again": runs[r + 1]["first"][1],
        }
        phases.append({k: (v - t_sub if v else float("nan")) for k, v in marks.items()})
        lost.append(runs[r + 1]["first"][1] - runs[r]["last"][1] - step_s)
        own.append(marks["HIGH finished"] - marks["HIGH script running"])  # NaN if an event is missing
    return {"useful": useful, "computed": computed, "runs": len(runs), "preemptions": len(highs),
            "phases": phases, "lost": lost, "own": own, "sizes": [runs[r]["world"] for r in sorted(runs)]}


def soak_main(args) -> None:
    seconds = args.minutes * 60
    if not 0 < args.hold < args.period:
        raise SystemExit("--hold must be more than 0 and less than --period")
    t_start = time.time()
    load = os.getloadavg()
    print(f"Slurm {run(['sinfo', '-V']).stdout.strip()}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
          flush=True)
    daemon = start_daemon(2.0)
    soaks = {}
    try:
        print(f"baseline: the LOW job alone for {args.minutes:g} min", flush=True)
        base = soak_job(seconds, args.step, None, args.hold)
        print(f"  {base['useful']} samples", flush=True)
        for nodes in ("4", "2:4") if args.with_elastic else ("4",):
            print(f"soak, -n {nodes}: HIGH for {args.hold:g} s every {args.period:g} s", flush=True)
            soaks[nodes] = soak_job(seconds, args.step, args.period, args.hold, nodes)
            print(f"  {soaks[nodes]['useful']} samples; runs on {soaks[nodes]['sizes']}", flush=True)
        if args.with_in_place:
            print(f"baseline: the job in place alone for {args.minutes:g} min", flush=True)
            in_place_base = in_place_job(seconds, args.step, None, args.hold)
            print(f"  {in_place_base['useful']} samples", flush=True)
            print(f"soak, -n 2:4 --in-place: HIGH for {args.hold:g} s every {args.period:g} s", flush=True)
            in_place = in_place_job(seconds, args.step, args.period, args.hold)
            print(f"  {in_place['useful']} samples", flush=True)
    finally:
        stop_daemon(daemon)
    load_after = os.getloadavg()
    rate = base["useful"] / seconds  # samples/s of the undisturbed job on its 4 nodes
    print(f"\npreemption soak; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, "
          f"{os.cpu_count()} cores, load average before {load[0]:.2f} {load[1]:.2f}, after "
          f"{load_after[0]:.2f} {load_after[1]:.2f}; took {time.time() - t_start:.0f} s; samples = steps x nodes")
    print("| run | samples kept | samples computed | runs | preemptions | goodput | ceiling | goodput / ceiling "
          "| overhead per preemption beyond the hold | beyond the HIGH job's own run |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    print(f"| undisturbed, {args.minutes:g} min | {base['useful']} | {base['computed']} | {base['runs']} | 0 "
          f"| 1 | 1 | - | - | - |")
    for nodes, soak in soaks.items():
        n = soak["preemptions"]
        goodput = soak["useful"] / base["useful"]
        # the HIGH job takes all 4 nodes' work from a whole-suspend job, 2 of 4 from an elastic one
        share = 1 if nodes == "4" else 0.5
        ceiling = 1 - n * args.hold * share / seconds
        # seconds of the whole job's work lost per preemption, beyond what the hold itself takes
        overhead = ((rate * seconds - soak["useful"]) / rate - n * args.hold * share) / n
        if soak["lost"]:  # the HIGH job's own run: its script's start to its end (the hold, Python, exit)
            beyond_own = [lost - own for lost, own in zip(soak["lost"], soak["own"])]
            gaps = f" (from the steps; median of the gaps {nan_median(soak['lost']) - args.hold:.2f} s)"
            own_cell = (f"{overhead - (statistics.fmean(soak['own']) - args.hold):.2f} s (from the steps; median of "
                        f"the gaps {nan_median(beyond_own):.2f} s)")
        else:
            gaps, own_cell = " (of the whole job's time)", "-"
        name = (f"HIGH {args.hold:g} s every {args.period:g} s" if nodes == "4"
                else f"same, LOW job elastic {nodes} (runs on {', '.join(map(str, soak['sizes']))})")
        print(f"| {name} | {soak['useful']} | {soak['computed']} | {soak['runs']} | {n} | {goodput:.3f} "
              f"| {ceiling:.3f} | {goodput / ceiling:.3f} | {overhead:.2f} s{gaps} | {own_cell} |")
    if args.with_in_place:
        n = in_place["preemptions"]
        ceiling = 1 - n * args.hold * 0.5 / seconds
        goodput = in_place["useful"] / in_place_base["useful"]
        print(f"| same job in place, undisturbed (its own baseline) | {in_place_base['useful']} "
              f"| {in_place_base['computed']} | 1 | 0 | 1 | 1 | - | - | - |")
        print(f"| job in place (-n 2:4 --in-place), HIGH {args.hold:g} s every {args.period:g} s "
              f"| {in_place['useful']} | {in_place['computed']} | - | {n} | {goodput:.3f} | {ceiling:.3f} "
              f"| {goodput / ceiling:.3f} | - | - |")
        print(f"\njob in place: a step as 4 parts {in_place['step']:.3f} s; per preemption, the parts that "
              f"stayed lost (longest gap less a step as 4, twice) median {nan_median(in_place['lost']):.2f} s (all: "
              f"{', '.join(f'{x:.2f}' for x in in_place['lost'])}); HIGH ended -> the first step as 4 again: median "
              f"{nan_median(in_place['rejoin']):.2f} s (all: {', '.join(f'{x:.2f}' for x in in_place['rejoin'])}); "
              f"HIGH submitted -> HIGH running: median {nan_median(in_place['latency']):.2f} s against the "
              f"fixed job's {nan_median([p['HIGH script running'] for p in soaks['4']['phases']]):.2f} s")
    ph = soaks["4"]["phases"]
    print(f"\neach preemption of the 4-node job: HIGH command at 0; median time of each mark (and the phase since "
          f"the previous mark), {len(ph)} preemptions\n| mark | at | phase |\n|---|---|---|")
    for i, name in enumerate(SOAK_PHASES):
        gap = nan_median([p[name] - p[SOAK_PHASES[i - 1]] for p in ph]) if i else float("nan")
        print(f"| {name} | {nan_median([p[name] for p in ph]):.2f} s | {'' if i == 0 else f'+{gap:.2f}'} |")
    print(f"time lost per preemption (LOW last step -> first step again, less one step): median "
          f"{nan_median(soaks['4']['lost']):.2f} s; all: {', '.join(f'{x:.2f}' for x in soaks['4']['lost'])}; "
          f"the HIGH job's own runs: {', '.join(f'{x:.2f}' for x in soaks['4']['own'])}")


# --with-in-place (issue 31): the same soak of an elastic job in place (hai-submit --in-place
# -n 2:4), against the same job undisturbed in the same run. Each part is a torchft replica
# group (slurm_hai.runtime.parts); a step is a global batch of 4 rows, STEP_S seconds of sleep
# per row a part computes (one row per node at full size, two at half), so samples = steps x 4
# and a part's rate matches the LOW job's per node. The job's clock starts when its first part
# starts. Nothing is lost at a leave: the job's step is its samples so far.
SOAK_PARTS = """
import os, sys, time
step_s, seconds, out = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
from slurm_hai.runtime.parts import join, leave_on
leave_on()
import torch
from torchft.optim import OptimizerWrapper
index, run = os.environ["SLURM_ARRAY_TASK_ID"], os.environ.get("SLURM_RESTART_COUNT", "0")
clock = os.path.join(out, "deadline")
try:  # the job's clock: the first part to start sets it, atomically
    tmp = f"{clock}.{index}.{run}"
    with open(tmp, "w") as f:
        f.write(f"{time.time() + seconds}")
    os.link(tmp, clock)
except FileExistsError:
    pass
deadline = float(open(clock).read())
w = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
inner = torch.optim.SGD([w], lr=0.0)
part = join(lambda: {"w": w.detach().clone()}, lambda s: w.data.copy_(s["w"]))
opt = OptimizerWrapper(part.manager, inner)
print(f"run {run} part {index} t {time.time():.3f}", flush=True)
print("ready", flush=True)
while time.time() < deadline:
    opt.zero_grad()
    share = part.share(4)
    time.sleep(step_s * (0 if share is None else share.stop - share.start))
    w.grad = torch.zeros_like(w)
    part.sum_gradients([w])
    step = part.manager.current_step()
    opt.step()
    if part.manager.current_step() > step:
        print(f"s {step + 1} {time.time():.3f} {part.manager.num_participants()}", flush=True)
print(f"final {part.manager.current_step()}", flush=True)
"""


def part_steps(job_dir: Path) -> list[tuple[int, float, int]]:
    """(step, epoch, parts) of every committed step any part logged, the first record of each."""
    seen: dict[int, tuple[int, float, int]] = {}
    for log in (job_dir / "logs").glob("rank-*.log"):
        for line in read_text(log).splitlines():
            f = line.split()
            if line.startswith("s ") and len(f) == 4:
                step = int(f[1])
                if step not in seen or float(f[2]) < seen[step][1]:
                    seen[step] = (step, float(f[2]), int(f[3]))
    return sorted(seen.values())


def in_place_job(seconds: float, step_s: float, period: float | None, hold: float) -> dict:
    """One elastic job in place; the HIGH job cycling when period is given."""
    out = WORK / f"in-place-{time.time():.0f}"
    out.mkdir(mode=0o755)
    script = WORK / "bench_parts.py"
    script.write_text(SOAK_PARTS)
    info = json.loads(run(["hai-submit", "--json", "--in-place", "-n", "2:4", "-p", "LOW", "--gpus-per-node", "8",
                           "--name", "bench-in-place", str(script), "--", str(step_s), str(seconds), str(out)]).stdout)
    array, job_dir = int(info["job_id"]), Path(info["job_dir"])
    t0 = wait_for("the parts' clock", lambda: read_text(out / "deadline"), 180, 0.2)
    t0 = float(t0) - seconds
    highs = cycle_high(t0, seconds, period, hold)
    wait_for("a part's final step", lambda: any("final " in read_text(f) for f in (job_dir / "logs").glob("rank-*.log")),
             seconds + 600, 1.0)
    time.sleep(2)  # the other parts' last steps
    steps = part_steps(job_dir)
    drain([array] + [h[1] for h in highs])
    normal = statistics.median(b[1] - a[1] for a, b in zip(steps, steps[1:]) if a[2] == b[2] == 4) if steps else 0
    lost, rejoin, latency = [], [], []
    for t_sub, _high, hdir in highs:
        started, ended = event_time(hdir, "start", run=0), event_time(hdir, "finished", run=0)
        if started:
            latency.append(started - t_sub)
        # the parts that stayed: the longest gap between two steps from the HIGH command to
        # the first step as 2, less a step as 4 at full size (each of the two computes 2 rows)
        around = [x for x in steps if x[1] >= t_sub - 1]
        first_two = next((i for i, x in enumerate(around) if x[2] == 2), None)
        if first_two:
            lost.append(max(b[1] - a[1] for a, b in zip(around[:first_two], around[1:first_two + 1])) - 2 * normal)
        back = next((x[1] for x in steps if ended and x[1] > ended and x[2] == 4), None)
        if ended and back:
            rejoin.append(back - ended)
    return {"useful": 4 * len(steps), "computed": 4 * len(steps), "preemptions": len(highs), "lost": lost, "rejoin": rejoin, "latency": latency, "step": normal,
            "sizes": sorted({x[2] for x in steps})}


# ------------------------------------------------------------------ elastic (issue 11)
#
# --elastic: the soak's LOW job (one step every --step s on each of its nodes), as an elastic
# 2:4 job and as a fixed 4-node job, alternating; a 2-node HIGH job arrives --at s into the
# run and holds its nodes --hold s. Samples = steps x the run's world size. The elastic job
# shrinks to 2 beside HIGH and grows back after it (the local policy's grow_after); the fixed
# one is suspended whole until HIGH ends.


def step_times(log: Path) -> list[tuple[float, int]]:
    """(time, world size) of every step of the soak job's rank 0, over all its runs."""
    out, world = [], 0
    for line in read_text(log).splitlines():
        f = line.split()
        if line.startswith("run ") and len(f) >= 8:
            world = int(f[7])
        elif line.startswith("s ") and len(f) == 3:
            out.append((float(f[2]), world))
    return out


def elastic_job(nodes: str, seconds: float, step_s: float, at: float, hold: float) -> dict:
    low, ldir = submit_coop(nodes, "LOW", SOAK_LOW, (step_s, seconds), "bench-elastic")
    log = ldir / "logs" / "rank-0.log"
    t0 = soak_runs(log)[0]["deadline"] - seconds
    time.sleep(max(0.0, t0 + at - time.time()))
    t_sub, high, hdir = submit_high(2, hold)
    t_high = wait_for("the HIGH job's script", lambda: event_time(hdir, "start", run=0), 120, 0.02)
    t_end = wait_for("the HIGH job's end", lambda: event_time(hdir, "finished", run=0), hold + 120, 0.2)
    wait_for("the LOW job's final step", lambda: "final " in read_text(log), seconds + 600, 1.0)
    steps = step_times(log)
    sizes = [r.get("world") for r in soak_runs(log).values()]
    drain([low, high])
    return {"latency": t_high - t_sub, "in_hold": sum(w for t, w in steps if t_sub <= t <= t_end),
            "total": sum(w for _, w in steps), "runs": len(soak_runs(log)), "hold": t_end - t_sub,
            "sizes": sizes}


def elastic_main(args) -> None:
    t_start = time.time()
    load = os.getloadavg()
    print(f"Slurm {run(['sinfo', '-V']).stdout.strip()}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
          flush=True)
    r: dict[str, list[dict]] = {"4": [], "2:4": []}
    daemon = start_daemon(2.0)
    try:
        for i in range(args.repeats):
            for nodes in ("4", "2:4"):
                got = elastic_job(nodes, args.seconds, args.step, args.at, args.hold)
                r[nodes].append(got)
                print(f"repeat {i + 1}/{args.repeats}, -n {nodes}: " + ", ".join(
                    f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in got.items()), flush=True)
    finally:
        stop_daemon(daemon)

    def m(nodes: str, key: str) -> float:
        return statistics.median(x[key] for x in r[nodes])

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b else "- (0 for the fixed job)"

    print(f"\nelastic benchmark, medians of {args.repeats}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{platform.node()}, {os.cpu_count()} cores, took {time.time() - t_start:.0f} s; LOW job of "
          f"{args.seconds:g} s, one step per {args.step:g} s per node; a 2-node HIGH job at {args.at:g} s holds "
          f"{args.hold:g} s")
    print("| what | elastic 2:4 | fixed 4 (suspended whole) | ratio |\n|---|---|---|---|")
    print(f"| samples while HIGH holds its nodes (HIGH submitted -> HIGH ended) | {m('2:4', 'in_hold'):.0f} "
          f"| {m('4', 'in_hold'):.0f} | {ratio(m('2:4', 'in_hold'), m('4', 'in_hold'))} |")
    print(f"| samples in the whole run | {m('2:4', 'total'):.0f} | {m('4', 'total'):.0f} "
          f"| {ratio(m('2:4', 'total'), m('4', 'total'))} |")
    print(f"| HIGH submitted -> HIGH running (shrink vs whole suspend) | {m('2:4', 'latency'):.2f} s "
          f"| {m('4', 'latency'):.2f} s | {ratio(m('2:4', 'latency'), m('4', 'latency'))} |")
    print(f"| runs of the LOW job | {m('2:4', 'runs'):.0f} | {m('4', 'runs'):.0f} | - |")
    print("sizes of the elastic job's runs: " + "; ".join(str(x["sizes"]) for x in r["2:4"]))
    print("raw: " + json.dumps({k: [{kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in x.items()}
                                    for x in v] for k, v in r.items()}))


# ------------------------------------------------------------------ main


def med(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s" if values else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gib", type=float, default=1.0, help="state held by the LOW job for measurement 3")
    ap.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    ap.add_argument("--latency", action="store_true",
                    help="only the latency run of issue 19: idle start, preemption, restart of a 2-node HIGH job, "
                         "with phases")
    ap.add_argument("--lever", help="with --latency: also run every repeat with this lever, alternating with "
                                    "the baseline: sched=PARAMS (sched=+KEY=V adds to the current), daemon-interval=S, "
                                    "conf=KEY=VALUE (one slurm.conf line), before-19 (defer_batch and no epilog, "
                                    "the settings before issue 19)")
    ap.add_argument("--first-step", action="store_true",
                    help="(issues 32, 57) a 4-node job that imports torch: its first step at its start and after "
                         "a restart, against the same step in a plain sbatch --requeue job (srun), alternating")
    ap.add_argument("--sched-cost", type=int, metavar="N",
                    help="what a SchedulerParameters lever costs slurmctld with N held jobs (sdiag), against the "
                         "baseline; --lever sched=... (default: the baseline without defer)")
    ap.add_argument("--churn", type=int, default=30, help="with --sched-cost: short jobs per measurement")
    ap.add_argument("--soak", action="store_true",
                    help="the preemption soak of issue 18: goodput of a 4-node LOW training job while a 2-node HIGH "
                         "job takes nodes for --hold s every --period s, against the same job undisturbed")
    ap.add_argument("--minutes", type=float, default=10.0, help="with --soak: minutes of each run")
    ap.add_argument("--with-elastic", action="store_true",
                    help="with --soak: also soak the LOW job as an elastic 2:4 job (it runs on beside HIGH)")
    ap.add_argument("--with-in-place", action="store_true",
                    help="with --soak: also soak an elastic job in place (hai-submit --in-place -n 2:4, issue 31) "
                         "against the same job undisturbed")
    ap.add_argument("--period", type=float, default=60.0, help="with --soak: seconds between HIGH jobs")
    ap.add_argument("--hold", type=float, default=10.0, help="with --soak, --elastic: seconds each HIGH job runs (issue 11 asks for 60)")
    ap.add_argument("--step", type=float, default=0.1, help="with --soak, --elastic: seconds of one training step")
    ap.add_argument("--elastic", action="store_true",
                    help="(issue 11) samples of an elastic 2:4 LOW job against a fixed 4-node one while a 2-node "
                         "HIGH job holds its nodes, and the HIGH job's start latency in each case")
    ap.add_argument("--seconds", type=float, default=110.0, help="with --elastic: seconds the LOW job trains")
    ap.add_argument("--at", type=float, default=15.0, help="with --elastic: when the HIGH job arrives")
    args = ap.parse_args()
    WORK.mkdir(mode=0o755, parents=True)
    if run(["squeue", "-h", "-o", "%i"]).stdout.split():
        raise SystemExit("the cluster is busy: the benchmark needs it idle (squeue shows jobs)")
    if args.latency:
        return latency_main(args)
    if args.first_step:
        return first_step_main(args)
    if args.sched_cost:
        return sched_cost_main(args)
    if args.soak:
        return soak_main(args)
    if args.elastic:
        return elastic_main(args)
    r: dict[str, list[float]] = {k: [] for k in (
        "pre_ours", "pre_stock", "pre_stock_dies", "rq_ours", "rq_stock", "restart_ours", "restart_stock",
        "big_ours", "big_stock", "big_high_ours", "big_high_stock")}
    commits: list[str] = []
    t_start = time.time()
    for i in range(args.repeats):
        print(f"repeat {i + 1}/{args.repeats}: stock Slurm (no policy daemon)", flush=True)
        high, rq = preempt(submit_stock("ignores", 0, 4, f"pre{i}")[0])
        r["pre_stock"].append(high)
        r["rq_stock"].append(rq)
        r["pre_stock_dies"].append(preempt(submit_stock("dies", 0, 4, f"dies{i}")[0], requeue_expected=False)[0])
        r["restart_stock"].append(restart_latency_stock())
        high, rq = preempt(submit_stock("ignores", args.gib, 4, f"big{i}")[0])
        r["big_stock"].append(rq)
        r["big_high_stock"].append(high)
        print(f"repeat {i + 1}/{args.repeats}: slurm-hai (policy daemon on)", flush=True)
        daemon = start_daemon()
        try:
            high, rq = preempt(submit_ours(0, 4)[0])
            r["pre_ours"].append(high)
            r["rq_ours"].append(rq)
            r["restart_ours"].append(restart_latency_ours())
            job, log = submit_ours(args.gib, 4)
            high, rq = preempt(job)
            r["big_ours"].append(rq)
            r["big_high_ours"].append(high)
            commits += [line for line in read_text(log).splitlines() if line.startswith("committed")]
        finally:
            stop_daemon(daemon)
        print("  " + ", ".join(f"{k}={v[-1]:.2f}" for k, v in r.items() if v), flush=True)

    def ratio(ours: str, stock: str) -> str:
        return f"{statistics.median(r[stock]) / statistics.median(r[ours]):.1f}x faster"

    rows = [
        ("preemption latency: HIGH submitted -> HIGH running (LOW job cooperates; stock ignores SIGTERM)",
         med(r["pre_ours"]), med(r["pre_stock"]), ratio("pre_ours", "pre_stock")),
        ("  same, stock job dies of SIGTERM instead (its work since the last checkpoint is lost; "
         f"Slurm then: {', '.join(sorted(set(r_dies_state)))})", med(r["pre_ours"]), med(r["pre_stock_dies"]), "-"),
        ("  HIGH submitted -> LOW job requeued", med(r["rq_ours"]), med(r["rq_stock"]), ratio("rq_ours", "rq_stock")),
        ("restart latency: requeue requested -> job's script running again (idle cluster)",
         med(r["restart_ours"]), med(r["restart_stock"]), ratio("restart_ours", "restart_stock")),
        (f"suspend-to-requeue, {args.gib:g} GiB of state: HIGH submitted -> LOW requeued "
         "(slurm-hai commits it first; stock saves nothing)", med(r["big_ours"]), med(r["big_stock"]),
         ratio("big_ours", "big_stock")),
        (f"  HIGH submitted -> HIGH running, {args.gib:g} GiB of state", med(r["big_high_ours"]),
         med(r["big_high_stock"]), ratio("big_high_ours", "big_high_stock")),
    ]
    print(f"\ncluster benchmark, medians of {args.repeats}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{platform.node()}, {os.cpu_count()} cores, took {time.time() - t_start:.0f} s")
    width = max(len(row[0]) for row in rows)
    print(f"{'what':<{width}}  {'slurm-hai':>10}  {'stock':>10}  ratio")
    for what, ours, stock, rat in rows:
        print(f"{what:<{width}}  {ours:>10}  {stock:>10}  {rat}")
    if commits:
        print(f"slurm-hai's blocking checkpoint at the notice: {'; '.join(commits)}")
    print("raw: " + json.dumps({k: [round(x, 3) for x in v] for k, v in r.items()}))
    if args.markdown:
        print("\n| what | slurm-hai | stock Slurm | ratio |\n|---|---|---|---|")
        for what, ours, stock, rat in rows:
            print(f"| {what.strip()} | {ours} | {stock} | {rat} |")
    shutil.rmtree(WORK / "hai", ignore_errors=True)


if __name__ == "__main__":
    main()
