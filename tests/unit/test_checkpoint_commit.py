"""Commit protocol: layout, permissions, immutability, verification + quarantine,
retention, stale staging cleanup, the writer lock and a full disk."""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from slurm_hai.checkpoint import CheckpointError, CheckpointManager, verify_checkpoint
from slurm_hai.checkpoint import fileio
from slurm_hai.checkpoint.commit import CheckpointStore, process_start_ticks
from slurm_hai.checkpoint.manifest import MANIFEST_NAME, QUARANTINE_DIR, step_dir_name

FORK = multiprocessing.get_context("fork")


def state_for(step: int, numel: int = 1000) -> dict:
    return {"x": torch.full((numel,), float(step)), "step": step}


def steps_on_disk(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*"))


def flip_byte(path: Path, offset: int = -10) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_commit_publishes_only_complete_immutable_step_dirs(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=10)
    mgr.save(3, state_for(3))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".lock", step_dir_name(3)]  # no staging left behind
    step_dir = tmp_path / step_dir_name(3)
    assert sorted(p.name for p in step_dir.iterdir()) == [MANIFEST_NAME, "state.safetensors"]
    assert verify_checkpoint(step_dir).ok
    before = (step_dir / "state.safetensors").read_bytes()
    handle = mgr.save(3, state_for(99))  # same step again: skipped, never overwritten
    assert handle.skipped
    assert (step_dir / "state.safetensors").read_bytes() == before


def test_a_step_another_writer_commits_first_is_kept_and_the_later_save_says_skipped(tmp_path, monkeypatch):
    # Two writers of the same step (the parts of an elastic job that leave together): both
    # found it missing and wrote it; the one whose commit comes second keeps the first.
    first, second = CheckpointManager(tmp_path), CheckpointManager(tmp_path)
    monkeypatch.setattr(second, "_stores_missing", lambda step: [second.durable])  # it looked before `first` committed
    assert not first.save(3, state_for(3)).skipped
    before = (tmp_path / step_dir_name(3) / "state.safetensors").read_bytes()
    assert second.save(3, state_for(99)).skipped
    assert (tmp_path / step_dir_name(3) / "state.safetensors").read_bytes() == before
    assert steps_on_disk(tmp_path) == [3]


def test_directories_are_0700_and_files_0600(tmp_path):
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, fast_dir=tmp_path / "fast")
    mgr.save(1, state_for(1))
    flip_byte(root / step_dir_name(1) / "state.safetensors")
    CheckpointManager(root).latest_step()  # quarantines, creating .quarantine
    for tier in (root, tmp_path / "fast"):
        for path in [tier, *tier.rglob("*")]:
            mode = stat.S_IMODE(path.stat().st_mode)
            assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    assert (root / QUARANTINE_DIR).is_dir()


def test_a_checkpoint_directory_in_a_parent_that_cannot_be_read_is_used_with_a_warning(tmp_path, monkeypatch, caplog):
    # Its entry cannot be fsynced there (mode 1733: write, no read); the power-loss campaign
    # covers the readable case, where every new level is fsynced into its parent.
    real_fsync_dir = fileio.fsync_dir

    def refuse_the_parent(path):
        if Path(path) == tmp_path / "runs":
            raise PermissionError(errno.EACCES, "Permission denied")
        real_fsync_dir(path)

    monkeypatch.setattr(fileio, "fsync_dir", refuse_the_parent)
    with caplog.at_level(logging.WARNING, logger="slurm_hai.checkpoint"):
        mgr = CheckpointManager(tmp_path / "runs" / "ckpt")
    assert any(f"cannot fsync {tmp_path / 'runs'} (not readable)" in r.getMessage() for r in caplog.records)
    mgr.save(1, state_for(1))
    assert CheckpointManager(tmp_path / "runs" / "ckpt").latest_step() == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "drop_manifest", "edit_manifest"])
def test_a_damaged_newest_checkpoint_is_quarantined_and_the_previous_one_loads(tmp_path, caplog, damage):
    mgr = CheckpointManager(tmp_path, keep_last=5)
    for step in (1, 2):
        mgr.save(step, state_for(step))
    newest = tmp_path / step_dir_name(2)
    if damage == "flip":
        flip_byte(newest / "state.safetensors")
    elif damage == "truncate":
        data = (newest / "state.safetensors").read_bytes()
        (newest / "state.safetensors").write_bytes(data[: len(data) // 2])
    elif damage == "drop_manifest":
        (newest / MANIFEST_NAME).unlink()
    else:
        text = (newest / MANIFEST_NAME).read_text()
        (newest / MANIFEST_NAME).write_text(text.replace('"world_size": 1', '"world_size": 2'))
    fresh = CheckpointManager(tmp_path)
    with caplog.at_level(logging.ERROR, logger="slurm_hai.checkpoint"):
        loaded = fresh.load()
    assert loaded["step"] == 1 and torch.equal(loaded["x"], state_for(1)["x"])
    assert fresh.loaded_step == 1
    assert not newest.exists()
    quarantined = list((tmp_path / QUARANTINE_DIR).iterdir())
    assert len(quarantined) == 1 and quarantined[0].name.startswith(step_dir_name(2))
    assert any("quarantined" in record.message for record in caplog.records)
    assert fresh.latest_step() == 1


def test_loading_a_named_bad_step_raises_with_a_hint(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, state_for(1))
    flip_byte(tmp_path / step_dir_name(1) / "state.safetensors")
    with pytest.raises(CheckpointError, match="no valid checkpoint for step 1"):
        CheckpointManager(tmp_path).load(step=1)
    assert CheckpointManager(tmp_path).load() is None


def test_retention_keeps_the_newest_valid_ones(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in range(1, 6):
        mgr.save(step, state_for(step))
    assert steps_on_disk(tmp_path) == [4, 5]


def test_retention_counts_only_valid_checkpoints(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        mgr.save(step, state_for(step))
    assert steps_on_disk(tmp_path) == [2, 3]
    flip_byte(tmp_path / step_dir_name(3) / "state.safetensors")
    mgr = CheckpointManager(tmp_path, keep_last=2)  # a restarted job: nothing cached
    mgr.save(4, state_for(4))
    # 3 is bad: quarantined, and it does not count, so 2 stays as the second valid one.
    assert steps_on_disk(tmp_path) == [2, 4]
    assert len(list((tmp_path / QUARANTINE_DIR).iterdir())) == 1


def test_retention_spares_protected_steps(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=10)
    for step in (1, 2, 3):
        mgr.save(step, state_for(step))
    mgr.durable.apply_retention(keep_last=1, protected={1})  # 1 is being loaded elsewhere
    assert steps_on_disk(tmp_path) == [1, 3]


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_stale_staging_dirs_of_dead_or_silent_writers_are_removed(tmp_path):
    host = socket.gethostname()
    sleeper = subprocess.Popen(["sleep", "30"])
    me, my_start = os.getpid(), process_start_ticks(os.getpid())
    try:
        dirs = {
            "dead": tmp_path / f".staging-000000000001-{host}-{dead_pid()}-0-aaaa",
            "live": tmp_path / f".staging-000000000002-{host}-{sleeper.pid}-{process_start_ticks(sleeper.pid)}-bbbb",
            "pid_reused": tmp_path / f".staging-000000000003-{host}-{me}-{my_start - 1}-cccc",
            "same_process": tmp_path / f".staging-000000000004-{host}-{me}-{my_start}-dddd",
            "remote_old": tmp_path / ".staging-000000000005-other-node-7-100-eeee",
            "remote_new": tmp_path / ".staging-000000000006-other-node-8-100-ffff",
            "deleting": tmp_path / f".deleting-step-000000000007-{host}-1-0000",
        }
        for path in dirs.values():
            path.mkdir()
            (path / "part").write_bytes(b"x")
        old = time.time() - 7200
        for path in (dirs["remote_old"], dirs["remote_old"] / "part"):
            os.utime(path, (old, old))
        CheckpointStore(tmp_path, lock_timeout=5, stale_staging_age_s=3600).clean_stale(active=set())
        left = {name for name, path in dirs.items() if path.exists()}
        assert left == {"live", "same_process", "remote_new"}
    finally:
        sleeper.kill()
        sleeper.wait()


def _hold_lock(lock_path: str, locked, release) -> None:
    with FileLock(lock_path):
        locked.set()
        release.wait(30)


def test_a_second_process_cannot_commit_while_the_lock_is_held(tmp_path):
    locked, release = FORK.Event(), FORK.Event()
    holder = FORK.Process(target=_hold_lock, args=(str(tmp_path / ".lock"), locked, release))
    holder.start()
    try:
        assert locked.wait(10)
        mgr = CheckpointManager(tmp_path, lock_timeout=0.3)
        with pytest.raises(CheckpointError, match="held by another process"):
            mgr.save(1, state_for(1))
        assert steps_on_disk(tmp_path) == []
        assert not list(tmp_path.glob(".staging-*"))
    finally:
        release.set()
        holder.join(10)
    mgr.save(1, state_for(1))
    assert steps_on_disk(tmp_path) == [1]


def _save_steps(root: str, steps: list[int]) -> None:
    torch.set_num_threads(1)
    mgr = CheckpointManager(root, keep_last=100)
    for step in steps:
        mgr.save(step, state_for(step, numel=20_000))


def test_two_writers_never_interleave_commits(tmp_path):
    writers = [FORK.Process(target=_save_steps, args=(str(tmp_path), list(range(first, 40, 2)))) for first in (0, 1)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
        assert writer.exitcode == 0
    assert steps_on_disk(tmp_path) == list(range(40))
    reader = CheckpointManager(tmp_path)
    for step in (0, 17, 39):
        assert reader.load(step=step)["step"] == step
    assert all(verify_checkpoint(p).ok for p in tmp_path.glob("step-*"))


def _assert_full_disk_is_clean(root: Path, mgr: CheckpointManager, big_state: dict) -> None:
    with pytest.raises(CheckpointError, match="no space left") as info:
        mgr.save(2, big_state)
    assert "previous checkpoints are intact" in str(info.value)
    assert steps_on_disk(root) == [1]
    assert not list(root.glob(".staging-*"))
    assert CheckpointManager(root).load()["step"] == 1


def test_disk_full_on_a_tiny_tmpfs_keeps_the_previous_checkpoint(tmp_path):
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)],
                             capture_output=True).returncode == 0
    if not mounted:
        pytest.skip("cannot mount a tmpfs here (needs root); test_disk_full_injected covers ENOSPC")
    try:
        root = mount_point / "ckpt"
        mgr = CheckpointManager(root)
        mgr.save(1, state_for(1, numel=10_000))
        _assert_full_disk_is_clean(root, mgr, state_for(2, numel=100_000))
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_disk_full_injected_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, state_for(1))
    real_write_all = fileio._write_all

    def write_then_fill_up(fd: int, view: memoryview) -> None:
        real_write_all(fd, view[: len(view) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fileio, "_write_all", write_then_fill_up)
    _assert_full_disk_is_clean(tmp_path, mgr, state_for(2))
