"""A short run of benchmarks/crash_campaign.py (the full one is in docs/reliability.md):
power-loss crash states of a job's first saves (its checkpoint directory created by the
first), blocking, sharded and through the persist agent, enumerated; the same enumeration
catching a protocol with one fsync removed; SIGKILLs of the suspend and the
async sharded paths; ENOSPC and EIO at every write, fsync and rename of a save; and a
real full file system (a small tmpfs)."""

from __future__ import annotations

import errno
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.crash_campaign import (  # noqa: E402
    KillRun,
    Tally,
    holds_step,
    injection_campaign,
    kill_once,
    power_loss_campaign,
    run_injected,
    state_for,
)
from slurm_hai.checkpoint import CheckpointError, CheckpointManager  # noqa: E402


def test_every_power_loss_crash_state_of_a_job_s_first_saves_loads_the_last_commit(tmp_path):
    # Recorded from before the manager exists: the first save's checkpoint directory and its
    # parent are new (lost to a power loss, before a fix, with the step committed in them).
    paths = ("sync", "sharded", "persist-agent")
    tallies, bad_visible = power_loss_campaign(paths, tmp_path, [1, 2, 3])
    for tally in tallies:
        assert tally.tried > 100, tally  # crash points x directory subsets x data cuts
        assert tally.consistent == tally.tried, tally.notes
    # No crash state shows a committed-looking step dir that does not verify: the files
    # are durable before the rename (DCP's .metadata included, and the files the persist
    # agent renames into its staging dir: neither was, before a fix).
    assert bad_visible == dict.fromkeys(paths, 0)


@pytest.mark.parametrize("broken", ["no-dir-fsync", "no-file-fsync", "no-parent-fsync"])
def test_the_enumeration_finds_a_commit_protocol_without_its_fsyncs(tmp_path, broken):
    (tally,), bad_visible = power_loss_campaign(("sync",), tmp_path, [1, 2], break_protocol=broken)
    assert tally.lost > 0, tally  # a step reported committed is gone after some power loss
    if broken == "no-file-fsync":
        assert bad_visible["sync"] > 0  # step dirs whose files were never made durable


@pytest.mark.parametrize("path", ["suspend", "sharded-async", "persist-agent"])
def test_sigkill_of_the_suspend_and_async_sharded_saves_never_loses_or_tears(tmp_path, path):
    run = KillRun(path, tmp_path, Tally("kill", path))
    rng = random.Random(7)
    kills = 3 if path == "sharded-async" else 6
    for _ in range(kills):
        kill_once(run, rng)
    assert run.tally.consistent == kills, run.tally.notes


def test_enospc_and_eio_at_every_write_fsync_and_rename_of_a_save_fail_it_cleanly(tmp_path):
    tallies = injection_campaign(("sync",), tmp_path, random.Random(1), sample=None)
    assert {t.fault for t in tallies} == {"ENOSPC injected (write, fsync, rename)", "EIO injected (write, fsync, rename)"}
    for tally in tallies:
        assert tally.tried >= 8 and tally.consistent == tally.tried, tally.notes


def test_a_full_disk_inside_dcp_on_one_rank_reads_as_no_space_left_on_every_rank(tmp_path):
    # rank 1's first fsync is DCP's fsync of its shard file
    reports = run_injected(tmp_path, "sharded", ("fsync", 0, errno.ENOSPC), victim=1)
    assert [r["rank"] for r in reports] == [0, 1] and reports[1]["fired"]
    for report in reports:
        assert report["outcome"].startswith("error: ") and "\n" not in report["outcome"]
        assert "rank 1: no space left while writing step 3" in report["outcome"], report["outcome"]
        assert "previous checkpoints are intact" in report["outcome"]
        assert report["after"] == "committed" and not report["staging_left"]
    assert holds_step(CheckpointManager(tmp_path / "durable").load(), 4)


@pytest.fixture
def small_tmpfs(tmp_path):
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root); the injected ENOSPC tests cover the same path")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def _fill_leaving(mount_point: Path, free_bytes: int) -> Path:
    """A filler file that leaves about free_bytes free."""
    filler = mount_point / "filler"
    st = os.statvfs(mount_point)
    filler.write_bytes(b"\0" * max(0, st.f_bavail * st.f_frsize - free_bytes))
    return filler


@pytest.mark.parametrize("blocking", [True, False])
def test_a_real_full_file_system_fails_the_save_with_one_line_and_the_last_good_checkpoint_loads(
        small_tmpfs, caplog, blocking):
    root = small_tmpfs / "ckpt"
    mgr = CheckpointManager(root, keep_last=1)
    mgr.save(1, state_for(1))  # ~0.5 MiB
    outcomes = []
    last_committed = 1
    # Free space: none, a little, most of a checkpoint, all of the data file but not the
    # manifest's page, then plenty: ENOSPC hits at different writes, then the save works.
    for step, free in enumerate([0, 64 << 10, 300 << 10, 520 << 10, 4 << 20], start=2):
        _fill_leaving(small_tmpfs, free)
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="slurm_hai.checkpoint"):
            try:
                mgr.save(step, state_for(step), blocking=blocking)
                mgr.wait()
                outcomes.append("committed")
                last_committed = step
            except CheckpointError as exc:
                outcomes.append("full")
                message = str(exc)
                assert "\n" not in message and message.startswith("no space left while"), message
                assert "the previous checkpoints are intact" in message
                if not blocking:  # the job's log says it at once, not only at the next call
                    assert any(f"background save of step {step} failed: no space left" in r.getMessage()
                               for r in caplog.records)
        assert not list(root.glob(".staging-*"))
        (small_tmpfs / "filler").unlink()
        fresh = CheckpointManager(root)
        loaded = fresh.load()
        assert fresh.loaded_step == last_committed and holds_step(loaded, last_committed)
    assert outcomes == ["full"] * 4 + ["committed"] and last_committed == 6
