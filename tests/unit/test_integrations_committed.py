"""A framework's own checkpoint files committed with slurm-hai's protocol
(slurm_hai/integrations/committed.py), without any framework."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slurm_hai.checkpoint import CheckpointError, CheckpointManager, verify_checkpoint
from slurm_hai.integrations.committed import FrameworkCheckpoints


def framework_save(root: Path, step: int) -> Path:
    """What a framework writes for one save: a directory of files, one in a subdirectory."""
    d = root / f"checkpoint-{step}"
    (d / "sub").mkdir(parents=True)
    (d / "model.bin").write_bytes(bytes([step % 256]) * 1000)
    (d / "sub" / "state.json").write_text(json.dumps({"step": step}))
    return d


def store(tmp_path: Path, keep_last: int = 3) -> FrameworkCheckpoints:
    return FrameworkCheckpoints(tmp_path / "ckpt", keep_last=keep_last, framework="toy", version="1.0")


def test_an_adopted_save_is_committed_checksummed_and_leaves_its_source(tmp_path):
    ckpts = store(tmp_path)
    source = framework_save(tmp_path / "out", 5)
    committed = ckpts.adopt(5, source)
    assert committed == tmp_path / "ckpt" / "step-000000000005"
    assert not source.exists()
    result = verify_checkpoint(committed)
    assert result.ok, result.problems
    assert sorted(result.manifest.files) == ["model.bin", "sub/state.json"]
    assert result.manifest.layout == "files" and result.manifest.versions["toy"] == "1.0"
    assert result.manifest.created_by["framework"] == "toy"
    assert json.loads((committed / "sub" / "state.json").read_text()) == {"step": 5}
    assert ckpts.latest() == committed


def test_a_torn_save_is_never_named_for_resume(tmp_path):
    ckpts = store(tmp_path)
    good = ckpts.adopt(5, framework_save(tmp_path / "out", 5))
    framework_save(tmp_path / "out", 9)  # a save a kill tore: never adopted
    staging = ckpts.new_staging(8)  # a commit a kill tore
    (staging / "model.bin").write_bytes(b"half")
    unfinished = tmp_path / "ckpt" / "step-000000000007"  # a step dir without its manifest
    unfinished.mkdir()
    (unfinished / "model.bin").write_bytes(b"x")
    assert ckpts.latest() == good
    assert not unfinished.exists() and list((tmp_path / "ckpt" / ".quarantine").iterdir())


def test_a_corrupt_newest_checkpoint_is_quarantined_and_the_previous_one_named(tmp_path):
    ckpts = store(tmp_path)
    older = ckpts.adopt(5, framework_save(tmp_path / "out", 5))
    newer = ckpts.adopt(6, framework_save(tmp_path / "out", 6))
    data = bytearray((newer / "model.bin").read_bytes())
    data[10] ^= 1
    (newer / "model.bin").write_bytes(bytes(data))
    assert store(tmp_path).latest() == older  # a fresh process: nothing cached
    assert not newer.exists()


def test_keep_last_keeps_the_newest_valid_checkpoints(tmp_path):
    ckpts = store(tmp_path, keep_last=2)
    for step in (1, 2, 3, 4):
        ckpts.adopt(step, framework_save(tmp_path / "out", step))
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == ["step-000000000003", "step-000000000004"]


def test_a_committed_step_is_never_replaced(tmp_path):
    ckpts = store(tmp_path)
    first = ckpts.adopt(5, framework_save(tmp_path / "out", 5))
    before = (first / "model.bin").read_bytes()
    again = framework_save(tmp_path / "again", 5)
    (again / "model.bin").write_bytes(b"other")
    assert ckpts.adopt(5, again) is None
    assert (first / "model.bin").read_bytes() == before
    assert not list((tmp_path / "ckpt").glob(".staging-*"))


def test_a_save_without_files_is_refused_in_one_line(tmp_path):
    ckpts = store(tmp_path)
    (tmp_path / "out" / "checkpoint-3").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="wrote no files for step 3"):
        ckpts.adopt(3, tmp_path / "out" / "checkpoint-3")
    assert ckpts.latest() is None


def test_the_checkpoint_manager_skips_a_framework_checkpoint_without_quarantining_it(tmp_path):
    committed = store(tmp_path).adopt(5, framework_save(tmp_path / "out", 5))
    assert CheckpointManager(tmp_path / "ckpt").load() is None
    assert committed.exists() and verify_checkpoint(committed).ok
