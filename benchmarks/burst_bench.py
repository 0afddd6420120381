"""A burst of submissions (issue 32, item 4): --jobs `hai-submit` from --users users at once,
against the same burst of plain `sbatch`, in one run, on the live local cluster.

    source $HAI_CLUSTER_DIR/etc/env
    .venv/bin/python benchmarks/burst_bench.py [--jobs 1000] [--users 10] [--rounds 2]

Each of --users users (hai-burst01, ... : the bench adds them to the system and to the
policy's first account, and removes them at the end) submits its share of --jobs one after
another, all users at the same time, each command a new process run as that user (`runuser`),
as users at a login node would. The plain-sbatch burst asks Slurm for the same jobs (the
level's QOS, the same node counts) with `sbatch` of the same kind of script. Both bursts go
through the cluster's job_submit.lua, and the policy daemon (`hai-admin daemon`, as deployed)
runs throughout. One in 20 submissions names a level that does not exist: both must refuse it.

Measured per burst: every command's wall time (p50, p90, p99, max), whether each ended in one
line (accepted: the job id; refused: one error line, non-zero exit, no traceback), and the
quotas: every --sample s the running jobs of the bench's users are read (squeue text) and the
nodes each user runs at each level are held against the policy's quota for that user and
level. The rounds rotate which burst goes first; each burst's jobs are cancelled before the next one starts.

Each `hai-submit` starts by itself, in the user's own process, as `sbatch` does (no service
starts it: issue 57). --kinds picks one burst or both.

Printed beside the table: where each kind's slowest 1% started in its burst, and how many of
them were a user's first command; --trace FILE keeps every submission (its user, place, start
on the host's monotonic clock, as `perf record -k mono` stamps its samples, and time).
slurm_hai's modules are byte-compiled first, as an installed wheel has them: the jobs that
start during a burst import them on the same cores.

--nodes-apart: the local cluster's nodes run on the cores the users submit from, which a
site's compute nodes do not (they are other machines than its login node and its controller).
With it, every process of every node (its slurmd and all below it: the jobs' scripts,
launchers and steps; its persist agent: each node's mount namespace)
is moved into a CPU control group of its own at the default weight, where new ones are born
too: the nodes together then weigh as one process against the submissions, not one each. They
are moved back, and the group removed, at the end.

--controller-apart: likewise slurmctld, slurmdbd and MariaDB, at the highest weight, as on a
controller host of their own: the users' commands no longer hold slurmctld off the cores
while it holds its locks (a backfill pass holds the job lock, and every RPC waits for it).
munged stays with the commands: every host runs its own.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import json
import os
import pwd
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "contrib" / "localcluster"))

import localcluster  # noqa: E402

from slurm_hai.policy.levels import level_of_qos  # noqa: E402
from slurm_hai.policy.model import Policy, load_policy  # noqa: E402

LEVELS = ("LOW", "NORMAL", "ABOVE_NORMAL", "HIGH")  # what the burst asks for, in turn
REFUSED_EVERY = 20
JOB = "#!/bin/bash\nexec sleep 600\n"


@dataclass
class Result:
    user: str
    seq: int  # its place in its user's submissions, from 0
    start: float  # when it started: time.perf_counter() (the host's monotonic clock, as `perf record -k mono`)
    seconds: float
    rc: int
    out: str
    err: str
    meant_to_fail: bool

    def one_line(self) -> bool:
        text = (self.out if self.rc == 0 else self.err).strip()
        other = (self.err if self.rc == 0 else self.out).strip()
        return len(text.splitlines()) == 1 and not other and "Traceback" not in text

    def right(self) -> bool:
        return (self.rc != 0) == self.meant_to_fail and self.one_line()


def run(argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, text=True, capture_output=True, **kw)
    if check and p.returncode != 0:
        sys.exit(f"burst_bench: {' '.join(argv)} failed: {(p.stderr or p.stdout).strip()}")
    return p


def cluster_name() -> str:
    out = run(["scontrol", "show", "config"]).stdout
    return next(line.split("=", 1)[1].strip() for line in out.splitlines() if line.startswith("ClusterName"))


def add_users(users: list[str], account: str, home_root: Path) -> None:
    for user in users:
        try:
            if Path(pwd.getpwnam(user).pw_dir).is_dir():
                continue
            run(["userdel", user])  # left by an interrupted run, its home gone with a cluster's state
        except KeyError:
            pass
        run(["useradd", "--create-home", "--base-dir", str(home_root), "--shell", "/bin/bash", user])
    run(["sacctmgr", "-i", "add", "user", f"name={','.join(users)}", f"account={account}",
         f"cluster={cluster_name()}"], check=False)  # already there: fine


def remove_users(users: list[str]) -> None:
    run(["sacctmgr", "-i", "delete", "user", f"name={','.join(users)}"], check=False)
    for user in users:
        run(["userdel", "--remove", user], check=False)


def cancel_all(users: list[str]) -> None:
    """Cancel the users' jobs until none is left: a job being preempted (requeued) as it is
    cancelled comes back, and is cancelled again."""
    deadline = time.monotonic() + 300
    while run(["squeue", "--noheader", "--user", ",".join(users), "--format=%i"]).stdout.strip():
        if time.monotonic() > deadline:
            sys.exit("burst_bench: the burst's jobs did not leave the queue in 300 s")
        for user in users:
            run(["scancel", "--user", user], check=False)
        time.sleep(2)


def plan(n: int) -> list[tuple[str, int, bool]]:
    """(level, nodes, meant to be refused) of each of a user's submissions."""
    return [("NOSUCH" if k % REFUSED_EVERY == REFUSED_EVERY - 1 else LEVELS[k % len(LEVELS)], 1 + k % 2,
             k % REFUSED_EVERY == REFUSED_EVERY - 1) for k in range(n)]


KINDS = ("sbatch", "hai-submit")


def argv_for(kind: str, user: str, level: str, nodes: int, policy: Policy, script: Path) -> list[str]:
    home = pwd.getpwnam(user).pw_dir
    run_as = ["runuser", "-u", user, "--", "env", f"HOME={home}", f"USER={user}"]
    if kind == "hai-submit":
        return [*run_as, str(BIN / "hai-submit"), "-n", str(nodes), "-p", level, "--name", "burst", str(script)]
    qos = policy.qos_for(level, user) if level in {lvl.name for lvl in policy.ladder} else level.lower()
    return [*run_as, "sbatch", "--parsable", "-N", str(nodes), f"--qos={qos}", "--job-name=burst",
            f"--output={home}/burst-%j.out", str(script)]


def submit_all(kind: str, users: list[str], per_user: int, policy: Policy, script: Path) -> list[Result]:
    def one_user(user: str) -> list[Result]:
        results = []
        for seq, (level, nodes, refused) in enumerate(plan(per_user)):
            t0 = time.perf_counter()
            p = run(argv_for(kind, user, level, nodes, policy, script), check=False, cwd="/")
            results.append(Result(user, seq, t0, time.perf_counter() - t0, p.returncode, p.stdout, p.stderr,
                                  refused))
        return results

    with ThreadPoolExecutor(len(users)) as pool:
        return [r for rs in pool.map(one_user, users) for r in rs]


class QuotaWatch(threading.Thread):
    """Reads the queue every `every` s and holds each user's running nodes per level against
    the policy's quota for that user and level."""

    def __init__(self, policy: Policy, users: set[str], every: float):
        super().__init__(daemon=True)
        self.policy, self.users, self.every = policy, users, every
        self.samples = 0
        self.violations: list[str] = []
        self.most_running = 0
        self.stop = threading.Event()

    def run(self) -> None:
        # the running jobs of the bench's users alone: the whole queue (1,000-2,000 jobs by the
        # end of a burst) read every sample costs the two cores more the longer a burst lasts
        argv = ["squeue", "--noheader", "--states=RUNNING", f"--user={','.join(sorted(self.users))}",
                "--format=%u %q %D"]
        while not self.stop.is_set():
            used: dict[tuple[str, str], int] = defaultdict(int)
            jobs = [line.split() for line in run(argv).stdout.splitlines()]
            for user, qos, nodes in jobs:
                lvl = level_of_qos(qos, self.policy.ladder)
                used[(user, lvl.name if lvl else qos)] += int(nodes)
            for (user, level), nodes in used.items():
                quota = self.policy.quota_for(level, user)
                if quota is not None and nodes > quota:
                    self.violations.append(f"{user} ran {nodes} node(s) at {level} (quota {quota})")
            self.samples += 1
            self.most_running = max(self.most_running, len(jobs))
            self.stop.wait(self.every)


def burst(kind: str, users: list[str], per_user: int, policy: Policy, script: Path, every: float) -> dict:
    watch = QuotaWatch(policy, set(users), every)
    watch.start()
    begin = time.perf_counter()
    results = submit_all(kind, users, per_user, policy, script)
    wall = time.perf_counter() - begin
    time.sleep(3 * every)  # the daemon's answer to the last submissions
    watch.stop.set()
    watch.join()
    cancel_all(users)
    return {"results": results, "begin": begin, "wall": wall, "watch": watch}


class Apart:
    """Processes in a CPU control group of their own (cgroup v1 `cpu` or v2) at `weight` (v2's
    cpu.weight, 100 its default; v1's cpu.shares scaled, 1024 its default), where what they
    start is born too; moved back, and the group removed, on exit."""

    def __init__(self, name: str, pids: list[int], weight: int = 100):
        v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
        self.root = Path("/sys/fs/cgroup") if v2 else Path("/sys/fs/cgroup/cpu")
        self.group = self.root / name
        self.pids = pids
        self.weight = ("cpu.weight", str(weight)) if v2 else ("cpu.shares", str(weight * 1024 // 100))
        if v2 and "cpu" not in (self.root / "cgroup.subtree_control").read_text().split():
            (self.root / "cgroup.subtree_control").write_text("+cpu")

    def __enter__(self) -> Apart:
        self.group.mkdir(exist_ok=True)
        (self.group / self.weight[0]).write_text(self.weight[1])
        for pid in self.pids:
            try:
                (self.group / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass  # ended since
        return self

    def __exit__(self, *exc) -> None:
        for pid in (self.group / "cgroup.procs").read_text().split():
            try:
                (self.root / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        self.group.rmdir()


def nodes_apart(c: localcluster.Cluster) -> Apart:
    """Every process of the local cluster's nodes (each node's mount namespace), at the
    default weight: together they weigh as one process against the submissions."""
    holders = [localcluster.running_pid(localcluster.node_holder(c, n)) for n in c.nodes]
    if None in holders:
        sys.exit("burst_bench: --nodes-apart: a node of the local cluster is not running (contrib/localcluster/up)")
    return Apart("slurm-hai-burst-nodes", [pid for holder in holders if holder
                                           for pid in localcluster.namespace_processes(holder)])


def controller_apart(c: localcluster.Cluster) -> Apart:
    """slurmctld, slurmdbd and its MariaDB at the highest weight: they get the CPU they ask
    for, as on a controller host of their own (munged stays: every host runs one)."""
    pids = [localcluster.running_pid(d) for d in localcluster.daemons(c) if d.name in ("slurmctld", "slurmdbd", "mariadbd")]
    if None in pids or len(pids) != 3:
        sys.exit("burst_bench: --controller-apart: the local cluster's controller is not running (contrib/localcluster/up)")
    return Apart("slurm-hai-burst-controller", [pid for pid in pids if pid], weight=10000)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1000, help="submissions per burst, in all")
    ap.add_argument("--users", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2, help="bursts of each kind, in turn (the first kind "
                    "first in odd rounds: an even count gives each kind the same places, as a cluster holds more "
                    "ended jobs with each burst)")
    ap.add_argument("--sample", type=float, default=0.5, help="seconds between quota samples")
    ap.add_argument("--keep-users", action="store_true", help="leave the bench's users in place")
    ap.add_argument("--trace", type=Path, help="write every submission (kind, round, user, place, start, seconds, "
                    "exit) to this file, as JSON lines")
    ap.add_argument("--nodes-apart", action="store_true", help="the local nodes' processes in a CPU control group "
                    "of their own at the default weight (together as one process against the submissions), as a "
                    "site's compute nodes are not its login node")
    ap.add_argument("--controller-apart", action="store_true", help="slurmctld, slurmdbd and MariaDB in a CPU "
                    "control group of their own at the highest weight, as on a controller host of their own")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), metavar="KIND",
                    help=f"the bursts to run, of: {', '.join(repr(k) for k in KINDS)} (default: all)")
    args = ap.parse_args()
    compileall.compile_dir(REPO / "slurm_hai", quiet=1)
    kinds = [k for k in KINDS if k in args.kinds]
    state = Path(os.environ.get("HAI_CLUSTER_DIR", "/var/lib/slurm-hai/localcluster"))
    policy = load_policy(state / "etc" / "policy.toml")
    if not policy.accounts:
        sys.exit("burst_bench: the policy names no account (`accounts`) to add the bench's users to")
    cluster = localcluster.cluster_from_env()
    aparts = [*([nodes_apart(cluster)] if args.nodes_apart else []),
              *([controller_apart(cluster)] if args.controller_apart else [])]
    users = [f"hai-burst{i + 1:02d}" for i in range(args.users)]
    work = state / "shared" / f"burst-bench-{os.getpid()}"
    work.mkdir(mode=0o755, parents=True)
    script = work / "burst-job.sh"
    script.write_text(JOB)
    script.chmod(0o755)
    add_users(users, policy.accounts[0], state / "shared" / "burst-homes")
    daemon_log = open(work / "daemon.log", "w")
    daemon = subprocess.Popen([str(BIN / "hai-admin"), "daemon", "--policy", str(state / "etc" / "policy.toml"),
                               "--interval", "2", "--lock", str(work / "policyd.lock")],
                              stdout=daemon_log, stderr=subprocess.STDOUT)
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    with contextlib.ExitStack() as stack:
        for group in aparts:
            stack.enter_context(group)
        try:
            for r in range(args.rounds):
                for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
                    one = burst(kind, users, args.jobs // args.users, policy, script, args.sample)
                    lat = [x.seconds for x in one["results"]]
                    print(f"round {r + 1} {kind}: {len(lat)} in {one['wall']:.1f} s, p50 {pct(lat, .5):.3f} s, "
                          f"p99 {pct(lat, .99):.3f} s, {one['watch'].samples} quota samples", flush=True)
                    runs[kind].append(one)
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(30)
            cancel_all(users)
            if not args.keep_users:
                remove_users(users)
    print(f"\n{args.jobs} submissions per burst from {args.users} users at once, {args.rounds} bursts each; "
          f"{os.cpu_count()} cores" + ("; the nodes' processes apart (--nodes-apart)" if args.nodes_apart else "")
          + ("; the controller apart (--controller-apart)" if args.controller_apart else ""))
    print("| command | p50 | p90 | p99 | max | burst wall time | one line, right answer | quota samples | "
          "over quota | most jobs running |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    p99 = {}
    for kind, bursts in runs.items():
        results = [x for b in bursts for x in b["results"]]
        lat = [x.seconds for x in results]
        p99[kind] = pct(lat, .99)
        right = sum(x.right() for x in results)
        samples = sum(b["watch"].samples for b in bursts)
        over = [v for b in bursts for v in b["watch"].violations]
        print(f"| `{kind}` | {pct(lat, .5):.3f} s | {pct(lat, .9):.3f} s | {p99[kind]:.3f} s | {max(lat):.3f} s "
              f"| {statistics.median(b['wall'] for b in bursts):.1f} s | {right}/{len(results)} | {samples} "
              f"| {len(over)} | {max(b['watch'].most_running for b in bursts)} |")
        for x in [x for x in results if not x.right()][:3]:
            print(f"  {kind} as {x.user}: exit {x.rc}: {(x.out + x.err).strip()[:300]!r}")
        for v in over[:3]:
            print(f"  over quota: {v}")
        slowest = sorted(results, key=lambda x: x.seconds)[-max(1, len(results) // 100):]
        slow = {id(x) for x in slowest}
        into = [x.start - b["begin"] for b in bursts for x in b["results"] if id(x) in slow]
        print(f"  its slowest 1% ({len(slowest)}): {sum(x.seq == 0 for x in slowest)} a user's first; started "
              f"{', '.join(f'{t:.1f}' for t in sorted(into))} s into their burst")
    if args.trace:
        with open(args.trace, "w") as f:
            for kind, bursts in runs.items():
                for r, b in enumerate(bursts):
                    for x in b["results"]:
                        f.write(json.dumps({"kind": kind, "round": r, "user": x.user, "seq": x.seq,
                                            "start": round(x.start, 4), "into": round(x.start - b["begin"], 4),
                                            "seconds": round(x.seconds, 4), "rc": x.rc}) + "\n")
    if "sbatch" in p99 and "hai-submit" in p99:
        print(f"\np99 of hai-submit / p99 of sbatch: {p99['hai-submit'] / p99['sbatch']:.2f}x (goal: within 2x)")


if __name__ == "__main__":
    main()
