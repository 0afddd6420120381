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
