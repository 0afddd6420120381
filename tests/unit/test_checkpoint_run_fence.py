"""The run fence (commit.py, "the run fence"): once a newer run of a Slurm job has started,
an older run of it (processes on a node cut off from Slurm while the job was requeued
elsewhere, still seeing the shared directory) commits nothing, deletes nothing, and stops;
the newer run's checkpoints stay intact and load. tests/cluster/test_network_faults.py shows
the same on the live cluster with a node cut off by `ip link`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from slurm_hai.checkpoint import CheckpointManager, SupersededRunError, verify_checkpoint
from slurm_hai.checkpoint.commit import RUN_RECORD_PREFIX, CheckpointStore, RunId
from slurm_hai.checkpoint.layout import checkpoint_versions
from slurm_hai.checkpoint.manifest import LAYOUT_SINGLE, Manifest, step_dir_name

STORE = {"lock_timeout": 5.0, "stale_staging_age_s": 3600.0}


def run_env(monkeypatch, job: str | None, run: int) -> None:
    """This process as run `run` of Slurm job `job` (None: outside Slurm)."""
    for key in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "HAI_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)
    if job is not None:
        monkeypatch.setenv("SLURM_JOB_ID", job)
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(run))


def state(value: float) -> dict:
    return {"w": torch.full((4,), value), "step": int(value)}


def committed(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*"))


def commit_one(store: CheckpointStore, step: int) -> Path | None:
    """A minimal commit through the store: what every save does last."""
    staging = store.new_staging(step)
    manifest = Manifest(step=step, layout=LAYOUT_SINGLE, world_size=1, files={}, versions=checkpoint_versions(),
                        created_by={"test": "fence"})
    return store.commit(staging, manifest)


def test_run_id_comes_from_slurm_s_job_and_restart_count():
    assert RunId.from_env({"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "3"}) == RunId("42", 3)
    assert RunId.from_env({"SLURM_JOB_ID": "42", "HAI_RESTART_COUNT": "2"}) == RunId("42", 2)
    assert RunId.from_env({"SLURM_JOB_ID": "42"}) == RunId("42", 0)
    assert RunId.from_env({}) is None  # outside Slurm: nothing to fence


def test_an_older_run_s_commit_after_a_newer_run_started_is_refused_with_one_line(tmp_path):
    old = CheckpointStore(tmp_path, run=RunId("7", 0), **STORE)
    old.start_run()
    assert commit_one(old, 10) is not None  # before the requeue: committed as usual
    new = CheckpointStore(tmp_path, run=RunId("7", 1), **STORE)
    new.start_run()
    with pytest.raises(SupersededRunError) as refused:
        commit_one(old, 20)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("run 0 of job 7 was superseded by run 1: not committing")
    assert committed(tmp_path) == [10]
    assert not list(tmp_path.glob(".staging-*")), "the refused staging dir is left behind"
    assert commit_one(new, 20) is not None
    assert committed(tmp_path) == [10, 20]
    assert (tmp_path / f"{RUN_RECORD_PREFIX}7").read_text() == "1\n"


def test_an_older_run_that_starts_after_a_newer_one_is_refused_at_start(tmp_path):
    CheckpointStore(tmp_path, run=RunId("7", 2), **STORE).start_run()
    with pytest.raises(SupersededRunError, match="run 1 of job 7 was superseded by run 2"):
        CheckpointStore(tmp_path, run=RunId("7", 1), **STORE).start_run()
    assert (tmp_path / f"{RUN_RECORD_PREFIX}7").read_text() == "2\n"


def test_another_job_and_a_process_outside_slurm_are_not_fenced(tmp_path):
    CheckpointStore(tmp_path, run=RunId("7", 5), **STORE).start_run()
    other_job = CheckpointStore(tmp_path, run=RunId("8", 0), **STORE)
    other_job.start_run()
    assert commit_one(other_job, 1) is not None
    assert commit_one(CheckpointStore(tmp_path, **STORE), 2) is not None  # run=None: the persist agents
    assert sorted(p.name for p in tmp_path.glob(f"{RUN_RECORD_PREFIX}*")) == [f"{RUN_RECORD_PREFIX}7",
                                                                               f"{RUN_RECORD_PREFIX}8"]


def test_a_job_in_place_each_part_is_fenced_by_its_own_task(tmp_path):
    """A job in place (runtime/parts.py) is a job array whose tasks commit to one directory,
    each under its own job id (the task's SLURM_JOB_ID) and restart count. A part cut off
    while Slurm requeued its task is fenced by its task's new run; the other parts are not.
    What a part that is not fenced may still commit cannot load wrong: the parts step
    together (one quorum, one torchft step), so a step is the same state in whichever part
    commits it, the first commit of a step is kept, and an older step never becomes the
    newest (docs/elastic-in-place.md, "Checkpoints and the run fence")."""
    part0 = CheckpointStore(tmp_path, run=RunId("101", 0), **STORE)
    part1_cut_off = CheckpointStore(tmp_path, run=RunId("102", 0), **STORE)
    for store in (part0, part1_cut_off):
        store.start_run()
    assert commit_one(part0, 10) is not None
    part1_again = CheckpointStore(tmp_path, run=RunId("102", 1), **STORE)  # task 102 requeued, its part back
    part1_again.start_run()
    with pytest.raises(SupersededRunError, match="run 0 of job 102 was superseded by run 1"):
        commit_one(part1_cut_off, 20)
    assert commit_one(part0, 20) is not None
    assert commit_one(part1_again, 30) is not None
    assert commit_one(part0, 30) is None  # the first commit of a step is kept
    assert commit_one(part0, 5) is not None  # a part behind: an older step, not the newest
    assert committed(tmp_path) == [5, 10, 20, 30]


def test_outside_slurm_a_manager_writes_no_run_record(tmp_path, monkeypatch):
    run_env(monkeypatch, None, 0)
    mgr = CheckpointManager(tmp_path / "ckpt")
    mgr.save(1, state(1.0))
    assert not list((tmp_path / "ckpt").glob(f"{RUN_RECORD_PREFIX}*"))


@pytest.mark.parametrize("blocking", [True, False])
def test_a_superseded_run_stops_commits_nothing_and_the_new_run_s_checkpoint_loads(tmp_path, monkeypatch, blocking):
    ckpt = tmp_path / "ckpt"
    run_env(monkeypatch, "7", 0)
    old = CheckpointManager(ckpt, fast_dir=tmp_path / "old-node-shm", keep_last=1)
    old.save(10, state(10.0))
    # Slurm requeues the job; run 1 starts on other nodes (its own node memory) and resumes.
    run_env(monkeypatch, "7", 1)
    new = CheckpointManager(ckpt, fast_dir=tmp_path / "new-node-shm", keep_last=1)
    into = state(0.0)
    assert new.load(into=into) is not None and new.loaded_step == 10
    new.save(20, state(20.0))
    # The old run, cut off but alive, reaches its next save: refused, and the process stops
    # (SystemExit, even where the training loop would go on after a CheckpointError).
    with pytest.raises(SystemExit, match="run 0 of job 7 was superseded by run 1: not committing"):
        old.save(30, state(30.0), blocking=blocking)
        old.wait()
    assert committed(ckpt) == [20], "the old run committed, or its retention deleted the new run's step"
    assert committed(tmp_path / "old-node-shm") == [10], "the old run committed to its node memory"
    assert verify_checkpoint(ckpt / step_dir_name(20)).ok
    again = state(0.0)
    assert CheckpointManager(ckpt).load(into=again) is not None
    assert torch.equal(again["w"], torch.full((4,), 20.0))


def test_two_processes_the_old_run_exits_with_the_one_line_and_nothing_committed(tmp_path):
    """The same across processes, as on a cluster: the old run's process exits (status 1)
    with the refusal on stderr, no traceback."""
    ckpt = tmp_path / "ckpt"
    script = textwrap.dedent(f"""
        import sys, torch
        from slurm_hai.checkpoint import CheckpointManager
        mgr = CheckpointManager({str(ckpt)!r})
        mgr.save(int(sys.argv[1]), {{"w": torch.zeros(2)}})
        print("committed", flush=True)
        sys.stdin.readline()  # the test lets this run go on once the newer run has started
        mgr.save(int(sys.argv[2]), {{"w": torch.ones(2)}})
        print("committed again", flush=True)
    """)
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "7"}
    old = subprocess.Popen([sys.executable, "-c", script, "10", "30"], env={**env, "SLURM_RESTART_COUNT": "0"},
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert old.stdout is not None and old.stdout.readline().strip() == "committed"
    new = subprocess.run([sys.executable, "-c", script, "20", "21"], env={**env, "SLURM_RESTART_COUNT": "1"},
                         input="\n", capture_output=True, text=True, timeout=120)
    assert new.returncode == 0, new.stderr
    out, err = old.communicate("\n", timeout=120)
    assert old.returncode == 1, (out, err)
    assert "committed again" not in out
    assert "slurm-hai: run 0 of job 7 was superseded by run 1: not committing" in err
    assert "Traceback" not in err
    assert committed(ckpt) == [10, 20, 21]


def test_the_batch_script_of_a_superseded_run_sees_the_newer_run_s_start():
    from slurm_hai.runtime.batch import superseded_by

    events = [{"event": "start", "run": 0}, {"event": "killed", "run": 0}, {"event": "start", "run": 1}]
    assert superseded_by(events, 0) == 1
    assert superseded_by(events, 1) is None
    assert superseded_by([{"event": "start", "run": 0}], 0) is None
