"""A job directory left by an older job with the same id is never taken for a new job's."""

from slurm_hai.jobs.jobdir import JobDir


def test_stale_dir_of_an_older_job_with_the_same_id_is_moved_aside(tmp_path):
    old = JobDir(tmp_path / "4").claim("aaaa")
    old.set_final("succeeded", 0)
    old.event("start", run=0)
    new = JobDir(tmp_path / "4").claim("bbbb")
    assert new.final() is None and new.events() == []
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(".stale-4-")]
    assert len(aside) == 1 and JobDir(aside[0]).final()["state"] == "succeeded"


def test_claim_by_the_same_submission_keeps_everything(tmp_path):
    a = JobDir(tmp_path / "5").claim("cccc")
    a.event("submit")
    b = JobDir(tmp_path / "5").claim("cccc")  # the batch script, after hai-submit
    assert [e["event"] for e in b.events()] == ["submit"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".stale-")]


def test_directory_without_a_token_but_with_state_is_stale(tmp_path):
    legacy = JobDir(tmp_path / "6").create()
    legacy.set_final("failed", 3)
    assert JobDir(tmp_path / "6").claim("dddd").final() is None
    empty = JobDir(tmp_path / "7").create()  # created but nothing in it yet: not stale
    assert JobDir(tmp_path / "7").claim("eeee").path == empty.path
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".stale-7")]


def test_parts_that_start_at_once_move_the_old_directory_aside_once_and_keep_each_others_events(tmp_path,
                                                                                               monkeypatch):
    # a plain sbatch array's parts: an older job's directory (no token) under the reused id; the
    # four tasks claim it at the same moment, each then writes its start. Each rename waits a
    # moment (a loaded node), so that a claimant deciding beside another would move its new
    # directory aside too
    import multiprocessing
    import os
    import time

    rename = os.rename
    monkeypatch.setattr(os, "rename", lambda a, b: time.sleep(0.3) or rename(a, b))

    old = JobDir(tmp_path / "8").create()
    old.set_final("succeeded", 0)
    old.event("start", run=0, part=0)
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(4)
    procs = [ctx.Process(target=_claim_and_start, args=(tmp_path / "8", "ffff", part, start)) for part in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    new = JobDir(tmp_path / "8")
    assert new.final() is None and sorted(e["part"] for e in new.events()) == [0, 1, 2, 3]
    assert len([p for p in tmp_path.iterdir() if p.name.startswith(".stale-8-")]) == 1
    assert not (tmp_path / ".claiming-8").exists()


def _claim_and_start(path, token, part, start):
    start.wait()
    JobDir(path).claim(token).event("start", run=0, part=part)


def test_a_claimant_that_died_deciding_holds_up_the_next_only_for_a_while(tmp_path, monkeypatch):
    from slurm_hai.jobs import jobdir

    monkeypatch.setattr(jobdir, "CLAIM_WAIT_S", 0.3)
    (tmp_path / ".claiming-9").mkdir()  # left by a claimant killed while it decided
    old = JobDir(tmp_path / "9").create()
    old.set_final("failed", 1)
    assert JobDir(tmp_path / "9").claim("gggg").final() is None
    assert not (tmp_path / ".claiming-9").exists()
