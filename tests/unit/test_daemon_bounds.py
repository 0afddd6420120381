"""What a user can put where the policy daemon looks (it runs as root or the SlurmUser):
its lock and pid file take nothing planted at their path, and a job directory's suspend
marker is looked at, never read nor followed (issue 57)."""

from __future__ import annotations

import os
import pwd
import threading
from pathlib import Path

import pytest

from slurm_hai.controller.daemon import LockBusy, PolicyDaemon, leader_lock, write_pid
from slurm_hai.policy.model import load_policy
from test_policy_daemon import LOCAL, NOW, FakeSlurm, job

ME = pwd.getpwuid(os.getuid()).pw_name
NOBODY = 65534


@pytest.fixture
def lock_dir(tmp_path) -> Path:
    d = tmp_path / "run"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    return d


def planted(kind: str, path: Path, tmp_path: Path) -> None:
    target = tmp_path / "roots-file"
    target.write_text("keep me\n")
    if kind == "symlink":
        path.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "foreign":
        path.write_text("")
        os.chown(path, NOBODY, NOBODY)
    elif kind == "hard link":
        os.link(target, path)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "foreign", "hard link"])
def test_something_planted_at_the_lock_path_is_refused_in_one_line_and_left_alone(lock_dir, tmp_path, kind):
    path = lock_dir / "policyd.lock"
    planted(kind, path, tmp_path)
    watchdog = threading.Timer(10, os._exit, (3,))  # an open that blocked on the FIFO ends the run
    watchdog.start()
    try:
        with pytest.raises(LockBusy) as e:
            leader_lock(path)
    finally:
        watchdog.cancel()
    assert "is not this daemon's lock" in str(e.value) and "\n" not in str(e.value)
    assert (tmp_path / "roots-file").read_text() == "keep me\n"  # neither truncated nor locked through


@pytest.mark.parametrize("mode", [0o1777, 0o775, 0o757])
def test_a_lock_in_a_directory_others_can_write_is_refused(tmp_path, mode):
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(mode)
    with pytest.raises(LockBusy, match="writable by others than its owner.*pass --lock FILE"):
        leader_lock(d / "policyd.lock")
    assert not (d / "policyd.lock").exists()


def test_the_lock_taken_over_after_its_file_was_replaced_is_the_new_file(lock_dir):
    path = lock_dir / "policyd.lock"
    first = leader_lock(path)
    path.unlink()  # an admin removed it while the leader runs: a new daemon leads on the new file
    second = leader_lock(path)
    assert first.is_locked and second.is_locked
    first.release()
    second.release()


@pytest.mark.parametrize("kind", ["symlink", "fifo", "foreign"])
def test_the_pid_file_is_not_written_through_what_was_planted(lock_dir, tmp_path, kind, caplog):
    lock = lock_dir / "policyd.lock"
    planted(kind, Path(f"{lock}.pid"), tmp_path)
    write_pid(lock)
    assert (tmp_path / "roots-file").read_text() == "keep me\n"
    assert any("pid not written" in r.getMessage() for r in caplog.records)


def test_the_pid_file_is_written(lock_dir):
    assert write_pid(lock_dir / "l.lock").read_text() == f"{os.getpid()}\n"


@pytest.mark.parametrize("comment, requeued", [
    ("hai-suspend=0:go_suspend:none:0:12.5", True), ("hai-suspend=0:forced:user:10:12.5", True),
    ("hai-suspend=1:go_suspend:none:0:12.5", False),  # another run's
    ("hai-suspend=0:please:none:0:12.5", False), ("hai-suspend=0:forced", False),
    ("hai-suspend=-1:forced:none:0:12.5", False), ("hai-suspend=0:forced:none:0:-12.5", False),
    ("hai-suspend=" + "9" * 5000 + ":forced:none:0:12.5", False), ("hai-suspend=0:go_suspend,x:none:0:1", False),
    ("hai-suspend=0:forced:none:0:12.5:more", False), ("hai-suspend=0:forced:none:0:" + "1" * 5000, False),
])
def test_whether_a_failed_jobs_run_had_asked_to_be_suspended_is_its_slurm_record_alone(comment, requeued):
    """The daemon reads no user's directory (issue 55): a FAILED job is requeued as suspended
    only by its comment's hai-suspend for its last run, written by its batch script. The
    comment is its owner's to write: anything else in it requeues nothing (and its owner
    could requeue the job itself)."""
    failed = job(7, user=ME, state="FAILED", comment=f"hai-dir=/nonexistent {comment}", start_time=NOW - 60,
                 end_time=NOW - 5)
    slurm = FakeSlurm([failed])
    PolicyDaemon(slurm, policy=load_policy(LOCAL), clock=lambda: NOW).cycle()
    assert (("requeue", 7) in [c[:2] for c in slurm.calls]) == requeued, slurm.calls
