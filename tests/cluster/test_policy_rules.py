"""The HAI scheduling rules on the live local Slurm cluster, with the policy daemon running.

The module applies a test policy (the local cluster's policy.toml with a demotion after
DEMOTE_AFTER seconds) with `hai-admin apply`, runs `hai-admin daemon` beside the tests, and
restores the cluster's own policy at the end. Jobs are plain sbatch; users hai-alice and
hai-bob (bob has the tight per-user quotas of contrib/localcluster/policy.toml).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from slurm_hai.policy.tags import parse
from slurm_hai.slurm.version import SlurmVersion
from waiting import FIRST_START, wait_for

if TYPE_CHECKING:  # the fixtures come from tests/conftest.py
    from conftest import LiveCluster

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
LOCAL_POLICY = REPO / "contrib" / "localcluster" / "policy.toml"
ADMIN = [sys.executable, "-m", "slurm_hai.cli.admin"]
GRACE = 5  # grace_seconds of the local policy
DEMOTE_AFTER = 10
ALICE, BOB = "hai-alice", "hai-bob"
# a step that dies of its suspend notice (SIGTERM, or USR2 from the daemon): the batch shell then ends
PLAIN = "srun sleep 600"
# a step that ignores its suspend notice
# ignores its notice once the trap is set: then it writes {mark} (on every node: the step's tasks)
STUBBORN = "srun bash -c \"trap '' TERM USR2; touch {mark}.\\$SLURM_NODEID; exec sleep 600\""


def admin(c: LiveCluster, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return c.run([*ADMIN, *args], check=check, cwd=REPO)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def policy_file(cluster: LiveCluster, tmp_path_factory) -> Path:
    """The local policy, demoting after DEMOTE_AFTER, its daemon answering why jobs wait."""
    text = LOCAL_POLICY.read_text().replace('after_seconds = "30m"', f"after_seconds = {DEMOTE_AFTER}")
    assert f"after_seconds = {DEMOTE_AFTER}" in text
    text += f'\n[daemon]\nservice = "http://127.0.0.1:{free_port()}"\n'
    path = tmp_path_factory.mktemp("policy") / "policy.toml"
    path.write_text(text)
    admin(cluster, "apply", "--quiet", "--policy", str(path))
    yield path
    admin(cluster, "apply", "--quiet", "--policy", str(LOCAL_POLICY))


@pytest.fixture(scope="module")
def daemon(cluster: LiveCluster, policy_file: Path, tmp_path_factory):
    """`hai-admin daemon` running beside the tests; yields a function returning its log."""
    d = tmp_path_factory.mktemp("daemon")
    log = d / "daemon.log"
    with log.open("w") as out:
        proc = subprocess.Popen([*ADMIN, "daemon", "--policy", str(policy_file), "--interval", "0.5",
                                 "--lock", str(d / "policyd.lock")], env=cluster.env, cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while "policy daemon started" not in log.read_text():
        assert proc.poll() is None, f"the daemon exited {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"the daemon did not start:\n{log.read_text()}"
        time.sleep(0.2)
    yield lambda: log.read_text()
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
    text = log.read_text()
    assert "Traceback" not in text, text


@pytest.fixture
def rules(live: LiveCluster, daemon):
    """The cluster with no jobs, the daemon running; yields (cluster, daemon log)."""
    yield live, daemon


def sbatch(c: LiveCluster, *args: str, user: str = ALICE, wrap: str = PLAIN) -> int:
    return c.sbatch("-o", "/dev/null", "--requeue", *args, "--wrap", wrap, user=user)


def state(c: LiveCluster, job: int) -> str:
    return c.job(job).get("JobState", "")


def running(c: LiveCluster, job: int, timeout: float = FIRST_START, what: str = "to run") -> dict[str, str]:
    return c.wait_job(job, lambda j: j["JobState"] == "RUNNING", timeout, what)


def launched(c: LiveCluster, job: int) -> None:
    """Until the job's first srun step runs on its nodes (sstat reaches its slurmstepd). A job
    cancelled while its step launches leaves its nodes refusing jobs for 30-43 s on 25.11 and
    26.05 (LiveCluster.settle): a test that cancels a job, then waits for its nodes, waits
    for this first."""
    wait_for(lambda: c.run(["sstat", "--noheader", "--parsable2", f"--jobs={job}.0", "--format=JobID"],
                           check=False).stdout.strip(), 30, f"job {job}'s step to run on its nodes")


def explain(c: LiveCluster, policy: Path, job: int) -> str:
    out = admin(c, "explain", "--policy", str(policy), str(job)).stdout
    return out.split(None, 2)[2].strip()




def daemon_lines(log: str, job: int, rule: str) -> list[str]:
    return [line for line in log.splitlines() if re.search(rf"job {job}: \w+.* \[[\w+-]*{rule}[\w+-]*\]", line)]


# ----------------------------------------------------------------- rule 1


def test_higher_level_preempts_lower_which_is_requeued_not_cancelled(rules):
    c, log = rules
    low = sbatch(c, "-N4", "--qos=low")
    running(c, low)
    high = sbatch(c, "-N2", "--qos=high", wrap="sleep 4")
    c.wait_job(high, lambda j: j["JobState"] in ("RUNNING", "COMPLETED"), 40, "the HIGH job to take the nodes")
    # the LOW job died of its notice: it is requeued (same id, one restart), never cancelled
    info = c.wait_job(low, lambda j: j["Restarts"] == "1", 20, "the LOW job's requeue")
    assert info["JobState"] in ("PENDING", "RUNNING", "CONFIGURING"), info
    assert info["QOS"] == "low"
    running(c, low, 40, "the LOW job to run again once the HIGH job is done")
    assert state(c, high) == "COMPLETED"
    assert c.job(low)["Restarts"] == "1"  # requeued once, by exactly one party
    if not SlurmVersion.parse(c.release).requeues_preempted_job_on_exit:
        # before 24.05 (22.05, 23.11) Slurm ends a job that died of its notice FAILED: the daemon requeues it
        assert daemon_lines(log(), low, "requeue-failed"), log()
    else:  # 24.05 and later requeue it themselves (PreemptMode=REQUEUE), and the daemon leaves it be
        assert not daemon_lines(log(), low, "requeue-failed"), log()


# ----------------------------------------------------------------- rule 2


def test_a_later_job_of_the_same_level_never_preempts_whichever_user(rules, policy_file):
    c, log = rules
    first = sbatch(c, "-N4", "--qos=normal", user=ALICE)
    running(c, first)
    by_bob = sbatch(c, "-N1", "--qos=normal", user=BOB)
    by_alice = sbatch(c, "-N1", "--qos=normal", user=ALICE)
    time.sleep(GRACE + 4)  # longer than the grace time and several scheduling passes
    info = c.job(first)
    assert info["JobState"] == "RUNNING" and info["Restarts"] == "0" and not info.get("PreemptTime", "None") \
        .startswith("20"), info
    assert state(c, by_bob) == "PENDING" and state(c, by_alice) == "PENDING"
    assert c.job(by_bob)["QOS"] == "normal.u.hai-bob"  # the same level, through bob's quota variant
    assert explain(c, policy_file, by_bob) == "waiting for 1 node at NORMAL (position 1 in line)"
    assert not [line for line in log().splitlines() if f"job {first}:" in line]


def test_hai_status_and_list_of_a_waiting_job_take_the_daemons_words(rules, policy_file):
    """The daemon answers why a job waits (the policy's [daemon] service): `hai status` and
    `hai list` of bob's waiting job say what `hai-admin explain` says, and read of the queue
    bob's own job(s) alone (a squeue on PATH before Slurm's counts the reads); `hai list --all`
    takes alice's job from the daemon's read."""
    c, log = rules
    first = sbatch(c, "-N4", "--qos=normal", user=ALICE)
    running(c, first)
    waiting = sbatch(c, "-N1", "--qos=normal", user=BOB)
    words = "waiting for 1 node at NORMAL (position 1 in line)"
    wait_for(lambda: explain(c, policy_file, waiting) == words, 30, "Slurm's reason for the waiting job")
    shim = c.shared_dir("squeue-shim", owner=BOB)
    reads, policy = shim / "squeue.log", shim / "policy.toml"
    policy.write_text(policy_file.read_text())  # bob's to read
    (shim / "squeue").write_text(f'#!/bin/sh\necho "$*" >> {reads}\nexec {shutil.which("squeue", path=c.env["PATH"])} "$@"\n')
    (shim / "squeue").chmod(0o755)

    def hai(*argv: str) -> tuple[object, list[str]]:
        reads.unlink(missing_ok=True)
        out = c.run(["env", f"PATH={shim}:{c.env['PATH']}", f"HAI_POLICY={policy}", "hai", *argv, "--json"],
                    user=BOB).stdout
        return json.loads(out), [next(a for a in line.split() if a.startswith(("--jobs=", "--user=")))
                                 if "--jobs=" in line or "--user=" in line else "the whole queue"
                                 for line in (reads.read_text() if reads.exists() else "").splitlines()]

    # the daemon's read of the queue may be a moment older than Slurm's reason for the job: until
    # it has caught up, the command reads the whole queue itself
    st, asked = wait_for(lambda: (r := hai("status", str(waiting)))[1] == [f"--jobs={waiting}"] and r, 30,
                         "hai status to take the daemon's words")
    assert st["reason"] == words and st["state"] == "waiting", st
    rows, asked = hai("list")
    assert asked == [f"--user={BOB}"], asked
    assert [r["reason"] for r in rows if r["job_id"] == waiting] == [words], rows  # (and bob's ended jobs)
    # everyone's: alice's job as the daemon last read it, bob's own from Slurm
    rows, asked = hai("list", "--all")
    assert asked == [f"--user={BOB}"], asked
    shown = {r["job_id"]: r for r in rows}
    assert shown[first]["user"] == ALICE and shown[first]["state"] == "running" and shown[first]["private"], rows
    assert shown[first]["reason"].startswith("running at NORMAL on 4 nodes for"), rows
    assert shown[waiting]["reason"] == words and not shown[waiting]["private"], rows


# ----------------------------------------------------------------- rule 3


def test_fcfs_within_a_level_and_a_requeued_job_keeps_its_place(rules):
    c, log = rules
    first = sbatch(c, "-N4", "--qos=normal", user="root")
    running(c, first)
    later = [sbatch(c, "-N4", "--qos=normal", user="root") for _ in range(2)]
    time.sleep(1.5)  # the requeue below resets `first`'s submit time to a later second than theirs
    # a HIGH job takes two of the nodes: `first` is requeued, its submit time reset
    high = sbatch(c, "-N2", "--qos=high", user=ALICE, wrap="sleep 6")
    c.wait_job(first, lambda j: j["Restarts"] == "1", 40, "the NORMAL job's requeue")
    running(c, high, 30)
    # with the daemon the requeued job is first in its level again: it runs before the later ones
    running(c, first, 60, "the requeued job to run before the later submissions")
    assert [state(c, j) for j in later] == ["PENDING", "PENDING"]
    prio = {j: int(c.job(j)["Priority"]) for j in later}
    assert prio[later[0]] >= prio[later[1]]  # the later ones keep their own order (then by submit time)
    assert daemon_lines(log(), first, "fcfs"), log()


def earlier_and_later(c: LiveCluster, later_user: str) -> tuple[int, int, int]:
    """Alice's earlier NORMAL job waiting for 3 nodes while a later NORMAL 1-node job of
    `later_user` runs, a HIGH blocker holds a fourth node and a VERY_HIGH job the other two:
    (first, later, high). The earlier job is held until the later one runs, and released only
    then: whether Slurm starts a lower job on a node left over while a higher one waits
    (backfill, eligibility) is not what the rule is about. `high` runs until cancelled."""
    blocker = sbatch(c, "-N1", "--qos=high", user="root")  # one node out of reach of the NORMAL jobs
    running(c, blocker)
    first = sbatch(c, "-N3", "--hold", "--qos=normal", user=ALICE)
    later = sbatch(c, "-N1", "--qos=normal", user=later_user)
    running(c, later, 75, "the later job")
    # on the two nodes nobody holds: Slurm 25.11 and 26.05 (CI) once preempted `later` for it
    # though both were idle, a second after an earlier test's jobs had left them
    held = {c.job(blocker)["NodeList"], c.job(later)["NodeList"]}
    free = [n for n in c.run(["sinfo", "-h", "-N", "-o", "%N"]).stdout.split() if n not in held]
    high = sbatch(c, "-N2", f"--nodelist={','.join(free)}", "--qos=very_high", user="root")
    running(c, high, 75, "the VERY_HIGH job")
    launched(c, high)  # the test cancels it and waits for its nodes
    c.run(["scontrol", "release", str(first)])
    c.wait_job(first, lambda j: j["JobState"] == "PENDING" and j["Reason"] in ("Resources", "Priority"), 30,
               "the earlier job to wait for nodes")
    return first, later, high


@pytest.mark.parametrize("later_user", [BOB, ALICE], ids=["other-user", "same-user"])
def test_an_earlier_job_gets_its_nodes_back_from_a_later_job_of_another_user(rules, later_user):
    """HAI orders a level's jobs by job id, running or not; rule 3 exempts only the same user."""
    c, log = rules
    first, later, high = earlier_and_later(c, later_user)
    # the later job's node would not start the earlier job while VERY_HIGH holds two: no yield yet
    time.sleep(2)  # 4 daemon cycles
    assert state(c, later) == "RUNNING" and state(c, first) == "PENDING"
    assert not daemon_lines(log(), later, "yield"), log()
    c.run(["scancel", str(high)])
    if later_user == ALICE:  # her own later job keeps running: the earlier one waits for it
        time.sleep(4)  # 8 daemon cycles: for another user's job it acts within one
        info = c.job(later)
        assert info["JobState"] == "RUNNING" and info["Restarts"] == "0", info
        assert state(c, first) == "PENDING"
        assert not daemon_lines(log(), later, "yield"), log()
        return
    # bob's later job is suspended for it: `first` runs before `later`
    running(c, first, GRACE + 20, "the earlier job to get its nodes back")
    info = c.wait_job(later, lambda j: j["Restarts"] == "1" and j["Reason"] != "JobHeldAdmin"
                      and "hai-yield" not in j["AdminComment"], 20, "the later job to be requeued and released")
    assert info["JobState"] == "PENDING", info  # behind `first` again (the blocker holds the fourth node)
    lines = daemon_lines(log(), later, "yield")
    assert any(f"job {first} of {ALICE}, earlier in line at NORMAL, needs its nodes" in line for line in lines), log()


def array_tasks(c: LiveCluster, array: int) -> dict[str, str]:
    """The tasks of job array `array` that Slurm lists: job id -> state."""
    rows = c.run(["squeue", "--noheader", "--array", f"--jobs={array}", "--format=%A %T"]).stdout.split("\n")
    return dict(row.split() for row in rows if row.strip())


def test_the_tasks_of_a_job_array_keep_the_arrays_place_in_line(rules):
    """A task of an array gets a job id of its own when it starts, later than jobs submitted
    after the array; its place in line is the array's. bob's array (2 tasks), alice's job,
    root's job, in that order, all at NORMAL: root's job and then the array's tasks run, and
    alice's job waits for 2 nodes. The daemon takes them back from root's job, later in line,
    not from bob's tasks, which started last but were submitted first."""
    c, log = rules
    array = sbatch(c, "--array=0-1", "-N1", "--hold", "--qos=normal", user=BOB)
    waiting = sbatch(c, "-N2", "--hold", "--qos=normal", user=ALICE)
    later = sbatch(c, "-N2", "--qos=normal", user="root")
    running(c, later)
    c.run(["scontrol", "release", str(array)])
    tasks = wait_for(lambda: (t := array_tasks(c, array)) and list(t.values()) == ["RUNNING"] * 2 and t, 75,
                     "the array's two tasks to run")
    # the task that started first has an id of its own, after root's job (the last one to start
    # takes the array's record, and its id)
    assert any(int(t) > later for t in tasks) and str(array) in tasks, tasks
    c.run(["scontrol", "release", str(waiting)])
    running(c, waiting, GRACE + 30, "alice's job to get its nodes back")
    info = c.wait_job(later, lambda j: j["Restarts"] == "1", 20, "root's job to be requeued")
    assert any(f"job {waiting} of {ALICE}, earlier in line at NORMAL, needs its nodes" in line
               for line in daemon_lines(log(), later, "yield")), log()
    assert array_tasks(c, array) == tasks, (info, tasks)  # bob's tasks run on, never asked to yield
    assert not [t for t in tasks if daemon_lines(log(), int(t), "yield")], log()


def test_the_task_holding_its_arrays_id_is_started_again_alone(rules):
    """The task of an array that started last holds the array's id as its own, and Slurm acts
    on every task of an array named by that id: an update of its start to every task fails
    for the running ones. Requeued by itself (as a part's task is), it is given its start as
    ARRAY_TASK: it runs again, and the daemon's update failed nowhere and touched no other
    task (each keeps its priority and its run)."""
    c, log = rules
    array = sbatch(c, "--array=0-2", "-N1", "--qos=low")
    tasks = wait_for(lambda: (t := array_tasks(c, array)) and list(t.values()) == ["RUNNING"] * 3 and t, 75,
                     "the array's three tasks to run")
    rows = c.run(["squeue", "--noheader", f"--jobs={array}", "--format=%A %i"]).stdout.split("\n")
    (name,) = [row.split()[1] for row in rows if row.split()[:1] == [str(array)]]
    others = {t: c.job(int(t))["Priority"] for t in tasks if t != str(array)}
    c.run(["scontrol", "requeue", name])
    # (`scontrol show job ARRAY` lists every task: the task is asked for by its name)
    c.wait_job(name, lambda j: j["Restarts"] == "1" and j["JobState"] == "RUNNING", 30, "the task to run again")
    given = [line for line in log().splitlines() if f"job {array}: update StartTime=" in line]
    assert given and not [line for line in log().splitlines() if f"job {array}: update failed" in line], log()
    assert {t: c.job(int(t))["Priority"] for t in others} == others
    assert all(c.job(int(t))["Restarts"] == "0" for t in others) and array_tasks(c, array) == tasks


# ----------------------------------------------------------------- rule 4


def test_quota_per_user_per_level(rules, policy_file):
    c, _ = rules
    # larger than bob's whole NORMAL quota (2 nodes): refused at submission, with a clear message
    p = c.run(["sbatch", "-N3", "--qos=normal", "-o", "/dev/null", "--wrap", "true"], user=BOB, check=False)
    assert p.returncode != 0
    assert "hai: 3 nodes at NORMAL exceed your quota of 2 nodes at that level" in p.stderr, p.stderr
    # within the quota but beyond what is left of it: waits, although nodes are free
    held = sbatch(c, "-N2", "--qos=normal", user=BOB)
    running(c, held)
    over = sbatch(c, "-N1", "--qos=normal", user=BOB)
    c.wait_job(over, lambda j: j["Reason"] == "QOSMaxNodePerUserLimit", 60, "Slurm's quota reason")
    assert explain(c, policy_file, over) == "over quota at NORMAL: 2/2 nodes in use"
    # alice's NORMAL quota is 4 nodes: the whole cluster
    alice = sbatch(c, "-N2", "--qos=normal", user=ALICE)
    running(c, alice)  # bob's quota is his own
    c.run(["scancel", str(held)])
    running(c, over, 30, "bob's job to run once his quota frees")


def test_quota_refusal_four_of_four(rules, policy_file):
    c, _ = rules
    big = sbatch(c, "-N4", "--qos=normal", user=ALICE)
    running(c, big)
    more = sbatch(c, "-N1", "--qos=normal", user=ALICE)
    wait_for(lambda: explain(c, policy_file, more) == "over quota at NORMAL: 4/4 nodes in use", 10,
             "explain to name the quota")
    time.sleep(2)
    assert state(c, more) == "PENDING" and c.job(more)["Reason"] in ("None", "Priority", "Resources",
                                                                     "QOSMaxNodePerUserLimit")


# ----------------------------------------------------------------- rule 5


def test_auto_runs_at_the_highest_level_with_quota_left(rules):
    c, log = rules
    # bob: EXTREME_HIGH 0, VERY_HIGH 0, HIGH 1, ABOVE_NORMAL 1, NORMAL 2 nodes
    first = c.sbatch("-o", "/dev/null", "-N1", "--hai-priority=AUTO", "--wrap", PLAIN, user=BOB)
    running(c, first)
    second = sbatch(c, "-N1", "--qos=auto", user=BOB)
    third = sbatch(c, "-N2", "--qos=auto", user=BOB)
    for job in (second, third):
        running(c, job, 75, "the AUTO job to run at a level with quota")
    assert [c.job(j)["QOS"] for j in (first, second, third)] == \
        ["high.u.hai-bob", "above_normal.u.hai-bob", "normal.u.hai-bob"]
    # the ABOVE_NORMAL job may be demoted (hai-demoted=NORMAL, after 10 s) while the others start
    for job in (first, second, third):
        tags = parse(c.job(job)["AdminComment"])
        assert (tags.pop("hai-level"), tags.pop("hai-grace")) == ("AUTO", "5") and set(tags) <= {"hai-demoted"}, tags
    assert daemon_lines(log(), second, "auto"), log()


def test_a_waiting_auto_job_moves_down_when_its_quota_fills_and_up_when_it_frees(rules):
    """AUTO is decided every cycle (HAI's simple_fifo assigner): the job waits (its --begin)
    while alice's quota at VERY_HIGH (2 nodes) fills and frees again."""
    c, log = rules
    waiting = sbatch(c, "-N2", "--qos=auto", "--begin=now+60")
    qos = lambda: c.job(waiting)["QOS"]  # noqa: E731
    wait_for(lambda: qos() == "very_high", 10, "job_submit.lua to place it at VERY_HIGH (EXTREME_HIGH holds 1)")
    holder = sbatch(c, "-N1", "--qos=very_high")
    running(c, holder)
    wait_for(lambda: qos() == "high", 10, "the daemon to move it down: 1 + 2 nodes exceed VERY_HIGH's 2")
    c.run(["scancel", str(holder)])
    wait_for(lambda: qos() == "very_high", 15, "the daemon to move it back up once the quota is free")
    assert state(c, waiting) == "PENDING" and c.job(waiting)["AdminComment"].split() == ["hai-level=AUTO", "hai-grace=5"]
    assert len(daemon_lines(log(), waiting, "auto")) >= 2, log()


def test_hai_submit_auto_leaves_the_level_to_the_cluster(rules):
    c, _ = rules
    d = c.shared_dir("auto-submit", owner=BOB)
    script = d / "job.sh"
    script.write_text("#!/bin/bash\nsleep 30\n")
    script.chmod(0o700)
    subprocess.run(["chown", BOB, str(script)], check=True)
    out = c.run(["hai-submit", "--json", "-p", "AUTO", str(script)], user=BOB).stdout
    job = int(re.search(r'"job_id": (\d+)', out).group(1))
    info = c.wait_job(job, lambda j: j["JobState"] in ("PENDING", "RUNNING"), 10, "the job")
    # bob: no quota at EXTREME_HIGH and VERY_HIGH, 1 node at HIGH
    assert info["QOS"] == "high.u.hai-bob" and info["AdminComment"].split() == ["hai-level=AUTO", "hai-grace=5"], info


# ----------------------------------------------------------------- rule 6


def test_above_normal_is_demoted_after_its_time_and_back_at_its_level_after_requeue(rules, policy_file):
    c, log = rules
    # two nodes held by a HIGH job that nothing here can preempt; two by alice at ABOVE_NORMAL
    blocker = sbatch(c, "-N2", "--qos=high", user="root")
    running(c, blocker)
    demoted = sbatch(c, "-N2", "--qos=above_normal", user=ALICE)
    started = time.monotonic()
    running(c, demoted)
    waiting = sbatch(c, "-N1", "--qos=above_normal", user=BOB)
    # before its time the same level cannot take its nodes
    time.sleep(max(0.0, DEMOTE_AFTER - 3 - (time.monotonic() - started)))
    assert state(c, demoted) == "RUNNING" and state(c, waiting) == "PENDING"
    # after DEMOTE_AFTER seconds it counts as NORMAL: bob's ABOVE_NORMAL job gets its nodes
    c.wait_job(demoted, lambda j: "hai-demoted=NORMAL" in j.get("AdminComment", "") or j["Restarts"] != "0",
               DEMOTE_AFTER + 10, "the demotion mark")
    running(c, waiting, DEMOTE_AFTER + GRACE + 30, "bob's ABOVE_NORMAL job to take the demoted job's nodes")
    info = c.wait_job(demoted, lambda j: j["Restarts"] == "1" and j["Reason"] != "JobHeldAdmin"
                      and "hai-yield" not in j["AdminComment"], 20, "the demoted job to be requeued and released")
    # back at its submit-time level, no longer demoted, waiting for nodes behind bob's job; the
    # daemon's word on the notice stays in its record for its next run's batch script to read
    told = [t for t in info["AdminComment"].split() if t.startswith("hai-notice=")]
    assert info["QOS"] == "above_normal" and [t for t in info["AdminComment"].split() if t not in told] == [
        "hai-level=ABOVE_NORMAL", "hai-grace=5", f"hai-behind={waiting}"], info
    assert [t.split(":")[:2] for t in told] == [["hai-notice=demoted", str(waiting)]], info
    assert info["JobState"] == "PENDING"
    assert state(c, blocker) == "RUNNING"
    text = log()
    assert daemon_lines(text, demoted, "demote") and daemon_lines(text, demoted, "yield"), text
    # a requeued job whose level was changed gets its submit-time level back
    c.run(["scontrol", "update", f"JobId={demoted}", "QOS=low"])
    c.wait_job(demoted, lambda j: j["QOS"] == "above_normal", 15, "the submit-time level back")
    # earlier in line at ABOVE_NORMAL again, it still never takes back the nodes it gave bob's
    # job (the two traded them every DEMOTE_AFTER seconds before): a cycle decides nothing for it
    dry = admin(c, "daemon", "--policy", str(policy_file), "--once", "--dry-run",
                "--lock", str(policy_file.parent / "dry-run.lock"), check=False)
    assert not daemon_lines(dry.stdout + dry.stderr, waiting, "yield"), dry.stdout + dry.stderr
    assert state(c, waiting) == "RUNNING" and "hai-yield" not in c.job(waiting)["AdminComment"]


# ----------------------------------------------------------------- rule 7


def test_job_ignoring_its_suspend_notice_is_forced_off_after_grace(rules):
    c, log = rules
    mark = c.shared_dir("stubborn") / "trapped"
    mark.parent.chmod(0o777)
    stubborn = sbatch(c, "-N4", "--qos=low", wrap=STUBBORN.format(mark=mark))
    running(c, stubborn)
    # the notice must find the trap set: a job preempted before its step ran died of it at once
    # (seen on 22.05 under load: ended in under a second, neither forced nor requeued by anyone)
    wait_for(lambda: len(list(mark.parent.glob("trapped.*"))) == 4, 60, "the step to ignore its notice", 0.2)
    submitted = time.monotonic()
    high = sbatch(c, "-N2", "--qos=high", user=ALICE, wrap="sleep 2")
    c.wait_job(stubborn, lambda j: j.get("PreemptTime", "None") != "None", 20, "the preemption")
    c.wait_job(stubborn, lambda j: j["JobState"] != "RUNNING", 30, "the job to be forced off")
    forced_after = time.monotonic() - submitted
    # requeued right after the grace time: by the daemon, or by Slurm when one of its
    # scheduling passes comes first (its own periodic grace check alone comes up to 30 s late)
    assert forced_after < GRACE + 8, forced_after
    by_slurm = f"preempted JobId={stubborn} has been requeued" in (c.log_dir / "slurmctld.log").read_text()
    assert by_slurm or daemon_lines(log(), stubborn, "force-requeue"), log()
    c.wait_job(high, lambda j: j["JobState"] in ("RUNNING", "COMPLETED"), 40, "the HIGH job to run")
    info = c.wait_job(stubborn, lambda j: j["Restarts"] == "1", 20, "the requeue")
    assert info["JobState"] != "CANCELLED"


# ----------------------------------------------------------------- requeue limit


def test_job_preempted_many_times_is_never_left_held(rules):
    c, log = rules
    low = sbatch(c, "-N4", "--qos=low")
    for n in range(1, 7):
        running(c, low, 40, f"run {n}")
        high = sbatch(c, "-N1", "--qos=high", user=ALICE, wrap="true")
        c.wait_job(low, lambda j, n=n: int(j["Restarts"]) >= n, 30, f"preemption {n}")
        c.wait_job(high, lambda j: j["JobState"] == "COMPLETED", 40, "the HIGH job to finish")
    info = running(c, low, 40, "the last run")
    assert info["Restarts"] == "6" and info["Reason"] != "JobHoldMaxRequeue"
