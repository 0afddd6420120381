"""Async multi-rank saves: each rank copies its tensors to host memory and returns; the DCP
write, the checksums and rank 0's commit run in a background thread on every rank, agreed
over a gloo group. A failure on any rank commits nothing and is raised on every rank."""

from __future__ import annotations

import errno
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file
from test_checkpoint_sharded import (STEP, _load_rank, expected_values, free_port, init_gloo, make_state,
                                     train_two_steps)

from slurm_hai.checkpoint import CheckpointError, CheckpointManager, verify_checkpoint
from slurm_hai.checkpoint import sharded as sharded_module
from slurm_hai.checkpoint.manifest import read_manifest, step_dir_name

FORK = multiprocessing.get_context("fork")


def spawn(fn, world_size: int, root: Path, *extra) -> None:
    mp.start_processes(fn, args=(world_size, free_port(), str(root), *extra), nprocs=world_size, start_method="fork")


def _async_save_rank(rank: int, world_size: int, port: int, root: str) -> None:
    init_gloo(rank, world_size, port)
    try:
        state = train_two_steps(rank, world_size)
        torch.manual_seed(100 + rank)  # per-rank RNG streams must come back per rank
        mgr = CheckpointManager(root)
        expected = expected_values(state)
        handle = mgr.save(STEP, state, blocking=False)
        expected["next_random"] = torch.rand(4)
        with torch.no_grad():  # training goes on at once: the checkpoint must not see it
            for param in state.model.parameters():
                param.fill_(-7.0)
        mgr.wait()
        assert handle.done() and not handle.skipped
        save_file(expected, str(Path(root).parent / f"expected-rank{rank}.safetensors"))
        assert mgr.latest_step() == STEP
        mgr.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("save_world", "load_world"), [(2, 3), (4, 2)])
def test_async_sharded_save_loads_back_bitwise_into_another_world_size(tmp_path, save_world, load_world):
    root = tmp_path / "ckpt"
    spawn(_async_save_rank, save_world, root)
    step_dir = root / step_dir_name(STEP)
    manifest = read_manifest(step_dir)
    assert manifest.layout == "dcp" and manifest.world_size == save_world
    assert {f"rank-{r:05d}.safetensors" for r in range(save_world)} <= set(manifest.files)
    assert verify_checkpoint(step_dir).ok
    assert not list(root.glob(".staging-*"))

    spawn(_load_rank, load_world, root)  # ranks 0 and 1 get their RNG back, rank 2 keeps its own

    state = make_state(seed=42)  # and a single process, no process group at all
    CheckpointManager(root).load(into=state)
    from safetensors.torch import load_file

    expected = load_file(str(tmp_path / "expected-rank0.safetensors"))
    for name, value in expected_values(state).items():
        assert torch.equal(value, expected[name]), name
    assert torch.equal(torch.rand(4), expected["next_random"])


def _held_write_rank(rank: int, world_size: int, port: int, root: str) -> None:
    init_gloo(rank, world_size, port)
    try:
        gate, writing = threading.Event(), threading.Event()
        real_write = sharded_module.write_dcp

        def held(*args, **kwargs):
            writing.set()
            assert gate.wait(60)
            return real_write(*args, **kwargs)

        sharded_module.write_dcp = held
        mgr = CheckpointManager(root)
        state = {"w": torch.full((1000,), float(rank)), "step": 1}
        start = time.perf_counter()
        handle = mgr.save(1, state, blocking=False)
        returned = time.perf_counter() - start
        assert writing.wait(30)  # the background thread is in the write, held
        assert not handle.done()
        assert not (Path(root) / step_dir_name(1)).exists()  # nothing is durable yet
        assert returned < 30
        state["w"].fill_(-1.0)
        gate.set()
        mgr.wait()
        assert handle.done() and (Path(root) / step_dir_name(1)).exists()
        mgr.close()
    finally:
        dist.destroy_process_group()


def test_async_sharded_save_returns_before_anything_is_durable(tmp_path):
    root = tmp_path / "ckpt"
    spawn(_held_write_rank, 2, root)
    loaded = CheckpointManager(root).load()
    assert loaded["step"] == 1 and torch.equal(loaded["w"], torch.zeros(1000))  # rank 0's copy at save time


def _failing_rank(rank: int, world_size: int, port: int, root: str, where: str, next_call: str) -> None:
    init_gloo(rank, world_size, port)
    try:
        mgr = CheckpointManager(root, keep_last=5)
        state = train_two_steps(rank, world_size)
        mgr.save(1, state)  # a good checkpoint first (blocking)
        real_fsync, real_write = os.fsync, sharded_module.write_hashed_file

        def no_space(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")

        if rank == 1:
            if where == "dcp-shard":
                os.fsync = no_space  # DCP fsyncs its shard file: the disk is full on rank 1
            else:
                sharded_module.write_hashed_file = no_space  # rank 1's PerRank file
        handle = mgr.save(2, state, blocking=False)  # returns: the failure is not known yet
        handle._done.wait(60)
        os.fsync, sharded_module.write_hashed_file = real_fsync, real_write
        assert not (Path(root) / step_dir_name(2)).exists()
        with pytest.raises(CheckpointError, match=r"(?i)rank 1.*no space left"):
            if next_call == "wait":
                mgr.wait()
            elif next_call == "save":
                mgr.save(3, state, blocking=False)
            elif next_call == "load":
                mgr.load(into=state)
            else:
                mgr.close()
        mgr.wait()  # reported once, not again
        assert mgr.latest_step() == 1
        assert mgr.load(into=state) is not None and mgr.loaded_step == 1
        mgr.save(4, state, blocking=False)  # and the next save works
        mgr.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("where", "next_call"),
    [("dcp-shard", "wait"), ("rank-file", "wait"), ("rank-file", "save"), ("dcp-shard", "load"), ("rank-file", "close")],
)
def test_a_failure_on_one_rank_commits_nothing_and_every_rank_raises_it(tmp_path, where, next_call):
    root = tmp_path / "ckpt"
    spawn(_failing_rank, 2, root, where, next_call)
    assert sorted(p.name for p in root.glob("step-*")) == [step_dir_name(1), step_dir_name(4)]
    assert not list(root.glob(".staging-*"))


def _killed_rank(rank: int, world_size: int, port: int, root: str, victim: int) -> None:
    init_gloo(rank, world_size, port)
    mgr = CheckpointManager(root)
    state = {"w": torch.full((4096,), 1.0), "rank_w": {f"r{rank}": torch.full((4096,), float(rank))}, "step": 1}
    mgr.save(1, state)
    if rank == victim:

        def stuck(*args, **kwargs):
            (Path(root).parent / "victim-writing").touch()
            time.sleep(120)

        sharded_module.write_dcp = stuck
    state["w"].fill_(2.0)
    state["step"] = 2
    mgr.save(2, state, blocking=False)
    try:
        mgr.wait()
        outcome = "committed"
    except CheckpointError as exc:
        outcome = f"raised: {exc}"
    (Path(root).parent / f"survivor-rank{rank}.txt").write_text(outcome)
    os._exit(0)  # the process group is broken: do not wait in its teardown


@pytest.mark.parametrize("victim", [1, 0])
def test_kill_9_of_a_rank_during_the_background_write_leaves_the_previous_checkpoint(tmp_path, victim):
    root = tmp_path / "ckpt"
    port = free_port()
    ranks = [FORK.Process(target=_killed_rank, args=(r, 2, port, str(root), victim)) for r in range(2)]
    for process in ranks:
        process.start()
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "victim-writing").exists():
            assert time.monotonic() < deadline and all(p.exitcode is None for p in ranks)
            time.sleep(0.05)
        os.kill(ranks[victim].pid, signal.SIGKILL)
        survivor = ranks[1 - victim]
        survivor.join(90)
        assert survivor.exitcode == 0  # its background thread learned of the failure
        outcome = (tmp_path / f"survivor-rank{1 - victim}.txt").read_text()
        assert outcome.startswith("raised:"), outcome
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
            process.join()
    restarted = CheckpointManager(root)  # removes the dead writer's staging dir
    assert restarted.latest_step() == 1
    loaded = restarted.load()
    assert loaded["step"] == 1 and torch.equal(loaded["w"], torch.full((4096,), 1.0))
    assert not list(root.glob(".staging-*"))


def step_state(step: int) -> dict:
    """Every value encodes the step, so a mixed-up or torn load cannot pass as valid."""
    return {
        "replicated": torch.full((64 * 1024,), float(step)),
        "nested": {"ids": torch.arange(1000, dtype=torch.int64) + step},
        "step": step,
    }


def _saving_forever_rank(rank: int, world_size: int, port: int, root: str, first_step: int) -> None:
    """Async saves in a loop; rank 0 reports 'S<step>' before each and 'C<step>' once committed."""
    init_gloo(rank, world_size, port)
    torch.set_num_threads(1)
    report = Path(root).parent / "report.txt"
    mgr = CheckpointManager(root, keep_last=2)
    step = first_step
    while True:
        if rank == 0:
            with report.open("a") as fh:
                fh.write(f"S{step}\n")
        mgr.save(step, step_state(step), blocking=False)
        mgr.wait()
        if rank == 0:
            with report.open("a") as fh:
                fh.write(f"C{step}\n")
        step += 1


RANDOM_KILLS = int(os.environ.get("SLURM_HAI_CKPT_SHARDED_CRASH_ITERATIONS", "6"))


def test_kill_9_of_the_ranks_at_random_moments_never_exposes_a_wrong_checkpoint(tmp_path):
    import random

    root = tmp_path / "ckpt"
    rng = random.Random(4321)
    newest_committed, next_step, started = None, 1, set()
    for _ in range(RANDOM_KILLS):
        port = free_port()
        ranks = [FORK.Process(target=_saving_forever_rank, args=(r, 2, port, str(root), next_step)) for r in range(2)]
        for process in ranks:
            process.start()
        time.sleep(rng.uniform(0.5, 2.5))
        first = rng.randrange(2)
        os.kill(ranks[first].pid, signal.SIGKILL)
        time.sleep(rng.uniform(0.0, 0.2))
        for process in ranks:
            if process.is_alive():
                process.kill()
            process.join()
        lines = (tmp_path / "report.txt").read_text().split() if (tmp_path / "report.txt").exists() else []
        started |= {int(line[1:]) for line in lines if line.startswith("S")}
        committed = [int(line[1:]) for line in lines if line.startswith("C")]
        if committed:
            newest_committed = max(committed)
        mgr = CheckpointManager(root)
        latest = mgr.latest_step()
        if newest_committed is not None:
            assert latest is not None and latest >= newest_committed
        if latest is not None:
            assert latest in started
            loaded = mgr.load()
            assert loaded["step"] == latest == mgr.loaded_step
            assert torch.equal(loaded["replicated"], torch.full((64 * 1024,), float(latest)))
            assert torch.equal(loaded["nested"]["ids"], torch.arange(1000, dtype=torch.int64) + latest)
            newest_committed = latest
        next_step = max(started, default=0) + 1
    assert newest_committed is not None, "no save ever committed: raise the kill delay"


def _dtensor_rank(rank: int, world_size: int, port: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    init_gloo(rank, world_size, port)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        local = (torch.arange(8, dtype=torch.float32) + 8 * rank).reshape(4, 2)
        weight = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        mgr = CheckpointManager(root)
        mgr.save(1, {"w": weight, "step": 1}, blocking=False)
        local.fill_(-1.0)  # the shard moves on; the checkpoint holds the copy
        mgr.close()
    finally:
        dist.destroy_process_group()


def test_async_sharded_save_of_dtensor_shards_loads_as_the_global_tensor(tmp_path):
    root = tmp_path / "ckpt"
    spawn(_dtensor_rank, 2, root)
    loaded = CheckpointManager(root).load()
    assert torch.equal(loaded["w"], torch.arange(16, dtype=torch.float32).reshape(8, 2))


def _unsavable_on_one_rank(rank: int, world_size: int, port: int, root: str) -> None:
    init_gloo(rank, world_size, port)
    try:
        mgr = CheckpointManager(root)
        state = {"w": torch.ones(10), "extra": {1, 2} if rank == 1 else None}  # a set cannot be saved
        handle = mgr.save(1, state, blocking=False)
        assert not handle.skipped
        with pytest.raises(CheckpointError, match=r"rank 1: .*extra"):
            mgr.wait()
        state["extra"] = None
        mgr.save(1, state, blocking=False)  # the ranks are still in step with each other
        mgr.close()
    finally:
        dist.destroy_process_group()


def test_a_value_one_rank_cannot_save_fails_the_async_save_on_every_rank(tmp_path):
    root = tmp_path / "ckpt"
    spawn(_unsavable_on_one_rank, 2, root)
    assert sorted(p.name for p in root.glob("step-*")) == [step_dir_name(1)]
    assert not list(root.glob(".staging-*"))


def _different_steps_rank(rank: int, world_size: int, port: int, root: str) -> None:
    init_gloo(rank, world_size, port)
    try:
        mgr = CheckpointManager(root)
        mgr.save(1 + rank, {"w": torch.ones(10)}, blocking=False)  # a bug in the caller
        with pytest.raises(CheckpointError, match=r"the ranks save different steps \(rank 0: 1, rank 1: 2\)"):
            mgr.wait()
        mgr.close()
    finally:
        dist.destroy_process_group()


def test_ranks_saving_different_steps_fail_on_every_rank_instead_of_mixing_two_saves(tmp_path):
    root = tmp_path / "ckpt"
    spawn(_different_steps_rank, 2, root)
    assert not list(root.glob("step-*")) and not list(root.glob(".staging-*"))
