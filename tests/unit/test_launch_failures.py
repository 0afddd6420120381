"""A run that cannot start says why (hai status, hai logs), and no path another user
creates beforehand can keep it from starting (issue 18, hostile users)."""

from __future__ import annotations

import os
import signal
import stat

import pytest

from slurm_hai.jobs.jobdir import JobDir
from slurm_hai.runtime import launcher
from slurm_hai.runtime.batch import failure_reason


def test_flag_directory_is_new_private_and_unguessable(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(launcher.os.path, "isdir", lambda p: False)  # no /dev/shm: TMPDIR
    # what a squatter could make in advance under the old fixed name
    squat = tmp_path / f"slurm-hai-{os.getuid()}"
    squat.mkdir(mode=0o777)
    a, b = launcher.flag_path("42", 0), launcher.flag_path("42", 0)
    assert a.parent != b.parent and a.parent.parent == tmp_path and squat not in (a.parent, b.parent)
    st = a.parent.stat()
    assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    assert a.parent.name.startswith("slurm-hai-42.0-")


def test_a_command_that_cannot_start_is_told_in_events_log_and_final_reason(tmp_path):
    jd = JobDir(tmp_path / "7").create()
    run = launcher.NodeRun([str(tmp_path / "no-such-program")], dict(os.environ), jd, run=0, rank=0, grace=1,
                           notices=launcher.notice_signals("USR2", False), flag=None)
    with pytest.raises(SystemExit) as e:
        run.start()
    assert e.value.code == 127
    [ev] = [e for e in jd.events() if e["event"] == "launch_failed"]
    assert ev["run"] == 0 and ev["rank"] == 0 and "no-such-program" in ev["error"]
    log = jd.rank_log(0).read_text()
    assert "could not start: cannot start" in log and "no-such-program" in log
    assert failure_reason(jd, 0, 127).startswith("could not start: cannot start ")
    assert failure_reason(jd, 1, 3) == "exit code 3"  # another run's failure is its own


def test_a_program_whose_interpreter_the_node_lacks_is_told_so_not_as_a_missing_program(tmp_path):
    jd = JobDir(tmp_path / "8").create()
    program = tmp_path / "run.sh"  # it exists; its #! interpreter does not, on this node
    program.write_text("#!/opt/only-on-the-login-node/bash\necho hi\n")
    program.chmod(0o755)
    run = launcher.NodeRun([str(program)], dict(os.environ), jd, run=0, rank=0, grace=1,
                           notices=launcher.notice_signals("USR2", False), flag=None)
    with pytest.raises(SystemExit) as e:
        run.start()
    assert e.value.code == 127
    [ev] = [e for e in jd.events() if e["event"] == "launch_failed"]
    assert ev["error"] == (f"{program}: its #! interpreter /opt/only-on-the-login-node/bash does not exist here "
                           f"(on {os.uname().nodename})")


def test_a_checkpoint_directory_someone_else_made_or_anyone_may_write_is_refused(tmp_path):
    from slurm_hai.checkpoint import CheckpointManager
    from slurm_hai.checkpoint.errors import CheckpointError

    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(CheckpointError, match="writable by everyone"):
        CheckpointManager(open_dir)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)  # the suite runs as root
    with pytest.raises(CheckpointError, match="belongs to uid 65534"):
        CheckpointManager(theirs)
    assert not any(open_dir.iterdir()) and not any(theirs.iterdir())  # nothing written there
    CheckpointManager(tmp_path / "mine")  # a new one is made private
    assert stat.S_IMODE((tmp_path / "mine").stat().st_mode) == 0o700


def test_the_step_ignores_the_notice_signals_until_the_launcher_hears_them():
    import argparse
    import subprocess
    import sys

    from slurm_hai.runtime.batch import launcher_argv

    probe = "import signal; print(signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN, " \
            "signal.getsignal(signal.SIGTERM) == signal.SIG_IGN)"
    for term, expect in ((False, "True False"), (True, "True True")):
        argv = launcher_argv(argparse.Namespace(job_dir="/x", grace=5, notice_signal="USR2", term_is_notice=term),
                             ["cmd"])
        wrapper = argv[:argv.index("slurm_hai.runtime.launcher") - 2]  # before the launcher's interpreter
        out = subprocess.run([*wrapper, sys.executable, "-c", probe], capture_output=True, text=True, check=True)
        assert out.stdout.split() == expect.split(), (term, out)
        assert signal.getsignal(signal.SIGUSR2) is not signal.SIG_IGN  # ours untouched


def test_a_hai_suspend_that_came_before_the_launcher_listened_is_not_lost(tmp_path):
    def heard(*events: tuple[str, int]) -> list[str]:
        jd = JobDir(tmp_path / str(len(list(tmp_path.iterdir())))).create()
        for name, of_run in events:
            jd.event(name, run=of_run, by=0)
        run = launcher.NodeRun(["true"], dict(os.environ), jd, run=1, rank=0, grace=30,
                               notices=launcher.notice_signals("USR2", False), flag=tmp_path / f"flag{jd.path.name}")
        run.start()
        assert run.wait() == 0
        return [e["source"] for e in jd.events() if e["event"] == "notice"]

    # its USR2 fell into the ignored start of the step
    assert heard(("start", 1), ("suspend_requested", 1)) == ["signal"]
    # Slurm ran the job, but its batch script had not started the step: nothing got the USR2
    assert heard(("suspend_requested", 1), ("start", 1)) == ["signal"]
    # a request of an earlier run, or one whose signal failed, is not this run's notice
    assert heard(("suspend_requested", 0), ("start", 1)) == []
    assert heard(("start", 1), ("suspend_requested", 1), ("suspend_request_failed", 1)) == []


def test_the_squeue_asking_why_a_notice_came_is_not_killed_by_the_same_sigterm(tmp_path):
    """A SIGTERM notice goes to every process of the step, an squeue the launcher starts for
    the cause too: each read of the job's record (at the notice, and the later looks for the
    daemon's word) starts with SIGTERM blocked, and the launcher's own mask is restored
    afterwards."""
    import subprocess

    from slurm_hai.slurm.records import JobInfo

    class Slurm:
        name = "test"  # not the commands backend: no squeue started ahead
        reads = 0

        def job(self, job_id):
            # the child terminates itself as Slurm would: with SIGTERM blocked it lives on
            p = subprocess.run(["sh", "-c", "kill -TERM $$; echo alive"], capture_output=True, text=True)
            assert p.returncode == 0 and p.stdout == "alive\n", p
            self.reads += 1
            told = "hai-notice=preempted:8:HIGH:0@200" if self.reads > 1 else ""
            return JobInfo(job_id=job_id, name="j", user="u", state="RUNNING", reason="None", qos="low",
                           partition="gpu", num_nodes=1, node_list="n1", restart_count=0, submit_time=0,
                           start_time=100, eligible_time=0, priority=1, preempt_time=200, admin_comment=told)

    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    cause, later = launcher._why_notice(Slurm(), 5, JobDir(tmp_path / "5").create(), 0, 5.0)()
    assert cause == {"cause": "preempted"}
    assert later() == {"cause": "preempted", "by_job": 8, "by_level": "HIGH", "target_size": 0}
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before


def test_a_notice_as_the_launcher_leaves_does_not_turn_a_finished_run_into_a_failure(tmp_path):
    """Slurm signals every process of the step. A notice that comes as the run ends (the
    user's command done, the launcher leaving) used to kill the launcher: Python's teardown
    resets handled signals to SIG_DFL, and the finished run was recorded as failed with exit
    140 (seen on 26.05 in CI). USR2 is sent here as fast as it goes, from the moment the
    step's shell ignores it (batch.launcher_argv) to the launcher's exit."""
    import argparse
    import contextlib
    import subprocess
    import time

    from slurm_hai.runtime.batch import launcher_argv

    jd = JobDir(tmp_path / "7").create()
    env = {**os.environ, "HAI_MASTER_IP": "127.0.0.1", "SLURM_JOB_ID": "7", "SLURM_NODEID": "1", "SLURM_NNODES": "2"}
    args = argparse.Namespace(job_dir=str(jd.path), grace=30.0, notice_signal="USR2", term_is_notice=False)
    codes = []
    for _ in range(5):
        p = subprocess.Popen(launcher_argv(args, ["true"]), env=env)
        while p.poll() is None and not usr2_ignored_or_caught(p.pid):
            time.sleep(0.0002)
        while p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGUSR2)
            time.sleep(0.0002)
        codes.append(p.returncode)
    assert codes == [0] * 5


def usr2_ignored_or_caught(pid: int) -> bool:
    try:
        fields = dict(line.split(":\t", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":\t" in line)
    except OSError:
        return False
    bit = 1 << (signal.SIGUSR2 - 1)
    return bool((int(fields["SigIgn"], 16) | int(fields["SigCgt"], 16)) & bit)


def test_the_nodes_a_run_started_on_are_the_ranks_whose_log_opened_it(tmp_path):
    """A step that could not launch on a node leaves that rank's log without the run's line:
    the batch script then waits for Slurm's judgement of the node (SlurmdTimeout), not 2 s."""
    jd = JobDir(tmp_path / "7").create()
    for rank in (0, 1):
        run = launcher.NodeRun(["true"], dict(os.environ), jd, run=0, rank=rank, grace=1,
                               notices=launcher.notice_signals("USR2", False), flag=None)
        run.start()
        run.child.wait()
    run = launcher.NodeRun(["true"], dict(os.environ), jd, run=1, rank=0, grace=1,
                           notices=launcher.notice_signals("USR2", False), flag=None)
    run.start()
    run.child.wait()
    assert jd.launched(0, 2) == {0, 1}
    assert jd.launched(1, 2) == {0}  # rank 1's node never ran its launcher for run 1
    assert jd.launched(2, 2) == set()
    assert jd.launched(1, 12) == {0}  # "run 1 rank 1" is not "run 1 rank 12"'s prefix, nor the reverse
    launcher.could_not_start(jd, 2, 1, "no thread count for the job")  # rank 1's launcher ran, and said why
    assert jd.launched(2, 2) == {1}


def test_slurmd_timeout_is_read_from_slurm_or_its_default():
    from slurm_hai.runtime.batch import slurmd_timeout
    from slurm_hai.slurm import SlurmError

    class Conf:
        def __init__(self, value):
            self.value = value

        def config(self):
            if isinstance(self.value, Exception):
                raise self.value
            return {"SlurmdTimeout": self.value} if self.value is not None else {}

    assert slurmd_timeout(Conf("10 sec")) == 10
    assert slurmd_timeout(Conf(None)) == 300
    assert slurmd_timeout(Conf(SlurmError("slurmctld does not answer"))) == 300
