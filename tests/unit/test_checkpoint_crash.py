"""Crash consistency: a writer killed with SIGKILL at random moments never leaves a
checkpoint that a fresh process would load wrongly. The writer, the reader and the
judgement are benchmarks/crash_campaign.py's (its full run: docs/reliability.md).

SLURM_HAI_CKPT_CRASH_ITERATIONS sets the number of kills (default 30; run >= 200 for
a soak, e.g. `SLURM_HAI_CKPT_CRASH_ITERATIONS=300 pytest tests/unit/test_checkpoint_crash.py`).
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.crash_campaign import KillRun, Tally, fresh_process_view, kill_once, state_for  # noqa: E402
from slurm_hai.checkpoint import CheckpointManager  # noqa: E402
from slurm_hai.checkpoint.manifest import step_dir_name  # noqa: E402

ITERATIONS = int(os.environ.get("SLURM_HAI_CKPT_CRASH_ITERATIONS", "30"))


# "suspend": async saves with a blocking one every third step; "fast+durable": both tiers,
# blocking and async saves alternating.
@pytest.mark.parametrize("path", ["suspend", "fast+durable"])
def test_sigkill_at_random_moments_never_exposes_a_partial_checkpoint(tmp_path, path):
    run = KillRun(path, tmp_path, Tally("kill", path))
    rng = random.Random(1234)
    for _ in range(ITERATIONS):
        kill_once(run, rng)
    # Each time: the newest step loads with exactly its values and verifies, it is a step
    # whose save had started, and it is no older than the last one reported committed.
    assert run.tally.consistent == ITERATIONS, run.tally.notes
    assert run.ever_committed, "the writer never committed: raise the kill delay"


def test_flipped_bytes_and_truncation_fall_back_to_the_previous_checkpoint(tmp_path):
    root = tmp_path / "durable"
    mgr = CheckpointManager(root, keep_last=5)
    for step in (1, 2, 3):
        mgr.save(step, state_for(step))
    data_file = root / step_dir_name(3) / "state.safetensors"
    data = bytearray(data_file.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit in the middle of the tensor data
    data_file.write_bytes(bytes(data))
    truncated = root / step_dir_name(2) / "state.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:-1])
    assert fresh_process_view(tmp_path, "sync") == {"latest": 1, "ok": True}
