"""Async saves (reusable host buffers, one in flight, errors surface) and the two tiers."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest
import torch

from slurm_hai.checkpoint import CheckpointError, CheckpointManager
from slurm_hai.checkpoint import manager as manager_module
from slurm_hai.checkpoint.manifest import QUARANTINE_DIR, step_dir_name


def state_for(step: int) -> dict:
    return {"x": torch.full((1000,), float(step)), "step": step}


class GatedWrites:
    """Holds every background file write until release() is called."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        real = manager_module.write_hashed_file

        def gated(*args, **kwargs):
            self.started.set()
            assert self.gate.wait(30)
            return real(*args, **kwargs)

        monkeypatch.setattr(manager_module, "write_hashed_file", gated)

    def release(self) -> None:
        self.gate.set()


def test_async_save_returns_after_staging_and_the_copy_is_a_snapshot(tmp_path, monkeypatch):
    gate = GatedWrites(monkeypatch)
    mgr = CheckpointManager(tmp_path)
    tensor = torch.full((1000,), 1.0)
    handle = mgr.save(1, {"x": tensor}, blocking=False)
    assert gate.started.wait(10)
    assert not handle.done() and mgr.latest_step() is None  # not committed yet
    tensor.fill_(-5.0)  # the training loop moves on; the checkpoint must not see this
    gate.release()
    handle.wait()
    assert torch.equal(CheckpointManager(tmp_path).load()["x"], torch.full((1000,), 1.0))


def test_host_buffers_are_reused_between_saves(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, state_for(1), blocking=False)
    mgr.wait()
    first = mgr._buffer.reserve(1).data_ptr()
    mgr.save(2, state_for(2), blocking=False)
    mgr.wait()
    assert mgr._buffer.reserve(1).data_ptr() == first


def test_a_second_save_waits_for_the_one_in_flight(tmp_path, monkeypatch):
    gate = GatedWrites(monkeypatch)
    mgr = CheckpointManager(tmp_path, keep_last=5)
    mgr.save(1, state_for(1), blocking=False)
    second = threading.Thread(target=mgr.save, args=(2, state_for(2)), kwargs={"blocking": False})
    second.start()
    second.join(0.3)
    assert second.is_alive()  # blocked behind step 1
    gate.release()
    second.join(10)
    mgr.wait()
    assert [step for step, _ in mgr.durable.steps().items()] == [2, 1]


@pytest.mark.parametrize("next_call", ["wait", "save", "load"])
def test_a_background_failure_is_raised_by_the_next_call_once(tmp_path, monkeypatch, next_call):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, state_for(1))

    def failing_write(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(manager_module, "write_hashed_file", failing_write)
    handle = mgr.save(2, state_for(2), blocking=False)  # returns: the failure is not known yet
    handle._done.wait(10)
    with pytest.raises(CheckpointError, match="writing step 2"):
        if next_call == "wait":
            mgr.wait()
        elif next_call == "save":
            mgr.save(3, state_for(3))
        else:
            mgr.load()
    monkeypatch.undo()
    mgr.wait()  # reported once, not again
    assert mgr.load()["step"] == 1
    assert not list(Path(tmp_path).glob(".staging-*"))


def test_handle_wait_raises_the_failure_too(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path)
    monkeypatch.setattr(manager_module, "write_hashed_file", lambda *a, **k: (_ for _ in ()).throw(OSError(5, "EIO")))
    handle = mgr.save(1, state_for(1), blocking=False)
    with pytest.raises(CheckpointError):
        handle.wait()
    mgr.wait()  # already reported through the handle


def test_two_tiers_commit_fast_first_and_load_prefers_fast(tmp_path):
    durable, fast = tmp_path / "durable", tmp_path / "fast"
    mgr = CheckpointManager(durable, fast_dir=fast, keep_last=3, fast_keep_last=1)
    for step in (1, 2, 3):
        handle = mgr.save(step, state_for(step), blocking=False)
        handle.wait(durable=False)
        assert (fast / step_dir_name(step)).exists()
    mgr.wait()
    assert sorted(p.name for p in fast.glob("step-*")) == [step_dir_name(3)]
    assert sorted(p.name for p in durable.glob("step-*")) == [step_dir_name(s) for s in (1, 2, 3)]
    # A bad durable copy does not matter while the fast copy is good: fast is read first.
    (durable / step_dir_name(3) / "state.safetensors").write_bytes(b"garbage")
    restarted = CheckpointManager(durable, fast_dir=fast)
    assert restarted.load()["step"] == 3


def test_a_bad_fast_copy_falls_back_to_the_durable_copy_of_the_same_step(tmp_path):
    durable, fast = tmp_path / "durable", tmp_path / "fast"
    CheckpointManager(durable, fast_dir=fast).save(4, state_for(4))
    (fast / step_dir_name(4) / "state.safetensors").write_bytes(b"garbage")
    restarted = CheckpointManager(durable, fast_dir=fast)
    assert restarted.load()["step"] == 4
    assert len(list((fast / QUARANTINE_DIR).iterdir())) == 1


def test_after_a_restart_the_newest_valid_across_both_tiers_wins(tmp_path):
    durable, fast = tmp_path / "durable", tmp_path / "fast"
    CheckpointManager(durable, fast_dir=fast).save(5, state_for(5))
    CheckpointManager(fast).save(6, state_for(6))  # the job died before step 6 reached durable
    assert CheckpointManager(durable, fast_dir=fast).latest_step() == 6
    assert CheckpointManager(durable, fast_dir=fast).load()["step"] == 6
    CheckpointManager(durable).save(7, state_for(7))  # /dev/shm was wiped on another node
    assert CheckpointManager(durable, fast_dir=fast).load()["step"] == 7


def test_save_and_load_only_the_missing_tier(tmp_path):
    durable, fast = tmp_path / "durable", tmp_path / "fast"
    CheckpointManager(fast).save(8, state_for(8))
    handle = CheckpointManager(durable, fast_dir=fast).save(8, state_for(8))
    assert not handle.skipped and (durable / step_dir_name(8)).exists()
    assert CheckpointManager(durable, fast_dir=fast).save(8, state_for(8)).skipped


def test_a_failing_fast_tier_still_persists_to_durable_and_reports_it(tmp_path, monkeypatch):
    durable, fast = tmp_path / "durable", tmp_path / "fast"
    real = manager_module.write_hashed_file

    def fast_tier_full(path, *args, **kwargs):
        if fast in path.parents:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(manager_module, "write_hashed_file", fast_tier_full)
    mgr = CheckpointManager(durable, fast_dir=fast)
    with pytest.raises(CheckpointError, match="committed in .*but the fast tier failed: no space left"):
        mgr.save(1, state_for(1))
    assert CheckpointManager(durable).load()["step"] == 1
    assert not list(fast.glob("step-*")) and not list(fast.glob(".staging-*"))
