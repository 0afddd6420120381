"""`hai list` and `hai status JOB` against a live queue of 10,000 jobs: one tree against another.

    source $HAI_CLUSTER_DIR/etc/env
    git worktree add --detach /work/bench-before <the commit before the change>
    .venv/bin/python benchmarks/list_bench.py --before /work/bench-before --jobs 10000 --repeats 5

Each command runs as a user runs it: a new `hai` process with PYTHONPATH at the tree under
test (--before; --after is this checkout), started as the tree's pyproject.toml declares the
`hai` script, its bytecode compiled first as pip does at install, so each time includes
Python's start and the imports, the Slurm commands as the backend (HAI_SLURM_BACKEND=cli). The two trees take turns
(which one goes first alternates), and each figure is the median of --repeats. A shim first
on PATH counts the squeue processes of each command, and slurmctld's own count of job-info
RPCs (`sdiag`) is read around one more run of each.

The queue is policy_bench's (`fill_queue`): held batch jobs (priority 0, so nothing runs and
the queue stays as it is), one node each, over every level's QOS. All but --mine of them
belong to another user (--others), as on a shared cluster, where `hai list` shows a few
jobs of yours among everyone's. Measured: `hai list`; `hai status` of one of your waiting
jobs (the policy says why it waits: it needs the whole queue); of one that Slurm cancelled
(no final.json: nothing to explain); and of your newest job whose directory says it ended
(if there is one, e.g. from the cluster tests). --cleanup cancels the jobs at the end.

--daemon PORT: the after tree's commands ask the policy daemon why a job waits
(controller/why.py): the bench runs `hai-admin daemon --dry-run` from the after tree beside
them, with the policy and `[daemon] service = "http://127.0.0.1:PORT"` (the before tree keeps
the policy as it is).

Slurm's default MaxJobCount is 10000 (slurmctld refuses more jobs): for 10,000 jobs, raise
it in the cluster's own rendered slurm.conf and restart slurmctld (MaxJobCount is not
reloaded by `scontrol reconfigure`); `contrib/localcluster/up` renders the default again.
"""

from __future__ import annotations

import argparse
import getpass
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from policy_bench import BENCH_NAME, fill_queue, job_info_rpcs  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def hai_entry(tree: Path) -> str:
    """Python that runs `hai` as the tree's pyproject.toml declares it (its console script)."""
    import tomllib

    module, func = tomllib.loads((tree / "pyproject.toml").read_text())["project"]["scripts"]["hai"].split(":")
    return f"import sys; from {module} import {func}; sys.argv[0] = 'hai'; {func}()"


# GNU time: the peak resident memory of the command (the largest of its processes, squeue's too)
PEAK = ["/usr/bin/time", "-f", "peak-kib %M"]


def peak_kib(stderr: str) -> int:
    return int(stderr.rsplit("peak-kib ", 1)[1].split()[0])


def slurm(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


class Hai:
    """Runs `hai ARGV` from a tree, with a squeue shim that counts the squeue processes."""

    def __init__(self, shim_dir: Path) -> None:
        self.log = shim_dir / "squeue.log"
        shim = shim_dir / "squeue"
        shim.write_text(f'#!/bin/sh\necho "$*" >> {self.log}\nexec {shutil.which("squeue")} "$@"\n')
        shim.chmod(0o755)
        # as installed: bytecode compiled (pip compiles it at install), none written while timed
        self.env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
                    "PATH": f"{shim_dir}:{os.environ['PATH']}", "HAI_SLURM_BACKEND": "cli"}

    def run(self, tree: Path, argv: list[str], env: dict[str, str]) -> tuple[float, int, int]:
        """(seconds, squeue calls, peak KiB of its processes) of one `hai ARGV` run from `tree`."""
        self.log.write_text("")
        # -P and a neutral cwd: `python -c` would put the cwd first on sys.path, ahead of PYTHONPATH
        t0 = time.perf_counter()
        p = subprocess.run([*PEAK, sys.executable, "-P", "-c", hai_entry(tree), *argv],
                           env={**self.env, "PYTHONPATH": str(tree), **env},
                           cwd=self.log.parent, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if p.returncode != 0:
            raise SystemExit(f"list_bench: `hai {' '.join(argv)}` from {tree} failed: {p.stderr.strip()}")
        return seconds, len(self.log.read_text().splitlines()), peak_kib(p.stderr)


def newest_ended_job_dir() -> int | None:
    """Your newest job whose directory has a final.json (e.g. from the cluster tests)."""
    root = Path(os.environ.get("HAI_HOME") or Path.home() / ".hai") / "jobs"
    ids = [int(d.name) for d in root.iterdir() if d.name.isdigit() and (d / "final.json").exists()] \
        if root.is_dir() else []
    return max(ids, default=None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, type=Path, help="the tree before the change (a git worktree)")
    ap.add_argument("--after", type=Path, default=REPO, help="the tree after it (default: this checkout)")
    ap.add_argument("--jobs", type=int, default=10000, help="bench jobs in the queue, all users")
    ap.add_argument("--mine", type=int, default=20, help="of those, the invoking user's")
    ap.add_argument("--others", default="hai-alice", help="the user the rest belong to")
    ap.add_argument("--account", default="hai")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--policy", default=os.environ.get("HAI_POLICY") or str(REPO / "contrib/localcluster/policy.toml"))
    ap.add_argument("--cleanup", action="store_true", help="cancel the bench jobs at the end")
    ap.add_argument("--daemon", type=int, metavar="PORT",
                    help="the after tree's commands ask a policy daemon (dry run) on this port why a job waits")
    args = ap.parse_args()
    if "SLURM_CONF" not in os.environ:
        print("list_bench: set SLURM_CONF (source $HAI_CLUSTER_DIR/etc/env)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(args.after))
    from slurm_hai.policy.model import load_policy

    policy, me = load_policy(args.policy), getpass.getuser()
    limit = int(re.search(r"MaxJobCount\s*=\s*(\d+)", slurm("scontrol", "show", "config")).group(1))
    if args.jobs > limit - 50:
        print(f"list_bench: MaxJobCount is {limit}; raise it in slurm.conf and restart slurmctld", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    added = fill_queue(args.jobs - args.mine, policy, args.account, user=args.others)
    added += fill_queue(args.mine, policy, args.account, user=me)
    if added:
        print(f"({added} held jobs submitted in {time.perf_counter() - t0:.0f} s)", flush=True)
    mine = sorted(int(j) for j in slurm("squeue", "-h", f"--name={BENCH_NAME}", f"--user={me}", "-t", "PD",
                                        "-o", "%i").split())
    waiting, cancelled = mine[0], mine[-1]
    slurm("scancel", str(cancelled))
    in_ctld = len(slurm("squeue", "-h", "--states=all", "-o", "%i").split())
    whole, yours, one = "squeue (the whole queue)", f"squeue --user={me}", f"scontrol show job -o {waiting}"
    # each `hai` command, and the Slurm command that does the same for Slurm's own user
    rows = [("hai list", ["list"], yours), ("hai list --all", ["list", "--all"], whole),
            ("hai status JOB, waiting (the policy says why)", ["status", str(waiting)], one),
            ("hai status JOB, cancelled (no final.json)", ["status", str(cancelled)], one)]
    ended = newest_ended_job_dir()
    if ended is not None:
        rows += [("hai status JOB, ended (final.json)", ["status", str(ended)], one),
                 ("hai logs JOB, ended", ["logs", str(ended)], one)]

    release = slurm("scontrol", "--version").split()[-1]
    print(f"{in_ctld} jobs in slurmctld ({len(mine)} of {me}), Slurm {release}, Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs; median of {args.repeats}, the trees alternating")
    with tempfile.TemporaryDirectory() as shim_dir:
        hai = Hai(Path(shim_dir))
        trees = {"before": args.before.resolve(), "after": args.after.resolve()}
        envs: dict[str, dict[str, str]] = {"before": {}, "after": {}}
        daemon = None
        if args.daemon:
            envs["after"]["HAI_POLICY"] = policy_file = f"{shim_dir}/policy.toml"
            Path(policy_file).write_text(Path(args.policy).read_text()
                                         + f'\n[daemon]\nservice = "http://127.0.0.1:{args.daemon}"\n')
            daemon = policy_daemon(trees["after"], Path(policy_file), Path(shim_dir), args.daemon)
        for tree in trees.values():  # as pip installs a package: its bytecode compiled
            subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "slurm_hai")], check=True,
                           stdout=subprocess.DEVNULL)
        times: dict[tuple[str, str], list[float]] = {}
        calls: dict[tuple[str, str], int] = {}
        rpcs: dict[tuple[str, str], int] = {}
        peak: dict[tuple[str, str], int] = {}
        for name, argv, _ in rows:  # one counting run each (not timed): squeue processes, slurmctld's RPCs
            for side, tree in trees.items():
                n0 = job_info_rpcs()[0]
                _, calls[name, side], peak[name, side] = hai.run(tree, argv, envs[side])
                rpcs[name, side] = job_info_rpcs()[0] - n0
        for r in range(args.repeats):
            for name, argv, _ in rows:
                for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
                    seconds, _, _ = hai.run(trees[side], argv, envs[side])
                    times.setdefault((name, side), []).append(seconds)
        reads = {what: statistics.median_low(timed(argv) for _ in range(args.repeats)) for what, argv in (
            (whole, ["squeue"]), (yours, ["squeue", f"--user={me}"]),
            ("squeue --json --states=all (the whole queue)", ["squeue", "--json", "--states=all"]),
            (one, ["scontrol", "show", "job", "-o", str(waiting)]))}
        if daemon is not None:
            daemon.terminate()
            daemon.wait(30)
    print()
    print("| command | before | after | after/before | after vs Slurm's | peak memory before -> after "
          "| squeue calls | job-info RPCs (sdiag) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, _, own in rows:
        b, a = (statistics.median(times[name, s]) for s in ("before", "after"))
        print(f"| `{name}` | {b:.3f} s | {a:.3f} s | {a / b:.2f}x | {a / reads[own][0]:.1f}x `{own}` | "
              f"{peak[name, 'before'] / 1024:.0f} -> {peak[name, 'after'] / 1024:.0f} MiB | "
              f"{calls[name, 'before']} -> {calls[name, 'after']} | {rpcs[name, 'before']} -> {rpcs[name, 'after']} |")
    print("\nSlurm's own commands in the same run (median of the repeats):\n")
    print("| Slurm command | time | peak memory |")
    print("|---|---:|---:|")
    for what, (seconds, kib) in reads.items():
        print(f"| `{what}` | {seconds:.3f} s | {kib / 1024:.0f} MiB |")
    if args.cleanup:
        subprocess.run(["scancel", f"--name={BENCH_NAME}"], check=False)
    return 0


def policy_daemon(tree: Path, policy: Path, where: Path, port: int) -> subprocess.Popen:
    """`hai-admin daemon --dry-run` from `tree` under `policy`, once it answers from a read of the queue."""
    import json
    import urllib.request

    log = where / "daemon.log"
    daemon = subprocess.Popen([sys.executable, "-P", "-c", "from slurm_hai.cli.admin import main; main()", "daemon",
                               "--dry-run", "--policy", str(policy), "--lock", str(where / "daemon.lock")],
                              env={**os.environ, "PYTHONPATH": str(tree)}, cwd=where, stdout=open(log, "w"),
                              stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/why?jobs=", timeout=5) as answer:
                if json.load(answer)["seen"]:
                    return daemon
        except OSError:
            pass
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"list_bench: the policy daemon did not answer: {log.read_text()}")
        time.sleep(0.2)


def timed(argv: list[str]) -> tuple[float, int]:
    """(seconds, peak KiB) of one Slurm command."""
    t0 = time.perf_counter()
    p = subprocess.run([*PEAK, *argv], capture_output=True, text=True, check=True)
    return time.perf_counter() - t0, peak_kib(p.stderr)


if __name__ == "__main__":
    sys.exit(main())
