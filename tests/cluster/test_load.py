"""A burst of 200 short jobs from 4 users at mixed levels, AUTO and elastic among them (issue 18, load).

The queue is sampled every 0.5 s until every job has ended; at no sample may a user run more
nodes at a level than the policy's quota, every job ends exactly once with its own output,
none is suspended more often than the policy lets it be, and each cycle of the policy daemon
is shorter than the grace time.

Submission: `hai-submit` is a Python process (~0.25 s of CPU each); 200 of them cannot start
in 10 s on a 2-core host. So each user submits its first jobs with `hai-submit` and the rest
with plain `sbatch --qos=LEVEL` (C, ~20 ms): both go through the same job_submit.lua (levels,
quota variants, AUTO, elastic ranges), the part under load here. Everything is submitted from
8 threads. Every seventh job of a user is elastic (`--nodes=1-2`: job_submit.lua tags it, the
daemon may grow it), so elastic jobs are preempted, shrunk and grown among the others.
"""

from __future__ import annotations

import re
import statistics
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from test_daemon_faults import start_daemon, stop
from waiting import wait_for

from slurm_hai.policy.levels import level_of_qos
from slurm_hai.policy.model import load_policy

USERS = ("hai-alice", "hai-bob", "hai-carol", "hai-dave")
JOBS_PER_USER = 50
BY_HAI_SUBMIT = 3  # per user (LOW, NORMAL, AUTO); the rest by sbatch
ELASTIC_EVERY, ELASTIC_AT = 7, 5  # jobs i with i % 7 == 5 are elastic 1-2: ABOVE_NORMAL, AUTO, LOW, NORMAL, HIGH...
# levels in turn; several users at each, so higher ones take nodes from lower ones
LEVELS = ("LOW", "NORMAL", "AUTO", "HIGH", "LOW", "ABOVE_NORMAL", "NORMAL", "AUTO", "BELOW_NORMAL", "LOW")
SUBMIT_ORDER = ("LOW", "BELOW_NORMAL", "NORMAL", "AUTO", "ABOVE_NORMAL", "HIGH")
SUBMIT_BOUND_S = 10.0
WORK = """#!/bin/sh
# $1: this job's output file, $2: its token. One "start" line per run (with its node count),
# "done" once at the end.
echo "start $SLURM_JOB_ID ${SLURM_RESTART_COUNT:-0} $SLURM_JOB_NUM_NODES" >> "$1"
sleep 1
echo "done $SLURM_JOB_ID $2" >> "$1"
"""


def elastic(i: int) -> bool:
    return i % ELASTIC_EVERY == ELASTIC_AT


def submit(live, d: Path, user: str, i: int) -> tuple[str, str, str, int]:
    token, level = f"{user}-{i}", LEVELS[i % len(LEVELS)]
    out, work = d / token, d / "work.sh"
    assert not (i < BY_HAI_SUBMIT and elastic(i))
    if i < BY_HAI_SUBMIT:
        p = live.run(["hai-submit", "--json", "-p", level, "--name", token, "--workdir", str(d), str(work),
                      str(out), token], user=user)
        job = int(re.search(r'"job_id": (\d+)', p.stdout).group(1))
    else:
        job = live.sbatch("-o", "/dev/null", "--requeue", f"--qos={level.lower()}", "-J", token,
                          *(["--nodes=1-2"] if elastic(i) else []), "--wrap", f"{work} {out} {token}", user=user)
    return token, user, level, job


def test_200_jobs_from_4_users_keep_quotas_and_each_ends_exactly_once(live, tmp_path):
    policy = load_policy(live.state / "etc" / "policy.toml")
    d = live.shared_dir("load")
    d.chmod(0o1777)
    (d / "work.sh").write_text(WORK)
    (d / "work.sh").chmod(0o755)
    d_log = tmp_path / "daemon.log"
    daemon = start_daemon(live, d_log, "--lock", str(tmp_path / "policyd.lock"), "--log-level", "debug")
    try:
        wait_for(lambda: "policy daemon started" in d_log.read_text() or daemon.poll() is not None, 30, "the daemon")
        assert daemon.poll() is None, d_log.read_text()

        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            # the lower levels first: they take the idle nodes, the higher ones arriving later preempt them
            order = sorted(((u, i) for i in range(JOBS_PER_USER) for u in USERS),
                           key=lambda a: SUBMIT_ORDER.index(LEVELS[a[1] % len(LEVELS)]))
            jobs = list(pool.map(lambda a: submit(live, d, *a), order))
        submit_s = time.monotonic() - t0
        print(f"200 jobs submitted in {submit_s:.1f} s")
        assert submit_s < SUBMIT_BOUND_S, submit_s
        ids = {job for *_, job in jobs}
        assert len(ids) == len(jobs) == len(USERS) * JOBS_PER_USER

        samples, over = 0, []
        deadline = time.monotonic() + 300
        while True:
            rows = [ln.split("|") for ln in live.run(["squeue", "-h", "-o", "%i|%u|%q|%D|%T"]).stdout.splitlines()]
            ours = [r for r in rows if int(r[0]) in ids]
            samples += 1
            held: Counter = Counter()
            for _, user, qos, nodes, state in ours:
                if state in ("RUNNING", "CONFIGURING"):
                    held[(user, level_of_qos(qos, policy.ladder).name)] += int(nodes)
            over += [(user, lvl, n, samples) for (user, lvl), n in held.items()
                     if (q := policy.quota_for(lvl, user, "hai")) is not None and n > q]
            if not ours:
                break
            assert time.monotonic() < deadline, f"still in the queue after 300 s: {ours[:10]}"
            time.sleep(0.5)
        ran_s = time.monotonic() - t0
        assert not over, f"over quota (user, level, nodes, sample): {over[:10]}"

        final = {}
        for line in live.run(["scontrol", "show", "job", "-o"]).stdout.splitlines():
            f = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
            if int(f.get("JobId", 0)) in ids:
                final[int(f["JobId"])] = {**f, "line": line}
        level_of = {job: level_of_qos(final[job]["QOS"], policy.ladder) for job in ids}
        tagged = {job for job in ids if "hai-nodes=1:2:" in final[job]["line"]}
        grows = Counter(int(j) for j in re.findall(r"job (\d+): \w+ \[[\w+-]*grow", d_log.read_text()))
        suspended: dict[int, int] = {}
        on_two = 0
        for token, user, _level, job in jobs:
            info = final[job]
            assert info["JobState"] == "COMPLETED", (token, info)
            lines = (d / token).read_text().splitlines()
            # ends exactly once, with its own output, and nothing ran after that
            assert [ln for ln in lines if ln.startswith("done")] == [f"done {job} {token}"], (token, lines)
            assert lines[-1] == f"done {job} {token}", (token, lines)
            assert all(ln.startswith(f"start {job} ") for ln in lines[:-1]), (token, lines)
            # an elastic job runs on 1 or 2 nodes each time, a fixed one on 1
            is_elastic = elastic(int(token.rsplit("-", 1)[1]))
            sizes = {int(ln.split()[3]) for ln in lines[:-1]}
            on_two += 2 in sizes
            assert sizes <= ({1, 2} if is_elastic else {1}), (token, lines)
            assert (job in tagged) == is_elastic, (token, info["line"])
            restarts = suspended[job] = int(info["Restarts"])
            assert len(lines) - 1 <= restarts + 1, (token, lines, restarts)
            # the anti-thrash bound: a job is suspended only for one the policy puts before it
            # (a higher level, or its own level and earlier, of another user: rule 3), and,
            # with min_run_seconds, only after running that long each time
            mine = level_of[job].value
            ahead = sum(1 for t2, u2, _, j2 in jobs if level_of[j2].value > mine
                        or (level_of[j2].value == mine and j2 < job and u2 != user))
            bound = ahead if not policy.min_run_seconds else min(ahead, int(ran_s // policy.min_run_seconds))
            # an elastic job is also restarted each time the daemon asks it to grow
            assert restarts <= bound + grows[job], (token, restarts, bound, grows[job])
        cycles = [float(s) for s in re.findall(r"cycle: \d+ jobs, .*?([\d.]+) s", d_log.read_text())]
        # the bound: a cycle shorter than the grace time, so a job that ignores its notice is
        # forced off on time (seen here: median 0.4 s, max 2.0 s on a loaded 2-core host)
        assert cycles and max(cycles) < policy.grace_seconds, (max(cycles, default=None), len(cycles))
        noticed = sum(1 for job in ids if final[job].get("PreemptTime", "None") != "None")
        print(f"all ended after {ran_s:.0f} s; {samples} samples; preempted (notice sent): {noticed}; "
              f"suspensions (requeues): {sum(suspended.values())} "
              f"(most of one job: {max(suspended.values())}); elastic: {len(tagged)}, grown: {len(grows)}, on 2 "
              f"nodes at least once: {on_two}; by level: "
              f"{dict(Counter(lvl.name for lvl in level_of.values()))}; daemon cycles: {len(cycles)}, "
              f"median {statistics.median(cycles):.1f} s, max {max(cycles):.1f} s")
        assert daemon.poll() is None, d_log.read_text()
    finally:
        stop(daemon)
    assert "Traceback" not in d_log.read_text(), d_log.read_text()
