"""An elastic job in place on the live cluster (issue 31; docs/elastic-in-place.md):
`hai-submit --in-place -n 2:4` runs examples/parts_train.py as four parts, a job array of
one-node tasks, under the cluster's lighthouse service (`hai-admin lighthouse`, which `up` starts as a
site runs it, and which the cluster's policy names). A 2-node HIGH job takes two of its nodes: the
parts there leave and their tasks wait in the queue, while the other two train on without
a restart. When HIGH ends, the two start again and heal from a live peer. Every part ends
bitwise equal to the others and within 1e-9 of one process (float64)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from slurm_hai.jobs.jobdir import SIZE_SETTLE_S, JobDir
from test_acceptance import events, named, wait_final
from waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "parts_train.py"
ALICE = "hai-alice"
STEPS = 300


def rows(out: Path) -> list[dict]:
    found = []
    for f in out.glob("part*.log"):
        found += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return sorted(found, key=lambda r: r["t"])


def test_two_parts_leave_for_a_higher_job_the_others_train_on_and_all_end_as_one_process(live, tmp_path):
    out = live.shared_dir("parts", owner=ALICE)
    lighthouses = live.state / "lighthouse"  # the cluster's service: `up` runs it, its policy names it
    console = live.log_dir / "lighthouse.console"
    seen = console.stat().st_size  # the service's earlier lines stay in its log
    array = None
    try:
        p = live.run(["hai-submit", "--json", "--in-place", "-n", "2:4", "-p", "LOW",
                      str(EXAMPLE), "--steps", str(STEPS), "--step-sleep", "0.2", "--hurry", str(out / "hurry"),
                      "--out", str(out)], user=ALICE)
        submitted = json.loads(p.stdout)
        array, job_dir = submitted["job_id"], Path(submitted["job_dir"])
        live.show_on_failure(job_dir)
        assert submitted["node_range"] == "2:4" and job_dir.name == str(array)
        # as four for longer than the job's sizes over time merge (`hai status` below shows 4, 2, 4)
        wait_for(lambda: any(r.get("parts") == 4 and r["t"] - max(e["t"] for e in named(job_dir, "start")) > SIZE_SETTLE_S
                             for r in rows(out) if r["event"] == "step"), 240, "four parts in one quorum", 0.3)
        assert (lighthouses / f"{array}.json").exists()

        high = live.sbatch("-N2", "--qos=high", "-o", "/dev/null", "--wrap", "sleep 15", user="root")
        live.wait_job(high, lambda j: j["JobState"] == "RUNNING", 60, "the HIGH job to take two nodes")
        left = wait_for(lambda: found if len(found := named(job_dir, "left")) == 2 else None, 60,
                        "two parts to leave", 0.3)
        gone = {e["part"] for e in left}
        stayed = sorted({0, 1, 2, 3} - gone)
        wait_for(lambda: [r for r in rows(out) if r["event"] == "step" and r.get("parts") == 2 and r["committed"]],
                 60, "the other two to train on as two", 0.3)
        # one job to its user, on the nodes of its running parts
        st, listed = hai(live, "status", str(array)), hai(live, "list")
        assert (st["state"], st["nodes"], st["node_range"]) == ("running", 2, "2:4"), st
        assert [r["job_id"] for r in listed if r["job_id"] >= array] == [array], listed  # not a line per task
        # a running part's own task id (squeue -r shows it): `hai logs` shows the job's logs;
        # `hai stop` and `hai suspend` touch nothing and name the job's id
        task = next(t for t in map(int, live.run(["squeue", "-h", "-r", "-t", "R", "-j", str(array), "-o", "%A"]
                                                 ).stdout.split()) if t != array)
        for action in ("stop", "suspend"):
            refused = live.run(["hai", action, str(task)], user=ALICE, check=False)
            assert refused.returncode == 1 and refused.stderr.count("\n") == 1, (refused.stdout, refused.stderr)
            assert f"a part of job {array}, an elastic job in place: `hai {action} {array}`" in refused.stderr
        logs = live.run(["hai", "logs", "--json", str(task)], user=ALICE)
        assert json.loads(logs.stdout)["job_id"] == array and f"a part of job {array}" in logs.stderr, logs.stderr
        wait_for(lambda: live.job(high).get("JobState", "COMPLETED") == "COMPLETED", 90, "the HIGH job to end", 0.5)
        # a step committed by four: the step the two died in may be noted by the others after
        # the two's `left` events, with four parts but not committed
        wait_for(lambda: [r for r in rows(out) if r["event"] == "step" and r.get("parts") == 4 and r["committed"]
                          and r["t"] > max(e["t"] for e in left)], 120, "the four parts together again", 0.5)
        assert hai(live, "status", str(array))["nodes"] == 4
        (out / "hurry").touch()  # the rest of the steps without a pause
        final = wait_final(job_dir, 240)
        # once every task has ended, and only then, the service stops the job's lighthouse
        wait_for(lambda: not (lighthouses / f"{array}.json").exists(), 60,
                 "the job's lighthouse to stop with its last part", 0.5)
    finally:
        if array is not None:
            live.run(["scancel", str(array)], check=False)

    assert final["state"] == "succeeded"
    all_rows = rows(out)
    # the two that stayed never restarted: one join each, and their steps have no gap but the leave's
    for part in stayed:
        assert [r["run"] for r in all_rows if r["event"] == "joined" and r["part"] == part] == [0], part
    # the two that left came back as run 1 of their task, healed from a live peer, trained with all four
    for part in gone:
        assert [r["run"] for r in all_rows if r["event"] == "joined" and r["part"] == part] == [0, 1], part
        assert any(r["event"] == "healed" and r["part"] == part for r in all_rows), part
    assert_ends_as_one_process(out, tmp_path, least=4)
    # its size over time, from its parts' starts and leaves
    ended = hai(live, "status", str(array))
    assert (ended["state"], ended["nodes"], ended["node_range"]) == ("finished-succeeded", 2, "2:4"), ended  # not 0/2:4
    sizes = ended["sizes"]
    assert 4 in sizes and sizes[sizes.index(4):] == [4, 2, 4], sizes  # after its parts' start, 3 s apart or more
    # each part's output in its rank log, a run per start: `hai logs JOB --rank P`
    for part in gone:
        runs = hai(live, "logs", str(array), "--rank", str(part))["runs"]
        assert [r["run"] for r in runs] == [0, 1] and "preempted" in runs[0]["text"], runs
    starts = [(e["part"], e["run"]) for e in events(job_dir) if e["event"] == "start"]
    assert sorted(starts) == sorted([(p, 0) for p in range(4)] + [(p, 1) for p in gone]), starts
    # the timeline (accounting's records of the tasks, and the job's events): one job, each
    # part's runs on its node, a mark where each of the two left and where it rejoined
    def drawn():
        tl = hai(live, "timeline")
        mine = [i for i in tl["intervals"] if i["job_id"] >= array]
        return tl if len(mine) >= 6 and all(i["part"] is not None for i in mine) else None
    tl = wait_for(drawn, 60, "accounting's records of the parts' six runs", 1)
    mine = [i for i in tl["intervals"] if i["job_id"] >= array]
    assert {i["job_id"] for i in mine} == {array}, mine  # not a job per task
    assert sorted((i["part"], i["run"]) for i in mine) == sorted(starts) and len({i["node"] for i in mine}) == 4, mine
    node = {(i["part"], i["run"]): [i["node"]] for i in mine}
    marks = sorted((m["kind"], m["nodes"]) for m in tl["marks"] if m["job_id"] == array)
    assert marks == sorted([("part-left", node[p, 0]) for p in gone] + [("part-rejoin", node[p, 1]) for p in gone]), \
        tl["marks"]
    assert b"Traceback" not in console.read_bytes()[seen:]


def assert_ends_as_one_process(out: Path, tmp_path: Path, least: int) -> None:
    """The final weights of every part that ended its training (at least `least` parts; one
    that was healing as the others ended writes none) bitwise equal, and within 1e-9 of one
    process (float64)."""
    ends = [json.loads(f.read_text()) for f in out.glob("part*.json")]
    assert len(ends) >= least, sorted(f.name for f in out.glob("part*.json"))
    assert all(end == ends[0] for end in ends)  # bitwise
    one = tmp_path / "one.json"
    subprocess.run([sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--reference", str(one)], check=True)
    reference = [float.fromhex(w) for w in json.loads(one.read_text())]
    assert max(abs(float.fromhex(a) - b) for a, b in zip(ends[0], reference)) < 1e-9


def hai(live, *argv: str):
    """`hai ARGV --json` as the job's user."""
    return json.loads(live.run(["hai", *argv, "--json"], user=ALICE).stdout)



def test_the_jobs_lighthouse_lost_every_part_is_requeued_and_the_job_resumes_from_its_last_commit(live, tmp_path):
    # kill -9 of the job's lighthouse on the service's host: each task's script sees the service
    # hand out a new one and ends its part, or the part finds its lighthouse cannot be reached
    # first, commits the job's last committed step and leaves; the four come back under the
    # new one, nobody is ahead to heal from, and the first MIN (2) to start resume from the
    # job's last commit together (one part commits every 20 steps, or the commit of a part
    # that left); a later one heals from them, or finds the job over
    out = live.shared_dir("parts-lost", owner=ALICE)
    ckpt = out / "ckpt"
    array = None
    try:
        p = live.run(["hai-submit", "--json", "--in-place", "-n", "2:4", "-p", "LOW", str(EXAMPLE), "--steps",
                      str(STEPS), "--step-sleep", "0.2", "--hurry", str(out / "hurry"), "--out", str(out),
                      "--checkpoint-dir", str(ckpt), "--save-every", "20"], user=ALICE)
        array, job_dir = json.loads(p.stdout)["job_id"], Path(json.loads(p.stdout)["job_dir"])
        live.show_on_failure(job_dir)
        wait_for(lambda: len([r for r in rows(out) if r["event"] == "saved"]) >= 2, 240, "two commits", 0.3)
        record = live.state / "lighthouse" / f"{array}.json"
        os.kill(json.loads(record.read_text())["pid"], signal.SIGKILL)
        killed = time.time()
        left = wait_for(lambda: found if len(found := named(job_dir, "left")) == 4 else None, 60,
                        "every part to leave", 0.3)
        assert all(e["lighthouse_lost"] for e in left) and max(e["t"] for e in left) - killed < 10, left
        resumed = wait_for(lambda: found if len(found := [r for r in rows(out) if r["event"] == "resumed"]) >= 2
                           else None, 120, "MIN parts to resume together", 0.3)
        (out / "hurry").touch()
        final = wait_final(job_dir, 240)
    finally:
        if array is not None:
            live.run(["scancel", str(array)], check=False)
    assert final["state"] == "succeeded"
    all_rows = rows(out)
    last = max(r["step"] for r in all_rows if r["event"] == "saved" and r["t"] < killed)
    back = min(r["t"] for r in resumed)
    done = max(r["step"] for r in all_rows if r["event"] == "step" and r["committed"] and r["t"] < back) + 1
    (at,) = {r["step"] for r in resumed}
    assert at in (last, done), (resumed, last, done)  # the commit before the loss, or the one as the parts left
    assert_ends_as_one_process(out, tmp_path, least=2)


def test_below_min_the_last_part_commits_and_leaves_and_the_job_resumes_from_that_commit(live, tmp_path):
    # -n 2:3 at LOW: a 3-node NORMAL job takes two parts' nodes (and the idle fourth); the part left
    # alone is below MIN: it trains no step, finds that Slurm runs one of the job's parts and
    # at once (not after its quorum timeout, 60 s) commits the job's state and leaves, its
    # task requeued by its script. The job waits whole; when
    # NORMAL ends, the first MIN parts to start resume from that commit together (a third that
    # starts later heals from them, or finds the job ended), and the job ends as one process would
    out = live.shared_dir("parts-min", owner=ALICE)
    array = higher = None
    try:
        p = live.run(["hai-submit", "--json", "--in-place", "-n", "2:3", "-p", "LOW", str(EXAMPLE), "--steps",
                      str(STEPS), "--step-sleep", "0.2", "--hurry", str(out / "hurry"), "--out", str(out),
                      "--checkpoint-dir", str(out / "ckpt"), "--save-every", "20"],
                     user=ALICE)
        array, job_dir = json.loads(p.stdout)["job_id"], Path(json.loads(p.stdout)["job_dir"])
        live.show_on_failure(job_dir)
        wait_for(lambda: any(r["event"] == "saved" for r in rows(out)), 240, "a commit of the three", 0.3)
        higher = live.sbatch("-N3", "--qos=normal", "-o", "/dev/null", "--wrap", "sleep 600", user="root")
        below = wait_for(lambda: [e for e in named(job_dir, "left") if e.get("below_min")], 90,
                         "two parts to leave for the NORMAL job, and the third below MIN", 0.3)
        left = named(job_dir, "left")
        assert len(below) == 1 and len(left) == 3 and below[0]["t"] == max(e["t"] for e in left), left
        assert below[0]["t"] - min(e["t"] for e in left) < 20, left  # at once, not after 60 s
        # no part runs: the job waits for nodes, not for "0 nodes"
        waiting = hai(live, "status", str(array))
        assert waiting["nodes"] > 0 and "0 nodes" not in waiting["reason"], waiting
        done = max(r["step"] for r in rows(out) if r["event"] == "step" and r["committed"]) + 1
        live.run(["scancel", str(higher)])
        resumed = wait_for(lambda: found if len(found := [r for r in rows(out) if r["event"] == "resumed"]) >= 2
                           else None, 120, "MIN parts to resume together", 0.3)
        (out / "hurry").touch()
        final = wait_final(job_dir, 240)
    finally:
        live.run(["scancel", *[str(j) for j in (higher, array) if j]], check=False)
    assert final["state"] == "succeeded"
    assert {r["step"] for r in resumed} == {done}, resumed  # the commit of the part that left
    assert not [r for r in rows(out) if r["event"] == "step" and r["parts"] < 2]  # never below MIN
    assert_ends_as_one_process(out, tmp_path, least=2)


def both_train_again(found: list[dict]) -> bool:
    """Whether parts 0 and 1 joined again after they left (a later run) and then trained a
    step together."""
    back = [r for r in found if r["event"] == "joined" and r["run"] >= 1]
    return {r["part"] for r in back} == {0, 1} and any(
        r["event"] == "step" and r["parts"] == 2 and r["t"] > max(b["t"] for b in back) for r in found)


def test_parts_at_their_time_limit_commit_leave_and_the_job_resumes_past_it(live, tmp_path):
    # -n 1:2 --time 1: both tasks start together, so both reach their 60 s limit together. 35 s
    # before it (the grace, 5 s, + 30) each task's script tells its part, which commits the
    # job's state at its next step and leaves; the script requeues its task with a whole limit
    # (Slurm would end it TIMEOUT). The job resumes from that commit, as often as it takes,
    # and ends as one process would.
    out = live.shared_dir("parts-time", owner=ALICE)
    array = None
    try:
        p = live.run(["hai-submit", "--json", "--in-place", "-n", "1:2", "-p", "LOW", "--time", "1", str(EXAMPLE),
                      "--steps", str(STEPS), "--step-sleep", "0.2", "--hurry", str(out / "hurry"), "--out", str(out),
                      "--checkpoint-dir", str(out / "ckpt"), "--save-every", "1000"], user=ALICE)
        array, job_dir = json.loads(p.stdout)["job_id"], Path(json.loads(p.stdout)["job_dir"])
        live.show_on_failure(job_dir)
        left = wait_for(lambda: found if len(found := named(job_dir, "left")) == 2 else None, 150,
                        "both parts to leave at their tasks' time limit", 0.3)
        done = max(r["step"] for r in rows(out) if r["event"] == "step" and r["committed"]) + 1
        # the first part back resumes from the commit (MIN 1: it trains alone); the other heals
        # from it, or resumes with it if they start together. Both train again before the job
        # may end (the hurry): a part back alone would end it and cancel the other's task (26.05
        # starts a requeued task within seconds, so the two may come back apart)
        resumed = wait_for(lambda: [r for r in rows(out) if r["event"] == "resumed"], 120,
                           "the job to resume from the commit", 0.3)
        wait_for(lambda: both_train_again(rows(out)), 120, "both parts to train again", 0.3)
        (out / "hurry").touch()
        final = wait_final(job_dir, 240)
    finally:
        if array is not None:
            live.run(["scancel", str(array)], check=False)
    assert final["state"] == "succeeded"
    assert all(e.get("time_limit") and e["exit_code"] == 76 and not e["preempted"] for e in left), left
    assert {r["step"] for r in resumed} == {done} and done > 10, (resumed, done)  # no periodic commit: theirs
    assert all(r["event"] != "resumed" or r["step"] >= done for r in rows(out))  # later limits: later commits
    starts = named(job_dir, "start")
    assert sorted(e["run"] for e in starts if e["run"] == 1) == [1, 1]  # each task requeued, not ended
    assert_ends_as_one_process(out, tmp_path, least=2)


# examples/parts_train.py, whose part 1 fails (exit 3) in its first run once it has trained 10
# steps with the others
FAILS_ONCE = """import json, os, pathlib, runpy, sys, threading, time
example, out = sys.argv[1], pathlib.Path(sys.argv[sys.argv.index("--out") + 1])
if os.environ["SLURM_ARRAY_TASK_ID"] == "1" and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
    def fail():
        log = out / "part1.log"
        while sum('"step"' in line for line in (log.read_text().splitlines() if log.exists() else [])) < 10:
            time.sleep(0.1)
        os._exit(3)
    threading.Thread(target=fail, daemon=True).start()
sys.argv = sys.argv[1:]
runpy.run_path(example, run_name="__main__")
"""


def test_a_part_that_fails_on_its_own_is_requeued_with_retries_and_rejoins_from_a_live_peer(live, tmp_path):
    # --retries 1: part 1 fails (exit 3) once it trained 10 steps with the others; its task is
    # requeued (one retry spent), it rejoins and heals from a live peer while the other three
    # never stop, and all end as one process would
    out = live.shared_dir("parts-retry", owner=ALICE)
    script = out / "fails_once.py"
    script.write_text(FAILS_ONCE)
    array = None
    try:
        p = live.run(["hai-submit", "--json", "--in-place", "-n", "2:4", "-p", "LOW", "--retries", "1", str(script),
                      str(EXAMPLE), "--steps", str(STEPS), "--step-sleep", "0.2", "--hurry", str(out / "hurry"),
                      "--out", str(out)], user=ALICE)
        array, job_dir = json.loads(p.stdout)["job_id"], Path(json.loads(p.stdout)["job_dir"])
        live.show_on_failure(job_dir)
        (retry,) = wait_for(lambda: named(job_dir, "retry"), 240, "part 1 to fail and be retried", 0.3)
        healed = wait_for(lambda: [r for r in rows(out) if r["event"] == "healed" and r["part"] == 1
                                   and r["t"] > retry["t"]], 120, "part 1 to rejoin and heal", 0.3)
        (out / "hurry").touch()
        final = wait_final(job_dir, 240)
    finally:
        if array is not None:
            live.run(["scancel", str(array)], check=False)
    assert (retry["part"], retry["exit_code"], retry["retry"], retry["of"]) == (1, 3, 1, 1)
    (left,) = named(job_dir, "left")
    assert left["part"] == 1 and left["exit_code"] == 3 and not left["preempted"]
    assert final["state"] == "succeeded" and healed
    assert [e["run"] for e in named(job_dir, "start") if e["part"] == 1] == [0, 1]
    assert_ends_as_one_process(out, tmp_path, least=3)


WAIT_FOR_FILE = """import pathlib, sys, time
done = pathlib.Path(sys.argv[1])
while not done.exists():
    time.sleep(0.2)
"""


def test_a_plain_sbatch_job_in_place_whose_parts_end_cancels_its_parts_that_wait_for_nodes(live):
    # examples/parts.sbatch (docs/elastic-in-place.md), submitted with plain sbatch, MIN 1 on
    # the command line: a HIGH job holds two nodes: two parts run, two wait; the two end the
    # job, and the two waiting never start (they would only find the job over, and hold its
    # place in line); `hai status` knows the job as hai-submit's. Its id is one an older job of
    # hers had (Slurm gives ids again after it lost its state: CI, after the controller tests):
    # that job's directory, ended, is moved aside, never taken for this job's
    out = live.shared_dir("parts-end", owner=ALICE)
    script, done = out / "wait_for_file.py", out / "done"
    script.write_text(WAIT_FOR_FILE)
    high = live.sbatch("-N2", "--qos=high", "-o", "/dev/null", "--wrap", "sleep 600", user="root")
    array = None
    try:
        live.wait_job(high, lambda j: j["JobState"] == "RUNNING", 60, "the HIGH job to run")
        probe = live.sbatch("--hold", "-o", "/dev/null", "--wrap", "true", user=ALICE)
        live.run(["scancel", str(probe)])
        older = JobDir(Path(f"/home/{ALICE}/.hai/jobs/{probe + 1}"))
        for earlier in [older.path, *older.path.parent.glob(f".stale-{probe + 1}-*")]:  # of runs before this one
            shutil.rmtree(earlier, ignore_errors=True)
        older.create().event("start", run=0, part=0)
        older.event("start", run=0, part=1)
        older.set_final("succeeded", 0)
        subprocess.run(["chown", "-R", f"{ALICE}:{ALICE}", str(older.path)], check=True)
        array = live.sbatch("--comment=hai-parts=1:4", str(REPO / "examples" / "parts.sbatch"), str(script),
                            str(done), user=ALICE)
        assert array == probe + 1, "another job took the id the test planted an older job's directory at"
        job_dir = Path(hai(live, "status", str(array))["job_dir"])
        assert job_dir == older.path
        assert live.job(array)["QOS"] == "low" and "hai-parts=1:4" in live.job(array)["AdminComment"]
        wait_for(lambda: (job_dir / "submit_token").exists() and len(named(job_dir, "start")) == 2, 60,
                 "two parts to start", 0.3)  # in this job's directory: the older one has two starts too
        assert sorted(tasks(live, array).values()).count("PENDING") == 2, tasks(live, array)
        done.touch()
        final = wait_final(job_dir, 60)
        wait_for(lambda: "PENDING" not in tasks(live, array).values(), 30, "the waiting parts to be cancelled", 0.3)
        assert final["state"] == "succeeded"
        assert len(named(job_dir, "start")) == 2 and live.job(high)["JobState"] == "RUNNING"
        assert not named(job_dir, "rerun_skipped")  # never started
        def states() -> list[str]:  # slurmdbd's records (the never-started tasks: one line), as they come
            lines = live.run(["sacct", "-n", "-X", "-j", str(array), "-o", "JobID%30,State%20"]).stdout.split("\n")
            return [line.split()[1] for line in lines if line.strip()]

        ended = wait_for(lambda: st if (st := states()).count("COMPLETED") == 2 and "CANCELLED" in st else None,
                         30, "slurmdbd's records of the four tasks", 0.5)
        assert set(ended) == {"COMPLETED", "CANCELLED"}, ended
        assert hai(live, "status", str(array))["state"] == "finished-succeeded"
        (aside,) = job_dir.parent.glob(f".stale-{array}-*")
        assert [e["part"] for e in named(aside, "start")] == [0, 1]  # the older job's, kept
    finally:
        live.run(["scancel", str(high), *([str(array)] if array else [])], check=False)


def tasks(live, array: int) -> dict[str, str]:
    """The array's tasks still in squeue: task -> state (pending ones listed one by one)."""
    lines = live.run(["squeue", "-h", "-r", "-j", str(array), "-o", "%K %T"]).stdout.split("\n")
    return dict(line.split() for line in lines if line.strip())
