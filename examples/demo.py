"""`make demo`: the HAI time-sharing story, live, on the local Slurm cluster.

1. examples/train.py is submitted at LOW with hai-submit: 2 nodes x 2 processes (DDP, gloo).
2. The uninterrupted reference run of the same training is submitted at NORMAL on the
   other 2 nodes; now the cluster is full.
3. A HIGH job arrives (2 nodes: the HIGH quota of one user in the local policy). Slurm
   picks the lowest level to make room: the LOW job. Its rank 0 gets the suspend notice,
   all ranks commit a checkpoint, go_suspend() requeues it, the HIGH job starts.
4. When the HIGH job is done the LOW job runs again and resumes from its checkpoint.
5. The final weights of the suspended-and-resumed run are compared with the reference,
   bit for bit; then a timeline read from the jobs' events.jsonl and logs, and the
   timeline page (`hai-admin timeline`): nodes x time, one HTML file that opens offline.

Runs against $HAI_CLUSTER_DIR (default /var/lib/slurm-hai/localcluster) or $SLURM_CONF.
It starts the policy daemon (`hai-admin daemon`) for the duration when none runs, and
cancels only the jobs it submitted. Exit status 0 only if the weights are identical.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train.py"
STATE = Path(os.environ.get("HAI_CLUSTER_DIR", "/var/lib/slurm-hai/localcluster"))
ENV = dict(os.environ)
ENV.setdefault("SLURM_CONF", str(STATE / "etc" / "slurm.conf"))
ENV["PATH"] = f"{Path(sys.executable).parent}:{ENV.get('PATH', '/usr/bin:/bin')}"

STEPS = 300
NPROCS = 2
STEP_SLEEP = 0.05  # a watchable pace: ~15 steps/s on 2 cores; does not change the result
TRAIN_ARGS = ["--nprocs", str(NPROCS), "--steps", str(STEPS), "--step-sleep", str(STEP_SLEEP)]
HIGH_ARGS = ["--nprocs", "2", "--steps", "120", "--seed", "7", "--step-sleep", "0.03"]
TIMEOUT = 240  # seconds for the whole story before it is declared failed

T0 = time.time()


def say(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def fail(msg: str) -> None:
    print(f"\nDEMO FAILED: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def run(argv: list[str], check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, env=ENV, text=True, capture_output=True, timeout=timeout, cwd="/tmp")
    if check and p.returncode != 0:
        fail(f"{' '.join(argv)} exited {p.returncode}: {(p.stderr or p.stdout).strip()}")
    return p


@dataclass
class Job:
    """One submitted job, watched through its job directory (events.jsonl, logs)."""
    label: str
    job_id: int
    job_dir: Path
    seen_events: int = 0
    seen_log: int = 0
    lines: list[tuple[float, str]] = field(default_factory=list)  # ([train] lines, when we saw them)

    def events(self) -> list[dict]:
        try:
            text = (self.job_dir / "events.jsonl").read_text()
        except FileNotFoundError:
            return []
        out = []
        for line in text.splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def first(self, name: str, **match) -> dict | None:
        return next((e for e in self.events() if e["event"] == name
                     and all(e.get(k) == v for k, v in match.items())), None)

    def new_log_lines(self) -> list[str]:
        path = self.job_dir / "logs" / "rank-0.log"
        try:
            with open(path, "rb") as f:
                f.seek(self.seen_log)
                data = f.read()
        except FileNotFoundError:
            return []
        cut = data.rfind(b"\n") + 1  # whole lines only
        self.seen_log += cut
        lines = [ln for ln in data[:cut].decode(errors="replace").splitlines()
                 if ln.startswith("[train]") or ln.startswith("====")]
        now = time.time()
        self.lines += [(now, ln) for ln in lines]
        return lines

    def log_value(self, pattern: str) -> re.Match | None:
        for _, line in self.lines:
            m = re.search(pattern, line)
            if m:
                return m
        return None


def submit(label: str, level: str, nodes: int, args: list[str]) -> Job:
    p = run(["hai-submit", "--json", "-n", str(nodes), "-p", level, "--gpus-per-node", "8", "--name",
             label.lower().replace(" ", "-"), str(TRAIN), "--", *args])
    info = json.loads(p.stdout)
    return Job(label, int(info["job_id"]), Path(info["job_dir"]))


def squeue(jobs: list[Job]) -> dict[int, tuple[str, str]]:
    p = run(["squeue", "-h", "-j", ",".join(str(j.job_id) for j in jobs), "-o", "%i|%T|%N|%r"], check=False)
    out = {}
    for line in p.stdout.splitlines():
        jid, st, nodes, reason = line.split("|")
        out[int(jid)] = (st, nodes if st == "RUNNING" else f"({reason})")
    return out


def check_cluster() -> None:
    p = run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
    if p.returncode != 0:
        fail(f"the cluster does not answer ({p.stderr.strip()}); boot it with contrib/localcluster/up "
             f"(SLURM_CONF={ENV['SLURM_CONF']})")
    deadline = time.time() + 90
    while True:
        states = dict(line.split() for line in run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout.splitlines())
        busy = run(["squeue", "-h", "-o", "%i"]).stdout.split()
        if len(states) >= 4 and all(s == "idle" for s in states.values()) and not busy:
            return
        if time.time() > deadline:
            fail(f"the demo needs 4 idle nodes and an empty queue; nodes {states}, jobs {busy}")
        time.sleep(2)


def start_daemon(workdir: Path) -> subprocess.Popen | None:
    """The policy daemon pushes a requeued job past Slurm's requeue delay, among other
    things (docs/admin-guide.md). One per cluster: if one already leads, use it."""
    policy = STATE / "etc" / "policy.toml"
    if not policy.exists():
        say(f"no {policy}: running without the policy daemon (restarts wait for Slurm's own delay)")
        return None
    log = open(workdir / "policy-daemon.log", "w")
    proc = subprocess.Popen(["hai-admin", "daemon", "--policy", str(policy), "--interval", "1",
                             "--lock", str(STATE / "run" / "hai-policyd.lock")],
                            env=ENV, stdout=log, stderr=subprocess.STDOUT, cwd="/tmp")
    time.sleep(1.5)
    if proc.poll() is not None:
        say(f"policy daemon not started here ({'another one leads' if proc.returncode == 4 else 'exit %d' % proc.returncode});"
            f" see {workdir / 'policy-daemon.log'}")
        return None
    say(f"policy daemon running (pid {proc.pid}, log {workdir / 'policy-daemon.log'})")
    return proc


def stop_daemon(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


class Story:
    def __init__(self) -> None:
        self.jobs: list[Job] = []
        self.announced: set[str] = set()
        self.states: dict[int, tuple[str, str]] = {}

    def once(self, key: str, msg: str) -> None:
        if key not in self.announced:
            self.announced.add(key)
            say(msg)

    def poll(self) -> None:
        """Print what changed: Slurm states, slurm-hai events, the training's own lines."""
        states = squeue(self.jobs)
        for job in self.jobs:
            st = states.get(job.job_id, ("GONE", ""))
            if st != self.states.get(job.job_id):
                self.states[job.job_id] = st
                if st[0] != "GONE":
                    say(f"  slurm: job {job.job_id} ({job.label}) {st[0]} {st[1]}")
            events = job.events()
            for e in events[job.seen_events:]:
                self.describe_event(job, e)
            job.seen_events = len(events)
            for line in job.new_log_lines():
                self.describe_line(job, line)

    def describe_event(self, job: Job, e: dict) -> None:
        name, run_ = e["event"], e.get("run")
        text = {
            "start": f"run {run_} started on {e.get('nodes')}",
            "notice": f"suspend notice reached rank 0's node ({e.get('source')}; grace {e.get('grace')} s)",
            "go_suspend": "go_suspend() called: the step ends, the batch script requeues",
            "suspended": f"run {run_} ended by {e.get('how')}: requeued, keeps its place in line",
            "forced_suspend": f"no go_suspend() within the grace: suspended by force after {e.get('after')} s",
            "finished": f"finished: {e.get('state')} (exit code {e.get('exit_code')})",
        }.get(name)
        if text:
            say(f"{job.label} job {job.job_id}: {text}")

    def describe_line(self, job: Job, line: str) -> None:
        body = line.split(" ", 2)[-1] if line.startswith("[train]") else line
        m = re.match(r"step (\d+)/", body)
        if m and int(m.group(1)) % 60 != 0 and int(m.group(1)) != STEPS:
            return  # every 60 steps is enough on screen
        if line.startswith("===="):
            return
        say(f"{job.label} job {job.job_id} rank 0: {body}")


def wait_until(story: Story, what: str, cond, timeout: float | None = None) -> None:
    deadline = min(T0 + TIMEOUT, time.time() + timeout) if timeout else T0 + TIMEOUT
    while True:
        story.poll()
        if cond():
            return
        if time.time() > deadline:
            fail(f"timed out waiting for {what}")
        time.sleep(0.25)


def latest_step(job: Job) -> int:
    step = 0
    for _, line in job.lines:
        m = re.search(r"step (\d+)/", line)
        if m:
            step = int(m.group(1))
    return step


def compare_weights(a: Path, b: Path) -> tuple[bool, str]:
    from safetensors.torch import load_file
    import torch

    wa, wb = load_file(str(a)), load_file(str(b))
    if wa.keys() != wb.keys():
        return False, f"different tensors: {sorted(wa)} vs {sorted(wb)}"
    bad = [k for k in wa if wa[k].dtype != wb[k].dtype or not torch.equal(wa[k], wb[k])
           or wa[k].numpy().tobytes() != wb[k].numpy().tobytes()]
    n = sum(t.numel() for t in wa.values())
    if bad:
        return False, f"{len(bad)} of {len(wa)} tensors differ: {', '.join(bad)}"
    return True, f"{len(wa)} tensors, {n} parameters, every bit equal"


def timeline(low: Job, high: Job, ref: Job) -> list[tuple[str, float | None, str]]:
    ev = low.first
    rows = [
        ("LOW submitted", (ev("submit") or {}).get("t"), f"job {low.job_id}, 2 nodes x {NPROCS}"),
        ("LOW running", (ev("start", run=0) or {}).get("t"), "run 0"),
        ("HIGH submitted", (high.first("submit") or {}).get("t"), f"job {high.job_id}, 2 nodes"),
        ("notice at LOW rank 0", (ev("notice", run=0) or {}).get("t"), "SIGUSR2 -> flag"),
        ("checkpoint committed", (ev("go_suspend", run=0) or {}).get("t"), "then go_suspend()"),
        ("LOW requeued", (ev("suspended", run=0) or {}).get("t"), "step ended, nodes free"),
        ("HIGH running", (high.first("start", run=0) or {}).get("t"), "on the LOW job's nodes"),
        ("HIGH finished", (high.first("finished") or {}).get("t"), ""),
        ("LOW restarted", (ev("start", run=1) or {}).get("t"), "run 1"),
        ("LOW finished", (ev("finished") or {}).get("t"), ""),
        ("reference finished", (ref.first("finished") or {}).get("t"), f"job {ref.job_id}, never interrupted"),
    ]
    return rows


def print_timeline(low: Job, high: Job, ref: Job) -> None:
    rows = timeline(low, high, ref)
    start = rows[0][1]
    rows.sort(key=lambda r: r[1] or float("inf"))
    print("\nTimeline (from events.jsonl; t = seconds after the LOW job's submission)")
    print(f"  {'event':<22} {'t':>8}  note")
    for name, t, note in rows:
        print(f"  {name:<22} {(f'{t - start:8.2f}' if t and start else '       -')}  {note}")
    t = {name: v for name, v, _ in rows}

    def span(a: str, b: str) -> str:
        return f"{t[b] - t[a]:.2f} s" if t.get(a) and t.get(b) else "-"

    commit = low.log_value(r"committed in ([\d.]+) s \(([\d.]+) KiB")
    resumed = low.log_value(r"resumed from step (\d+) \(checkpoint loaded in ([\d.]+) s")
    print("\nLatencies")
    print(f"  HIGH submitted -> notice at LOW rank 0      {span('HIGH submitted', 'notice at LOW rank 0')}")
    print(f"  notice -> checkpoint committed + go_suspend {span('notice at LOW rank 0', 'checkpoint committed')}"
          + (f"  (the save itself: {float(commit.group(1)):.3f} s, {commit.group(2)} KiB)" if commit else ""))
    print(f"  notice -> requeued (nodes released)         {span('notice at LOW rank 0', 'LOW requeued')}")
    print(f"  HIGH submitted -> HIGH running (preemption) {span('HIGH submitted', 'HIGH running')}")
    print(f"  LOW requeued -> LOW running again           {span('LOW requeued', 'LOW restarted')}"
          "  (it waits for 2 free nodes: the HIGH job's or the reference's, whichever end first)")
    if resumed:
        print(f"  resume: from step {resumed.group(1)}, checkpoint loaded in {float(resumed.group(2)):.3f} s")
    print(f"  LOW job, submit to finish                   {span('LOW submitted', 'LOW finished')}")


def main() -> int:
    workdir = Path(f"/tmp/slurm-hai-demo-{int(T0)}")
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"slurm-hai demo: HAI time-sharing on Slurm (SLURM_CONF={ENV['SLURM_CONF']})\n", flush=True)
    check_cluster()
    say("cluster: 4 idle nodes n1..n4 (8 GPUs each, counted)")
    daemon = start_daemon(workdir)
    story = Story()
    try:
        low = submit("LOW", "LOW", 2, TRAIN_ARGS)
        story.jobs.append(low)
        say(f"submitted job {low.job_id}: examples/train.py at LOW, 2 nodes x {NPROCS} processes, {STEPS} steps "
            f"(hai-submit -n 2 -p LOW ...)")
        wait_until(story, "the LOW job to run", lambda: low.first("start") is not None)
        ref = submit("REF", "NORMAL", 2, TRAIN_ARGS)
        story.jobs.append(ref)
        say(f"submitted job {ref.job_id}: the same training at NORMAL on the other 2 nodes, the reference "
            "that will never be interrupted; the cluster is now full")
        wait_until(story, "both trainings to make progress",
                   lambda: latest_step(low) >= 60 and ref.first("start") is not None)
        high = submit("HIGH", "HIGH", 2, HIGH_ARGS)
        story.jobs.append(high)
        say(f"submitted job {high.job_id} at HIGH on 2 nodes (a user's HIGH quota in this policy): no node "
            "is free, so Slurm takes the lowest level's nodes (the LOW job), through the suspend protocol")
        wait_until(story, "the HIGH job to finish", lambda: high.first("finished") is not None)
        wait_until(story, "the LOW job to finish", lambda: low.first("finished") is not None)
        wait_until(story, "the reference to finish", lambda: ref.first("finished") is not None)
        story.poll()
    except BaseException:
        for job in story.jobs:  # only what this demo submitted
            run(["scancel", str(job.job_id)], check=False)
        raise
    finally:
        stop_daemon(daemon)

    for job in (low, high, ref):
        final = json.loads((job.job_dir / "final.json").read_text())
        if final["state"] != "succeeded":
            fail(f"{job.label} job {job.job_id} ended {final['state']}; see `hai logs {job.job_id}`")
    if low.first("suspended", run=0) is None:
        fail(f"the LOW job {low.job_id} was never suspended: the HIGH job did not need its nodes")
    same, detail = compare_weights(low.job_dir / "final-weights.safetensors", ref.job_dir / "final-weights.safetensors")
    digest = low.log_value(r"sha256=([0-9a-f]{16})")
    ref_digest = ref.log_value(r"sha256=([0-9a-f]{16})")
    print()
    print(f"final weights, suspended and resumed (job {low.job_id}): sha256 {digest.group(1) if digest else '?'}...")
    print(f"final weights, never interrupted    (job {ref.job_id}): sha256 {ref_digest.group(1) if ref_digest else '?'}...")
    if not same:
        fail(f"the resumed run's final weights differ from the reference: {detail}")
    print(f"final weights: identical ({detail})")
    print_timeline(low, high, ref)
    page = workdir / "timeline.html"
    run(["hai-admin", "timeline", "--since", f"{int(time.time() - T0) + 5}s", "--out", str(page)])
    print(f"\ntimeline page: {page} (which job held each node when, the suspend and the restart "
          "marked; open it in a browser)")
    print(f"\nlogs: hai logs {low.job_id} | hai logs {high.job_id} | hai logs {ref.job_id}; "
          f"demo took {time.time() - T0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
