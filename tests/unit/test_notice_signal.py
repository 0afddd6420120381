"""The policy's notice_signal (USR1, USR2 or TERM) is the job's suspend notice end to end,
without Slurm: the sbatch script asks Slurm for it (--signal) and hands it to the batch
script, the step ignores it until the launcher listens, the rank-0 launcher takes it as the
notice (the flag turns 1) and lives on, other nodes' launchers ignore it, and `hai suspend`
sends it. Before, the job side knew only USR2: a USR1 or TERM notice killed the launcher
(exit 138 or 143) and the job was recorded failed for good."""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_hai.jobs import control
from slurm_hai.jobs.jobdir import JobDir
from slurm_hai.jobs.request import JobRequest, render_script, validate
from slurm_hai.policy.limits import NOTICE_SIGNALS
from slurm_hai.policy.model import parse_policy
from slurm_hai.runtime.batch import launcher_argv, untold_cause
from slurm_hai.runtime.protocol import LEAVE_SIGNAL
from slurm_hai.runtime import launcher
from slurm_hai.runtime.launcher import NodeRun, _why_notice, notice_lost_at_start, notice_signals
from slurm_hai.slurm.records import JobInfo


def rendered(sig: str, term_is_notice: bool = False) -> tuple[dict, str]:
    request = JobRequest(script="train.py", job_root="/home/u/.hai/jobs")
    context = validate(request, parse_policy({"notice_signal": sig}))
    return context, render_script(context, term_is_notice=term_is_notice)


def batch_options(script: str) -> list[str]:
    """The options the sbatch script gives `python -m slurm_hai.runtime.batch`."""
    argv = shlex.split(next(line for line in script.splitlines() if line.startswith("exec ")))
    options = argv[argv.index("slurm_hai.runtime.batch") + 1:]
    return options[:options.index("--")]


@pytest.mark.parametrize("sig", NOTICE_SIGNALS)
def test_the_sbatch_script_asks_slurm_for_the_policys_signal_and_hands_it_to_the_batch_script(sig):
    context, script = rendered(sig)
    assert f"#SBATCH --signal={sig}@{context['notice_seconds']}\n" in script
    assert script.count("--signal=") == 1
    assert f"--notice-signal={sig}" in batch_options(script) and "--term-is-notice" not in batch_options(script)
    # without preempt_send_user_signal Slurm's preemption notice is SIGTERM, besides the policy's
    assert {f"--notice-signal={sig}", "--term-is-notice"} <= set(batch_options(rendered(sig, True)[1]))
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


PROBE = ("import signal; print(' '.join(n for n in ('USR1', 'USR2', 'TERM') "
         "if signal.getsignal(getattr(signal, 'SIG' + n)) == signal.SIG_IGN))")


@pytest.mark.parametrize("sig", NOTICE_SIGNALS)
@pytest.mark.parametrize("term_is_notice", [False, True])
def test_the_step_ignores_exactly_the_notice_signals_and_tells_the_launcher_which(sig, term_is_notice):
    argv = launcher_argv(argparse.Namespace(job_dir="/x", grace=5, notice_signal=sig, term_is_notice=term_is_notice),
                         ["cmd"])
    at = argv.index("slurm_hai.runtime.launcher") - 2
    launcher = argv[at:at + argv[at:].index("--")]
    assert launcher[:3] == [sys.executable, "-m", "slurm_hai.runtime.launcher"]
    assert f"--notice-signal={sig}" in launcher and ("--term-is-notice" in launcher) == term_is_notice
    wrapper = argv[:at]  # the part before the launcher's interpreter: the shell
    assert sys.executable not in wrapper
    notices = {sig} | ({"TERM"} if term_is_notice else set())
    out = subprocess.run([*wrapper, sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    assert set(out.stdout.split()) == notices, out


# ----------------------------------------------------------------------------- a real launcher

CHILD = """
import os, sys, time
flag = os.environ.get("HAI_SUSPEND_FLAG")
open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])  # started: its pid
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    if open(flag).read() == "1" if flag else os.path.exists(sys.argv[2]):  # rank 0: the notice; else our word
        sys.exit(0)
    time.sleep(0.01)
sys.exit(3)
"""


def signal_bits(pid: int, field: str) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(field + ":")), 16)


def wait_for(what, why: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {why}")
        time.sleep(0.005)


def run_launcher(tmp_path: Path, sig: str, node_id: int) -> tuple[int, JobDir]:
    """Start a launcher for node `node_id` of a 2-node job as Slurm's step would (no Slurm:
    a fake squeue answers the notice's cause), send it and its command `sig` once it listens,
    and let the command end (rank 0's on the flag; another's on our word once the signal is in).
    Returns the launcher's exit code and the job directory."""
    jobdir = JobDir(tmp_path / "7").create()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text("#!/bin/sh\n")  # an empty queue
    (bin_dir / "squeue").chmod(0o755)
    (tmp_path / "policy.toml").write_text(f'notice_signal = "{sig}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HAI_"))}
    env.update(PATH=f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}", HAI_SLURM_BACKEND="cli",
               HAI_POLICY=str(tmp_path / "policy.toml"), HAI_MASTER_IP="127.0.0.1", SLURM_JOB_ID="7",
               SLURM_NODEID=str(node_id), SLURM_NNODES="2", OMP_NUM_THREADS="1")
    started, done = tmp_path / "child.pid", tmp_path / "done"
    p = subprocess.Popen([sys.executable, "-m", "slurm_hai.runtime.launcher", f"--job-dir={jobdir.path}", "--grace=30",
                          f"--notice-signal={sig}", "--", sys.executable, "-c", CHILD, str(started), str(done)],
                         env=env)
    bit = 1 << (signal.Signals[f"SIG{sig}"] - 1)
    try:
        wait_for(lambda: p.poll() is not None or (started.exists() and signal_bits(p.pid, "SigCgt") & bit),
                 f"the launcher to listen for SIG{sig}")
        assert p.poll() is None, "the launcher ended before its command"
        child = int(started.read_text())
        assert signal_bits(child, "SigIgn") & bit  # the command ignores the notice: Slurm signals it too
        for pid in (p.pid, child):
            os.kill(pid, signal.Signals[f"SIG{sig}"])
        wait_for(lambda: p.poll() is not None or not signal_bits(p.pid, "ShdPnd") & bit,  # delivered
                 f"the launcher to take SIG{sig}")
        done.touch()
        rc = p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for record in (jobdir.path / "node-memory").glob("*"):  # the run's directory in /dev/shm
            shutil.rmtree(record.read_text().strip(), ignore_errors=True)
    return rc, jobdir


@pytest.mark.parametrize("sig", NOTICE_SIGNALS)
def test_the_rank_0_launcher_takes_the_policys_signal_as_the_notice_and_lives_on(tmp_path, sig):
    rc, jobdir = run_launcher(tmp_path, sig, node_id=0)
    assert rc == 0  # the command ended of the flag; before: 138 (USR1) or 143 (TERM), a failed job
    [notice] = [e for e in jobdir.events() if e["event"] == "notice"]
    assert notice["run"] == 0 and notice["source"] == ("sigterm" if sig == "TERM" else "signal")


@pytest.mark.parametrize("sig", NOTICE_SIGNALS)
def test_another_nodes_launcher_ignores_the_policys_signal(tmp_path, sig):
    rc, jobdir = run_launcher(tmp_path, sig, node_id=1)
    assert rc == 0 and not [e for e in jobdir.events() if e["event"] == "notice"]


def test_where_term_is_the_notice_the_first_sigterm_is_the_notice_and_a_later_one_ends_the_run(tmp_path):
    jobdir = JobDir(tmp_path / "7").create()
    node = NodeRun([sys.executable, "-c", "import time; time.sleep(60)"], {**os.environ, "OMP_NUM_THREADS": "1"},
                   jobdir, 0, 0, 30.0, notice_signals("TERM", False),
                   flag=tmp_path / "flag")
    node.start()
    try:
        assert signal_bits(node.child.pid, "SigIgn") & (1 << (signal.SIGTERM - 1))
        node.handle(signal.SIGTERM)
        assert (tmp_path / "flag").read_text() == "1" and node.ending_at is None
        node.handle(signal.SIGTERM)
        assert node.ending_at is not None  # the command ignores SIGTERM: it gets SIGKILL
        assert node.child.wait(10) == -signal.SIGKILL
    finally:
        if node.child.poll() is None:
            node.child.kill()
            node.child.wait()


def test_a_time_limit_notice_due_at_the_jobs_start_is_taken_when_the_launcher_listens(tmp_path):
    """Slurm sends a short limit's notice at the job's start, to steps that are not there yet
    (seen on 26.05: a 60 s job, notice 35 s before its end, killed at its limit): the rank-0
    launcher takes the notice itself once its handlers are in place. A job of a longer limit
    waits for Slurm's signal."""
    def job(limit: float) -> JobInfo:
        return JobInfo(job_id=7, name="x", user="u", state="RUNNING", reason="None", qos="LOW", partition="p",
                       num_nodes=1, node_list="n1", restart_count=0, submit_time=1000, start_time=1000,
                       eligible_time=1000, priority=1, end_time=int(1000 + limit))

    assert notice_lost_at_start(job(60), grace=5) and notice_lost_at_start(job(80), grace=5)
    assert not notice_lost_at_start(job(81), grace=5) and not notice_lost_at_start(job(3600), grace=5)
    assert not notice_lost_at_start(None, grace=5)
    for lost, expected in ((True, ["notice"]), (False, [])):
        jobdir = JobDir(tmp_path / str(lost)).create()
        node = NodeRun([sys.executable, "-c", "pass"], {**os.environ, "OMP_NUM_THREADS": "1"}, jobdir, 0, 0, 30.0,
                       notice_signals("USR1", False), flag=tmp_path / f"flag-{lost}",
                       notice_lost=lambda lost=lost: lost)
        node.start()
        assert node.wait() == 0
        notices = [e for e in jobdir.events() if e["event"] == "notice"]
        assert [e["event"] for e in notices] == expected
        assert all(e["source"] == "time_limit_at_start" for e in notices)


@pytest.mark.parametrize("sig", NOTICE_SIGNALS)
def test_hai_suspend_sends_the_policys_notice_signal(tmp_path, sig):
    sent = []

    class Slurm:
        def cancel(self, job_id, signal=None):
            sent.append((job_id, signal))

    jobdir = JobDir(tmp_path / "7").create()
    control.request_suspend(Slurm(), 7, 0, jobdir, writable=True, notice_signal=sig)
    assert sent == [(7, sig)] and [e["event"] for e in jobdir.events()] == ["suspend_requested"]


def test_the_notices_cause_is_asked_of_slurm_before_the_flag_and_read_after_it(tmp_path):
    """A job that suspends within milliseconds of its flag requeues itself at once: Slurm's
    queue read after that shows it requeued, not preempted (CI: cause 'unknown'). The read
    starts before the flag is set, its answer is taken after: the job learns of the notice
    no later than it would without the question."""
    jobdir = JobDir(tmp_path / "7").create()
    flag = tmp_path / "flag"
    seen = []

    def ask():
        seen.append(("asked", flag.read_text()))

        def answer():
            seen.append(("read", flag.read_text()))
            return {"cause": "preempted", "by_job": 8, "target_size": 0}, None
        return answer

    node = NodeRun([sys.executable, "-c", "pass"], {**os.environ, "OMP_NUM_THREADS": "1"}, jobdir, 0, 0, 30.0,
                   notice_signals("USR1", False), flag=flag, why_notice=ask)
    node.start()
    node.notice("signal")
    assert node.wait() == 0
    assert seen == [("asked", "0"), ("read", "1")]
    assert [(e["cause"], e["by_job"]) for e in jobdir.events() if e["event"] == "notice"] == [("preempted", 8)]


class OwnRecord:
    """A Slurm that knows one job, whose record changes as `records` says; it has no queue
    to give (no jobs()): the launcher asks for its own job alone."""

    name = "test"  # not the commands backend: no squeue started ahead

    def __init__(self, *records: JobInfo) -> None:
        self.records = list(records)
        self.asked: list[int] = []

    def job(self, job_id: int) -> JobInfo:
        self.asked.append(job_id)
        return self.records.pop(0) if len(self.records) > 1 else self.records[0]


def preempted(admin_comment: str = "") -> JobInfo:
    return JobInfo(job_id=7, name="x", user="u", state="RUNNING", reason="None", qos="low", partition="p",
                   num_nodes=4, node_list="n[1-4]", restart_count=0, submit_time=1000, start_time=1000,
                   eligible_time=1000, priority=1, preempt_time=1100, end_time=0, admin_comment=admin_comment)


def test_a_preemption_by_slurm_is_journalled_at_once_and_the_daemons_word_from_the_jobs_own_record_after(tmp_path):
    jobdir = JobDir(tmp_path / "7").create()
    tagged = preempted("hai-level=LOW hai-nodes=2:4:1 hai-notice=preempted:12:HIGH:2@1100")
    slurm = OwnRecord(preempted(), preempted(), tagged)  # the daemon tags it a moment after the notice
    node = NodeRun([sys.executable, "-c", "import time; time.sleep(60)"], {**os.environ, "OMP_NUM_THREADS": "1"},
                   jobdir, 0, 0, 30.0, notice_signals("USR1", False), flag=tmp_path / "flag",
                   why_notice=lambda: _why_notice(slurm, 7, jobdir, 0, 30.0))
    node.start()
    try:
        node.notice("signal")
        [notice] = [e for e in jobdir.events() if e["event"] == "notice"]
        assert notice["cause"] == "preempted" and "by_job" not in notice and "target_size" not in notice
        wait_for(lambda: [e for e in jobdir.events() if e["event"] == "notice_cause"], "the daemon's word")
        told = [e for e in jobdir.events() if e["event"] == "notice_cause"]
        assert [{k: e[k] for k in ("run", "cause", "by_job", "by_level", "target_size")} for e in told] == [
            {"run": 0, "cause": "preempted", "by_job": 12, "by_level": "HIGH", "target_size": 2}]
        assert set(slurm.asked) == {7}
    finally:
        node.child.kill()
        node.child.wait()


def test_the_daemons_word_already_in_the_record_is_the_notice_and_no_later_look_is_made(tmp_path):
    jobdir = JobDir(tmp_path / "7").create()
    slurm = OwnRecord(preempted("hai-notice=grow:::4@1100"))
    cause, later = _why_notice(slurm, 7, jobdir, 0, 30.0)()
    assert (cause, later) == ({"cause": "grow", "target_size": 4}, None)
    # a tag of an earlier run: Slurm's preempt time of this one, the word still to come
    cause, later = _why_notice(OwnRecord(preempted("hai-notice=grow:::4@999")), 7, jobdir, 0, 30.0)()
    assert cause == {"cause": "preempted"} and later is not None


def test_a_run_that_left_before_the_daemons_word_gets_it_from_its_next_runs_own_record(tmp_path):
    """No wait on the suspend path: the daemon keeps the tag while the job waits, and the
    next run's batch script journals it for the run before (runtime/batch.py)."""
    jobdir = JobDir(tmp_path / "7").create()
    jobdir.event("start", run=0, t=1001)
    jobdir.event("notice", run=0, cause="preempted", grace=30.0, t=1100.2)  # the word still to come
    jobdir.event("suspended", run=0, how="go_suspend", t=1100.4)

    def next_run(admin_comment: str) -> JobInfo:
        return dataclasses.replace(preempted(admin_comment), restart_count=1, start_time=1200, preempt_time=0)

    slurm = OwnRecord(next_run("hai-notice=preempted:12:HIGH:0@1100"))
    assert untold_cause(slurm, 7, jobdir.events(), 1) == {"cause": "preempted", "by_job": 12, "by_level": "HIGH",
                                                           "target_size": 0}
    assert slurm.asked == [7]
    for not_of_run_0 in ("hai-notice=preempted:13:HIGH:0@1200",  # the new run's own
                         "hai-notice=grow:::4@900", ""):  # a run's before, none
        assert untold_cause(OwnRecord(next_run(not_of_run_0)), 7, jobdir.events(), 1) is None
    jobdir.event("notice_cause", run=0, cause="preempted", by_job=12, by_level="HIGH", target_size=0)
    told = OwnRecord(next_run("hai-notice=preempted:12:HIGH:0@1100"))
    assert untold_cause(told, 7, jobdir.events(), 1) is None and told.asked == []  # its launcher heard it: no read


def test_the_launcher_reads_neither_the_queue_nor_the_policy():
    """The daemon decides a notice's cause once; a node reads only its own job's record."""
    tree = ast.parse(Path(launcher.__file__).read_text())
    called = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
              for n in ast.walk(tree) if isinstance(n, ast.Call)}
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "job" in called and not {"jobs", "find_policy", "load_policy"} & (called | imported)


@pytest.mark.parametrize("slurm_here", [False, True])
@pytest.mark.parametrize("node_id", [0, 1])
def test_go_suspend_ends_the_step_for_the_batch_script_to_requeue_and_asks_slurm_nothing(tmp_path, node_id,
                                                                                          slurm_here):
    # The batch script alone requeues a run (runtime/protocol.py): go_suspend() asks rank 0's
    # launcher through the flag, another node's by leaving; the launcher ends its command (a
    # sibling process too) and exits 0, so that srun's --kill-on-bad-exit does not end the
    # step (the batch script's LEAVE_SIGNAL does). Neither asks Slurm for anything, whether
    # Slurm's commands are there or not (a container without them: issue 53).
    jobdir = JobDir(tmp_path / "7").create()
    empty = tmp_path / "bin"
    empty.mkdir()
    calls = tmp_path / "slurm-calls"
    for command in ("scontrol", "scancel", "squeue", "sacct", "srun", "sbatch") if slurm_here else ():
        stub = empty / command
        stub.write_text(f"#!/bin/sh\necho {command} \"$@\" >> {calls}\nexit 1\n")
        stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HAI_"))}
    env.update(PATH=str(empty), HAI_SLURM_BACKEND="cli", HAI_MASTER_IP="127.0.0.1", SLURM_JOB_ID="7",
               SLURM_NODEID=str(node_id), SLURM_NNODES="2", OMP_NUM_THREADS="1")
    sibling = tmp_path / "sibling.pid"
    child = ("import os, subprocess, sys, time\n"
             f"s = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
             f"open({str(sibling)!r}, 'w').write(str(s.pid))\n"
             "from slurm_hai.runtime.client import go_suspend\n"
             "go_suspend()\n"
             "print('go_suspend returned')\n")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "slurm_hai.runtime.launcher", f"--job-dir={jobdir.path}", "--grace=300",
                        "--", sys.executable, "-c", child], env=env, text=True, capture_output=True, timeout=120)
    try:
        assert p.returncode == 0 and time.monotonic() - t0 < 60, (p.returncode, p.stderr)
        assert "go_suspend returned" not in jobdir.rank_log(node_id).read_text()
        assert "the batch script requeues the job" in p.stderr, p.stderr
        events = [(e["event"], e["run"]) for e in jobdir.events()]
        assert ("go_suspend", 0) in events and ("left_for_requeue", 0) in events, events
        asked = calls.read_text() if calls.exists() else ""
        assert "requeue" not in asked and "scancel" not in asked, asked
        pid = int(sibling.read_text())
        wait_for(lambda: not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2],
                 "the command's other process to end")
    finally:
        for record in (jobdir.path / "node-memory").glob("*"):
            shutil.rmtree(record.read_text().strip(), ignore_errors=True)


def test_no_go_suspend_within_the_grace_the_launcher_ends_the_command_itself_and_marks_the_run_forced(tmp_path):
    # The forced suspend asks Slurm nothing either (the launcher takes no Slurm call): rank 0's
    # launcher marks the run and ends the command (TERM, which it does not ignore); the batch
    # script sees the mark, ends the step (LEAVE_SIGNAL) and requeues the forced run.
    jobdir = JobDir(tmp_path / "8").create()
    flag = tmp_path / "flag"
    node = NodeRun([sys.executable, "-c", "import time; time.sleep(600)"], {**os.environ, "OMP_NUM_THREADS": "1"},
                   jobdir, 0, 0, 0.3, notice_signals("USR2", False), flag=flag)
    node.start()
    node.notice("signal")
    t0 = time.monotonic()
    rc = node.wait()
    assert node.forced and rc == 128 + signal.SIGTERM and 0.3 <= time.monotonic() - t0 < 10, rc
    assert jobdir.suspended(0) == "forced"
    assert [e["event"] for e in jobdir.events()] == ["notice", "forced_suspend"]


@pytest.mark.parametrize("how", ["go_suspend", "forced"])
def test_a_node_whose_command_did_not_suspend_ends_it_once_the_run_is_marked(tmp_path, how):
    # another node's rank called go_suspend(), or rank 0's launcher forced the run: this
    # node's launcher sees the run's marker and ends its command itself, so the step ends on
    # every node even where srun cannot ask slurmctld to end it (a controller away)
    jobdir = JobDir(tmp_path / "9").create()
    node = NodeRun([sys.executable, "-c", "import time; time.sleep(600)"], {**os.environ, "OMP_NUM_THREADS": "1"},
                   jobdir, 0, 1, 30.0, notice_signals("USR2", False), flag=None)
    node.start()
    jobdir.mark_suspend(0, how)
    t0 = time.monotonic()
    rc = node.wait()
    assert node.left and rc == 128 + signal.SIGTERM and time.monotonic() - t0 < 10, rc
    assert [(e["event"], e["rank"]) for e in jobdir.events()] == [("left_for_requeue", 1)]


def test_the_batch_scripts_leave_signal_ends_another_nodes_command_and_its_launcher_exits_0(tmp_path):
    # The batch script sends the step LEAVE_SIGNAL once the run is marked suspended (StepWatch):
    # each node's launcher leaves then, before it could see the marker, and exits 0, so that
    # srun's --kill-on-bad-exit never ends the step (its kill delays the nodes' cleanup of
    # the step's cgroup, which the next run's step needs). The command ignores the signal.
    jobdir = JobDir(tmp_path / "10").create()
    started = tmp_path / "started"
    child = f"import time; open({str(started)!r}, 'w').close(); time.sleep(600)"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HAI_"))}
    env.update(HAI_MASTER_IP="127.0.0.1", SLURM_JOB_ID="10", SLURM_NODEID="1", SLURM_NNODES="2",
               OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "slurm_hai.runtime.launcher", f"--job-dir={jobdir.path}",
                          "--grace=300", "--", sys.executable, "-c", child], env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: started.exists() and any(jobdir.path.glob("logs/rank-1.log")), "the command to start")
        # sent again until the launcher ends: its handlers come just after the command's start
        for _ in range(100):
            p.send_signal(signal.Signals[f"SIG{LEAVE_SIGNAL}"])
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(0.2)
                break
        assert p.wait(10) == 0, p.stderr.read() if p.stderr else ""
    finally:
        p.kill()
    assert [(e["event"], e["rank"]) for e in jobdir.events()] == [("left_for_requeue", 1)]
