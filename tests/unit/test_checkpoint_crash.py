"""Crash consistency: a writer killed with SIGKILL at random moments never leaves a
checkpoint that a fresh process would load wrongly.

SLURM_HAI_CKPT_CRASH_ITERATIONS sets the number of kills (default 30; run >= 200 for
a soak, e.g. `SLURM_HAI_CKPT_CRASH_ITERATIONS=300 pytest tests/unit/test_checkpoint_crash.py`).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from slurm_hai.checkpoint import CheckpointManager
from slurm_hai.checkpoint.manifest import step_dir_name

ITERATIONS = int(os.environ.get("SLURM_HAI_CKPT_CRASH_ITERATIONS", "30"))
FORK = multiprocessing.get_context("fork")  # torch is already imported: a fork starts in ms


def state_for(step: int) -> dict:
    """Every value encodes the step, so a mixed-up or torn load cannot pass as valid."""
    return {
        "big": torch.full((128 * 1024,), float(step)),
        "nested": {"ids": torch.arange(100, dtype=torch.int64) + step, "rng": torch.full((7,), step % 256, dtype=torch.uint8)},
        "step": step,
        "label": f"step {step}",
    }


def _writer(root: str, fast: str | None, first_step: int, report_fd: int) -> None:
    """Save forever, reporting 'S<step>' before each save and 'C<step>' once committed."""
    torch.set_num_threads(1)
    mgr = CheckpointManager(root, keep_last=2, fast_dir=fast)
    step = first_step
    while True:
        os.write(report_fd, f"S{step}\n".encode())
        mgr.save(step, state_for(step), blocking=step % 2 == 0).wait()
        os.write(report_fd, f"C{step}\n".encode())
        step += 1


def _reader(root: str, fast: str | None, report_fd: int) -> None:
    """A fresh process: find the newest checkpoint and check every value of it."""
    torch.set_num_threads(1)
    mgr = CheckpointManager(root, keep_last=2, fast_dir=fast)
    latest = mgr.latest_step()
    state = mgr.load()
    ok = state is None if latest is None else (
        state["step"] == latest
        and state["label"] == f"step {latest}"
        and all(torch.equal(state[k], v) for k, v in state_for(latest).items() if isinstance(v, torch.Tensor))
        and all(torch.equal(state["nested"][k], v) for k, v in state_for(latest)["nested"].items())
    )
    os.write(report_fd, json.dumps({"latest": latest, "loaded": mgr.loaded_step, "ok": ok}).encode())


def run_child(target, *args) -> str:
    read_fd, write_fd = os.pipe()
    child = FORK.Process(target=target, args=(*args, write_fd))
    child.start()
    os.close(write_fd)
    return child, read_fd


def read_all(read_fd: int) -> str:
    chunks = []
    while chunk := os.read(read_fd, 65536):
        chunks.append(chunk)
    os.close(read_fd)
    return b"".join(chunks).decode()


def kill_writer_at_random(root: Path, fast: Path | None, first_step: int, rng: random.Random) -> tuple[set[int], set[int]]:
    child, read_fd = run_child(_writer, str(root), str(fast) if fast else None, first_step)
    time.sleep(rng.uniform(0.0, 0.25))
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    lines = read_all(read_fd).split()
    started = {int(line[1:]) for line in lines if line.startswith("S")}
    committed = {int(line[1:]) for line in lines if line.startswith("C")}
    return started, committed


def fresh_process_view(root: Path, fast: Path | None) -> dict:
    child, read_fd = run_child(_reader, str(root), str(fast) if fast else None)
    child.join(60)
    assert child.exitcode == 0
    return json.loads(read_all(read_fd))


@pytest.mark.parametrize("tiers", ["durable", "fast+durable"])
def test_sigkill_at_random_moments_never_exposes_a_partial_checkpoint(tmp_path, tiers):
    root = tmp_path / "durable"
    fast = tmp_path / "fast" if tiers == "fast+durable" else None
    rng = random.Random(1234)
    all_started: set[int] = set()
    newest_committed = None
    next_step = 1
    for _ in range(ITERATIONS):
        started, committed = kill_writer_at_random(root, fast, next_step, rng)
        all_started |= started
        if committed:
            newest_committed = max(committed)
        view = fresh_process_view(root, fast)
        assert view["ok"], view
        latest = view["latest"]
        if newest_committed is not None:
            # Reported committed => durable; anything newer must be a save that had started.
            assert latest is not None and latest >= newest_committed
        if latest is not None:
            assert latest in all_started
            assert view["loaded"] == latest
            newest_committed = latest  # what a restarted job resumes from
        next_step = max(all_started, default=0) + 1
    assert newest_committed is not None, "the writer never committed: raise the kill delay"


def test_flipped_bytes_and_truncation_fall_back_to_the_previous_checkpoint(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=5)
    for step in (1, 2, 3):
        mgr.save(step, state_for(step))
    data_file = tmp_path / step_dir_name(3) / "state.safetensors"
    data = bytearray(data_file.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit in the middle of the tensor data
    data_file.write_bytes(bytes(data))
    truncated = tmp_path / step_dir_name(2) / "state.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:-1])
    view = fresh_process_view(tmp_path, None)
    assert view == {"latest": 1, "loaded": 1, "ok": True}
