"""A run that cannot start says why (hai status, hai logs), and no path another user
creates beforehand can keep it from starting (issue 18, hostile users)."""

from __future__ import annotations

import os
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
                           term_is_notice=False, force_suspend=lambda: None, flag=None)
    with pytest.raises(SystemExit) as e:
        run.start()
    assert e.value.code == 127
    [ev] = [e for e in jd.events() if e["event"] == "launch_failed"]
    assert ev["run"] == 0 and ev["rank"] == 0 and "no-such-program" in ev["error"]
    log = jd.rank_log(0).read_text()
    assert "could not start: cannot start" in log and "no-such-program" in log
    assert failure_reason(jd, 0, 127).startswith("could not start: cannot start ")
    assert failure_reason(jd, 1, 3) == "exit code 3"  # another run's failure is its own


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
