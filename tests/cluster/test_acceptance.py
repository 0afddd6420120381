"""Acceptance: the whole story on the live local cluster, with examples/train.py.

What these prove, beyond tests/cluster/test_jobs.py (which covers the protocol pieces with
small probes):
  * three suspends in one job, final weights bitwise equal to an uninterrupted run;
  * kill -9 of the job's processes in the middle of a checkpoint save: the job resumes
    from the last committed checkpoint, the torn save is never used;
  * a node's slurmd stopped and started again (restart alone does not disturb a running
    job; as a node failure it requeues the job, which resumes from the last commit);
  * a job that ignores the notice is forced off after its grace and resumes from its
    last periodic checkpoint;
  * a job that finishes or fails during its preemption grace is never run again;
  * two users with several levels at once: every job finishes, quotas hold, the top
    level is never suspended, no work is lost or done twice;
  * contrib/smoke.sh (the smoke test shared with slurm-docker-cluster) passes here.

The policy daemon (`hai-admin daemon`) runs beside these tests, as in `make demo`.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

import uninterrupted
import waiting
from uninterrupted import TRAIN, same_weights

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
STEPS = 240
# 2 nodes x 2 processes = world size 4; a short sleep per step so suspends land mid-run.
TRAIN_ARGS = ["--nprocs", "2", "--steps", str(STEPS), "--step-sleep", "0.03"]
ALICE, BOB = "hai-alice", "hai-bob"
NO_SLURM = REPO / "tests" / "no_slurm_here.sh"  # a command's container without Slurm


# ----------------------------------------------------------------------------- helpers


def submit(live, script: Path, *opts: str, user: str | None = None, args: list[str] = ()) -> tuple[int, Path]:
    p = live.run(["hai-submit", "--json", "--gpus-per-node", "8", *opts, str(script), "--", *args], user=user)
    info = json.loads(p.stdout)
    live.show_on_failure(Path(info["job_dir"]))
    return info["job_id"], Path(info["job_dir"])


def events(job_dir: Path) -> list[dict]:
    try:
        lines = (job_dir / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def named(job_dir: Path, name: str) -> list[dict]:
    return [e for e in events(job_dir) if e["event"] == name]


def train_lines(job_dir: Path) -> list[str]:
    try:
        text = (job_dir / "logs" / "rank-0.log").read_text(errors="replace")
    except FileNotFoundError:
        return []
    return [line for line in text.splitlines() if line.startswith("[train]")]


def last_step(job_dir: Path) -> int:
    steps = [int(m.group(1)) for line in train_lines(job_dir) for m in [re.search(r" step (\d+)/", line)] if m]
    return steps[-1] if steps else 0


def resumed_from(job_dir: Path) -> list[int]:
    return [int(m.group(1)) for line in train_lines(job_dir) for m in [re.search(r"resumed from step (\d+)", line)]
            if m]


def committed_steps(ckpt: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in ckpt.glob("step-*"))


def wait_for(what: str, cond, timeout: float, interval: float = 0.3):
    """The shared poller (waiting.py), with the description first as these tests read it."""
    return waiting.wait_for(cond, timeout, what, interval)


def wait_final(job_dir: Path, timeout: float) -> dict:
    return wait_for(f"{job_dir} to end", lambda: (job_dir / "final.json").exists()
                    and json.loads((job_dir / "final.json").read_text()), timeout)


def job_pids(job_dir: Path, run: int | None = None) -> list[int]:
    """The user's processes of a job (train.py and its spawned ranks, on every node); of its
    run `run` alone, if given."""
    pids = []
    needle = f"HAI_JOB_DIR={job_dir}".encode()
    of_run = f"HAI_RESTART_COUNT={run}".encode() if run is not None else needle
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if needle in env and of_run in env and (b"train.py" in cmd or b"multiprocessing" in cmd):
            pids.append(int(proc.name))
    return pids


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def reference(cluster) -> Path:
    """The uninterrupted run of TRAIN_ARGS, world size 4 (1 node x 4 processes here; the
    same global ranks and collectives as 2 nodes x 2, which `make demo` shows on Slurm)."""
    args = [a for a in TRAIN_ARGS if a not in ("--step-sleep", "0.03")]
    args[args.index("--nprocs") + 1] = "4"
    return uninterrupted.weights(args)


@contextmanager
def running_daemon(cluster, d: Path, prefix: Sequence[str] = ()) -> Iterator[Path]:
    """`hai-admin daemon` beside the tests (it starts requeued jobs at once), its log in `d`;
    `prefix` runs it elsewhere (in a network namespace). Yields the log."""
    log = d / "daemon.log"
    with log.open("w") as out:
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "slurm_hai.cli.admin", "daemon", "--policy",
                                 str(cluster.state / "etc" / "policy.toml"), "--interval", "0.5", "--lock",
                                 str(d / "policyd.lock")], env=cluster.env, cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT)
    wait_for("the policy daemon", lambda: "policy daemon started" in log.read_text() or proc.poll() is not None, 20)
    assert proc.poll() is None, log.read_text()
    try:
        yield log
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.fixture(scope="module")
def daemon(cluster, tmp_path_factory):
    """The policy daemon beside this module's jobs."""
    with running_daemon(cluster, tmp_path_factory.mktemp("daemon")) as log:
        yield log


@pytest.fixture
def story(live, daemon):
    return live


# ----------------------------------------------------------------------------- tests


def start_nows(daemon_log: Path, job: int) -> list[str]:
    """The daemon's start-now lines for `job` (rules.may_start_now)."""
    return [line for line in daemon_log.read_text().splitlines() if f"job {job}: update StartTime=" in line]


def test_three_suspends_final_weights_bitwise_equal_to_uninterrupted_run(story, daemon, reference):
    job, job_dir = submit(story, TRAIN, "-n", "2", "-p", "LOW", args=TRAIN_ARGS)
    at = 0
    for k in (1, 2, 3):
        # let this run train past the last suspend, then ask for a graceful suspend
        wait_for(f"run {k - 1} to train", lambda: last_step(job_dir) >= at + 20, 90, 0.2)
        story.run(["hai", "suspend", str(job)])
        suspended = wait_for(f"suspend {k}", lambda: len(named(job_dir, "suspended")) >= k and
                             named(job_dir, "suspended"), 60)
        assert suspended[-1]["how"] == "go_suspend"
        commits = [int(m.group(1)) for line in train_lines(job_dir)
                   for m in [re.search(r"checkpoint step (\d+) committed", line)] if m]
        at = commits[-1]
        wait_for(f"run {k} to resume", lambda: len(resumed_from(job_dir)) >= k, 90)
    final = wait_final(job_dir, 180)
    assert final["state"] == "succeeded"
    commits = [int(m.group(1)) for line in train_lines(job_dir)
               for m in [re.search(r"checkpoint step (\d+) committed", line)] if m]
    assert len(commits) == 3 and resumed_from(job_dir) == commits  # each run resumed where the last stopped
    # each requeue ended the run on every node: the daemon cut Slurm's requeue delay short
    assert len([line for line in start_nows(daemon, job) if "ended REQUEUED" in line]) == 3
    assert all(0 < c < STEPS for c in commits)
    assert [e["run"] for e in named(job_dir, "start")] == [0, 1, 2, 3]
    assert same_weights(job_dir / "final-weights.safetensors", reference), "resumed weights differ"


def test_a_job_whose_training_runs_where_no_slurm_command_is_suspends_is_requeued_and_resumes_bitwise(story, reference):
    """As in a container without Slurm (pyxis/enroot, Apptainer; issue 53): train.py runs in
    a user and mount namespace where no Slurm command can be run (tests/no_slurm_here.sh). A
    preemption's notice reaches it, it commits, its go_suspend() asks the launcher to end the
    step (as everywhere: it asks Slurm nothing); the batch script requeues the job, whose next run resumes from
    the commit (in the namespace again) and ends with the uninterrupted run's weights."""
    job, job_dir = submit(story, NO_SLURM, "-n", "2", "-p", "LOW", user=ALICE,
                          args=[sys.executable, str(TRAIN), *TRAIN_ARGS])
    wait_for("run 0 to train", lambda: last_step(job_dir) >= 20, 120, 0.2)
    log = (job_dir / "logs" / "rank-0.log").read_text()
    assert "no_slurm_here: no Slurm command here" in log, log
    high = story.sbatch("-o", "/dev/null", "--qos=normal", "-N4", "--wrap", "sleep 2", user=ALICE)
    suspended = wait_for("the suspend", lambda: named(job_dir, "suspended"), 90)
    assert suspended[0]["run"] == 0 and suspended[0]["how"] == "go_suspend", suspended
    assert [e.get("cause") for e in named(job_dir, "notice")] == ["preempted"]
    assert {e["run"] for e in named(job_dir, "left_for_requeue")} == {0}  # not forced at the grace's end
    assert not named(job_dir, "forced_suspend")
    story.wait_job(high, lambda j: j["JobState"] == "COMPLETED", 90, "the NORMAL job to run")
    final = wait_final(job_dir, 240)
    assert final["state"] == "succeeded", final
    commits = [int(m.group(1)) for line in train_lines(job_dir)
               for m in [re.search(r"checkpoint step (\d+) committed", line)] if m]
    assert len(commits) == 1 and resumed_from(job_dir) == commits and 20 <= commits[0] < STEPS
    assert [e["run"] for e in named(job_dir, "start")] == [0, 1]
    batch_log = (job_dir.parent / f"batch-{job}.log").read_text()
    assert "run 0: suspended (go_suspend); ending the step, the batch script requeues the job" in batch_log
    assert same_weights(job_dir / "final-weights.safetensors", reference), "resumed weights differ"


def test_kill_9_in_the_middle_of_a_save_resumes_from_the_last_committed_checkpoint(story, reference):
    # 32 MiB of ballast in every checkpoint makes a save last long enough to be hit.
    job, job_dir = submit(story, TRAIN, "-n", "2", "-p", "LOW", "--retries", "1",
                          args=[*TRAIN_ARGS, "--ballast-mb", "32", "--save-every", "20"])
    ckpt = job_dir / "checkpoints"
    wait_for("a first committed checkpoint", lambda: committed_steps(ckpt), 90, 0.1)
    staging = wait_for("a save in progress", lambda: [p for p in ckpt.glob(".staging-*")], 60, 0.005)
    pids = job_pids(job_dir)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    committed = committed_steps(ckpt)
    torn = int(re.match(r"\.staging-(\d+)-", staging[0].name).group(1))
    assert pids and torn not in committed and torn > max(committed)
    retry = wait_for("the retry", lambda: named(job_dir, "retry"), 60)
    assert retry[0]["exit_code"] != 0
    final = wait_final(job_dir, 240)
    assert final["state"] == "succeeded"
    assert resumed_from(job_dir) == [max(committed)]  # the newest committed one, not the torn save
    assert not list(ckpt.glob(".staging-*"))  # the torn save was cleaned up, never committed
    assert same_weights(job_dir / "final-weights.safetensors", reference)


def test_slurmd_stopped_and_started_again_job_resumes_from_last_commit(story, daemon, reference):
    job, job_dir = submit(story, TRAIN, "-n", "2", "-p", "LOW", args=TRAIN_ARGS)
    wait_for("training", lambda: last_step(job_dir) >= 40, 90)
    nodes = story.run(["scontrol", "show", "hostnames", story.job(job)["NodeList"]]).stdout.split()
    node = nodes[-1]  # not the batch host

    def start_slurmd() -> None:
        story.node_up(node)
        wait_for(f"{node} back in service", lambda: story.in_service(node), 60, 0.5)

    try:
        # 1. A slurmd restart alone does not disturb the job: its steps run under slurmstepd.
        story.stop_slurmd(node)
        time.sleep(2)
        start_slurmd()
        before = last_step(job_dir)
        wait_for("training to go on", lambda: last_step(job_dir) >= before + 20, 60)
        assert not named(job_dir, "killed") and story.job(job)["Restarts"] == "0"
        # 2. The node lost (slurmd and everything it ran killed) and declared dead (what
        #    slurmctld does after SlurmdTimeout, without the wait): the job is requeued and
        #    runs again from its last commit.
        story.stop_slurmd(node)
        story.lose_node(node)  # every process it ran dies (else its steps live on beside the requeued job)
        story.run(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=acceptance: slurmd stopped"])
        wait_for("the job to be ended on the failed node", lambda: named(job_dir, "killed"), 60)
        committed = committed_steps(job_dir / "checkpoints")
        start_slurmd()
    finally:  # never leave the cluster with a node down, whatever failed above
        if story.slurmd_pid(node) is None:
            story.node_up(node)
        story.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False)
    final = wait_final(job_dir, 240)
    assert final["state"] == "succeeded"
    assert resumed_from(job_dir) == [max(committed)]
    assert same_weights(job_dir / "final-weights.safetensors", reference)
    # requeued by the node's failure: the node gets the old run's kill when it is back, so
    # the daemon left Slurm's requeue delay as it was (a run started there at once was
    # killed by it, or never got its step: seen on 22.05 under load)
    assert start_nows(daemon, job) == []


def test_slurmctld_stopped_between_the_notice_and_the_requeue_job_is_requeued_once(story, reference):
    """slurmctld dies (SIGKILL) while the job commits its suspend checkpoint, so the end of
    its step and its batch script's requeue find no controller (22.05's and 25.11's srun
    returns once every node's launcher has left, and the batch script asks again; 26.05's
    srun waits for a controller to end the step); slurmctld is started again 3 s after every
    launcher has left. The job is requeued once, resumes from its suspend checkpoint, and
    ends bitwise equal."""
    # 64 MiB of ballast: the suspend save lasts long enough for slurmctld to be gone first.
    # --grace 20: the controller's outage (3 s, then `up`) must not run into a forced suspend
    # (25.11's slurmctld takes seconds to come back).
    job, job_dir = submit(story, TRAIN, "-n", "2", "-p", "LOW", "--grace", "20",
                          args=[*TRAIN_ARGS, "--ballast-mb", "64"])
    wait_for("training", lambda: last_step(job_dir) >= 30, 90)
    pid = int((story.state / "run" / "slurmctld.pid").read_text().split()[0])
    try:
        story.run(["hai", "suspend", str(job)])
        wait_for("the notice", lambda: named(job_dir, "notice"), 30, 0.005)
        os.kill(pid, signal.SIGKILL)
        wait_for("every node's launcher to leave", lambda: len(named(job_dir, "left_for_requeue")) >= 2, 90)
        time.sleep(3)
    finally:  # never leave the cluster without its controller
        up = subprocess.run([str(REPO / "contrib" / "localcluster" / "up")], text=True, capture_output=True)
        assert up.returncode == 0, up.stdout + up.stderr
    final = wait_final(job_dir, 240)
    assert final["state"] == "succeeded"
    assert [e["how"] for e in named(job_dir, "suspended")] == ["go_suspend"]  # one suspend
    assert [e["run"] for e in named(job_dir, "start")] == [0, 1]  # one requeue
    commits = [int(m.group(1)) for line in train_lines(job_dir)
               for m in [re.search(r"checkpoint step (\d+) committed", line)] if m]
    assert resumed_from(job_dir) == commits[-1:] and commits
    assert same_weights(job_dir / "final-weights.safetensors", reference)


IGNORES_NOTICE = """
    import os, sys, time
    import torch
    import slurm_hai as hai
    from slurm_hai.checkpoint import CheckpointManager

    # Never polls receive_suspend_command(): it only checkpoints every 10 steps.
    w = torch.zeros(1, dtype=torch.float64)
    mgr = CheckpointManager(os.path.join(os.environ["HAI_JOB_DIR"], "ckpt"))
    state = {"w": w, "step": 0}
    loaded = mgr.load()
    if loaded is not None:
        w.copy_(loaded["w"]); state["step"] = loaded["step"]
    print(f"run {hai.restart_count()} starts at step {state['step']}", flush=True)
    while state["step"] < 60:
        state["step"] += 1
        w.mul_(1.01).add_(state["step"])           # any deterministic update
        if state["step"] % 10 == 0:
            mgr.save(state["step"], {"w": w, "step": state["step"]})
        time.sleep(0.1)
    print(f"done w={w.item()!r}", flush=True)
"""


def test_job_that_ignores_the_notice_is_forced_off_and_resumes_from_its_last_checkpoint(story, tmp_path):
    d = story.shared_dir("ignores-notice")
    script = d / "job.py"
    script.write_text(textwrap.dedent(IGNORES_NOTICE))
    job, job_dir = submit(story, script, "-n", "1", "-p", "LOW", "--grace", "2")
    wait_for("a checkpoint", lambda: committed_steps(job_dir / "ckpt"), 60)
    time.sleep(0.5)
    story.run(["hai", "suspend", str(job)])
    forced = wait_for("the forced suspend", lambda: named(job_dir, "forced_suspend"), 30)
    notice = named(job_dir, "notice")[0]
    assert 2 <= forced[0]["t"] - notice["t"] < 3.5
    committed = committed_steps(job_dir / "ckpt")  # the job never saved after the notice
    final = wait_final(job_dir, 120)
    assert final["state"] == "succeeded"
    log = (job_dir / "logs" / "rank-0.log").read_text()
    starts = [int(s) for s in re.findall(r"run \d+ starts at step (\d+)", log)]
    assert starts == [0, max(committed)]
    expected = 0.0
    for step in range(1, 61):
        expected = expected * 1.01 + step
    assert f"done w={expected!r}" in log  # the same number as an uninterrupted run


ENDS_ON_NOTICE = """
    import os, sys, time
    from pathlib import Path
    import slurm_hai as hai

    code = int(sys.argv[1])  # exit code to end with when the notice comes; -1: just run 3 s
    rank = int(os.environ["RANK"])
    ending = Path(os.environ["HAI_JOB_DIR"]) / "ending"  # rank 0 tells the other nodes
    if rank == 0:
        print(f"ran run={hai.restart_count()}", flush=True)
    if code < 0:
        time.sleep(3)
        sys.exit(0)
    while True:
        if rank == 0 and hai.receive_suspend_command():
            print(f"notice: exiting {code} instead of suspending", flush=True)
            ending.write_text(str(code))
            sys.exit(code)
        if rank != 0 and ending.exists():
            sys.exit(int(ending.read_text()))
        time.sleep(0.05)
"""


def test_job_that_finishes_or_fails_during_its_grace_is_never_run_again(story):
    d = story.shared_dir("ends-in-grace")
    script = d / "job.py"
    script.write_text(textwrap.dedent(ENDS_ON_NOTICE))
    ok, ok_dir = submit(story, script, "-n", "2", "-p", "LOW", args=["0"])
    bad, bad_dir = submit(story, script, "-n", "2", "-p", "LOW", args=["3"])
    for job_dir in (ok_dir, bad_dir):
        wait_for("both LOW jobs to run", lambda j=job_dir: "ran run=0" in (j / "logs" / "rank-0.log").read_text()
                 if (j / "logs" / "rank-0.log").exists() else False, 60)
    # A NORMAL job needing all 4 nodes preempts both; each ends during its grace period,
    # which Slurm answers with a requeue: the rerun must not run the user's code again.
    normal, normal_dir = submit(story, script, "-n", "4", "-p", "NORMAL", args=["-1"])
    wait_for("the NORMAL job to run", lambda: named(normal_dir, "start"), 90)
    assert wait_final(ok_dir, 30)["state"] == "succeeded"
    failed = wait_final(bad_dir, 30)
    assert failed["state"] == "failed" and failed["exit_code"] != 0
    assert wait_final(normal_dir, 60)["state"] == "succeeded"
    time.sleep(8)  # the nodes are free again: a rerun of the user's code would start now
    for job, job_dir in ((ok, ok_dir), (bad, bad_dir)):
        log = (job_dir / "logs" / "rank-0.log").read_text()
        assert log.count("ran run=") == 1, log  # the user's code ran once
        assert not named(job_dir, "retry") and not named(job_dir, "suspended")
        assert story.job(job).get("JobState") in ("COMPLETED", "FAILED", "")


WORKER = """
    import os, sys, time
    import slurm_hai as hai

    units = int(sys.argv[1])  # half-second units of work; progress kept in the whole-life state
    rank = int(os.environ["RANK"])
    done = hai.get_whole_life_state()
    if rank == 0:
        print(f"run {hai.restart_count()} starts at unit {done}", flush=True)
    while done < units:
        if rank == 0 and hai.receive_suspend_command():
            print(f"suspending at unit {done}", flush=True)
            hai.go_suspend()
        time.sleep(0.5)
        if rank == 0:
            done += 1
            hai.set_whole_life_state(done)
        else:
            done = hai.get_whole_life_state()
    if rank == 0:
        print(f"finished {done} units", flush=True)
"""


def test_two_users_with_several_levels_nothing_starves_no_rule_broken(story):
    scripts = {}
    for user in (ALICE, BOB):
        d = story.shared_dir(f"users-{user}", owner=user)
        scripts[user] = d / "worker.py"
        scripts[user].write_text(textwrap.dedent(WORKER))
        pw = pwd.getpwnam(user)
        os.chown(scripts[user], pw.pw_uid, pw.pw_gid)
    quota = {(ALICE, "high"): 2, (BOB, "high"): 1, (ALICE, "normal"): 4, (BOB, "normal"): 2}

    jobs: dict[int, dict] = {}

    def sub(user: str, level: str, nodes: int, units: int) -> None:
        job, job_dir = submit(story, scripts[user], "-n", str(nodes), "-p", level, user=user, args=[str(units)])
        jobs[job] = {"user": user, "level": level, "nodes": nodes, "units": units, "dir": job_dir}

    sub(BOB, "LOW", 2, 16)
    sub(ALICE, "LOW", 2, 16)
    time.sleep(3)
    # beyond bob's HIGH quota (1 node): refused at once, with a one-line reason
    refused = story.run(["hai-submit", "-n", "2", "-p", "HIGH", str(scripts[BOB])], user=BOB, check=False)
    assert refused.returncode != 0 and "quota" in refused.stderr and "Traceback" not in refused.stderr
    sub(ALICE, "HIGH", 2, 6)
    sub(BOB, "HIGH", 1, 6)
    sub(BOB, "NORMAL", 2, 4)
    sub(ALICE, "LOW", 1, 4)  # the same level as her running LOW job: waits, never preempts it

    violations = []
    deadline = time.monotonic() + 200
    while not all((j["dir"] / "final.json").exists() for j in jobs.values()):
        assert time.monotonic() < deadline, "starvation: " + ", ".join(
            f"{jid} ({j['user']} {j['level']})" for jid, j in jobs.items() if not (j["dir"] / "final.json").exists())
        out = story.run(["squeue", "-h", "-t", "R", "-o", "%u|%q|%D"], check=False).stdout
        used: dict[tuple[str, str], int] = {}
        for line in out.splitlines():
            user, qos, n = line.split("|")
            key = (user, qos.split(".u.")[0])
            used[key] = used.get(key, 0) + int(n)
        violations += [(k, n) for k, n in used.items() if n > quota.get(k, 99)]
        time.sleep(0.5)
    assert not violations, f"quota exceeded: {violations}"
    for jid, j in jobs.items():
        final = json.loads((j["dir"] / "final.json").read_text())
        assert final["state"] == "succeeded", (jid, j, final)
        log = (j["dir"] / "logs" / "rank-0.log").read_text()
        assert f"finished {j['units']} units" in log  # all the work, exactly once
        starts = [int(s) for s in re.findall(r"starts at unit (\d+)", log)]
        assert starts == sorted(starts), log  # never went back
        if j["level"] == "HIGH":
            assert not named(j["dir"], "notice"), f"the top level was suspended: {jid}"
    low_suspends = sum(len(named(j["dir"], "suspended")) for j in jobs.values() if j["level"] == "LOW")
    assert low_suspends >= 1  # the HIGH jobs did take LOW nodes


def test_smoke_script_shared_with_slurm_docker_cluster_passes_here(story):
    d = story.shared_dir("smoke")
    env = {**story.env, "SMOKE_DIR": str(d), "HAI_HOME": str(d / "hai")}
    p = subprocess.run(["bash", str(REPO / "contrib" / "smoke.sh")], env=env, text=True, capture_output=True,
                       timeout=240, cwd=d)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SMOKE PASSED" in p.stdout


def test_slurm_docker_rendered_policy_is_up_to_date(tmp_path):
    """contrib/slurm-docker/rendered/ is what `hai-admin render` makes of its policy.toml."""
    here = REPO / "contrib" / "slurm-docker"
    subprocess.run([sys.executable, "-m", "slurm_hai.cli.admin", "render", "--policy", "policy.toml",
                    "--out", str(tmp_path), "--spank-plugin", "/usr/lib64/slurm/hai_spank.so"],
                   check=True, capture_output=True, cwd=here)
    for path in tmp_path.iterdir():
        assert (here / "rendered" / path.name).read_text() == path.read_text(), (
            f"contrib/slurm-docker/rendered/{path.name} is stale: re-render it (see contrib/slurm-docker/README.md)")
