"""Sharded saves: DCP inside our commit protocol, saved by 2 gloo ranks, loaded by 3 and 1."""

from __future__ import annotations

import logging
import os
import pickle
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from slurm_hai.checkpoint import CheckpointManager, TrainingState, verify_checkpoint
from slurm_hai.checkpoint.manifest import read_manifest, step_dir_name
from slurm_hai.checkpoint.training import derived_seed

STEP = 5


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_gloo(rank: int, world_size: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )


def make_state(seed: int) -> TrainingState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    return TrainingState(model, torch.optim.AdamW(model.parameters(), lr=0.05))


def expected_values(state: TrainingState) -> dict[str, torch.Tensor]:
    values = {f"model.{k}": v.clone() for k, v in state.model.state_dict().items()}
    for index, param_state in state.optimizer.state_dict()["state"].items():
        values.update({f"opt.{index}.{k}": v.reshape(-1).clone() for k, v in param_state.items()})
    return values


def train_two_steps(rank: int, world_size: int):
    state = make_state(seed=0)  # replicas start equal, as under DDP
    for _ in range(2):
        loss = state.model(torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))).square().mean()
        state.optimizer.zero_grad()
        loss.backward()
        for param in state.model.parameters():  # what DDP does: average the gradients
            dist.all_reduce(param.grad)
            param.grad /= world_size
        state.optimizer.step()
    state.step = STEP
    return state


def _save_rank(rank: int, world_size: int, port: int, root: str) -> None:
    init_gloo(rank, world_size, port)
    try:
        state = train_two_steps(rank, world_size)
        torch.manual_seed(100 + rank)  # per-rank RNG streams must come back per rank
        mgr = CheckpointManager(root)
        mgr.save(STEP, state)
        expected = expected_values(state)
        expected["next_random"] = torch.rand(4)
        save_file(expected, str(Path(root).parent / f"expected-rank{rank}.safetensors"))
        assert mgr.latest_step() == STEP
    finally:
        dist.destroy_process_group()


def _load_rank(rank: int, world_size: int, port: int, root: str) -> None:
    init_gloo(rank, world_size, port)
    try:
        state = make_state(seed=1234 + rank)
        torch.manual_seed(555)
        mgr = CheckpointManager(root)
        assert mgr.latest_step() == STEP
        mgr.load(into=state)
        assert mgr.loaded_step == STEP and state.step == STEP
        expected = load_file(str(Path(root).parent / "expected-rank0.safetensors"))
        for name, value in expected_values(state).items():
            assert torch.equal(value, expected[name]), (rank, name)
        after = torch.rand(4)
        if rank < 2:  # ranks that existed at save time get their own RNG stream back
            mine = load_file(str(Path(root).parent / f"expected-rank{rank}.safetensors"))
            assert torch.equal(after, mine["next_random"]), rank
        else:  # a rank that did not exist at save time gets a stream derived from (seed, rank, step)
            assert torch.equal(after, torch.rand(4, generator=torch.Generator().manual_seed(
                derived_seed(state.seed, rank, STEP))))
    finally:
        dist.destroy_process_group()


def _save_steps_rank(rank: int, world_size: int, port: int, root: str) -> None:
    init_gloo(rank, world_size, port)
    try:
        messages: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("slurm_hai.checkpoint").addHandler(handler)
        logging.getLogger("slurm_hai.checkpoint").setLevel(logging.WARNING)
        mgr = CheckpointManager(root, keep_last=2, fast_dir=Path(root).parent / "fast")
        state = make_state(seed=0)
        for step in (1, 2, 3):
            assert not mgr.save(step, state).skipped
        assert mgr.save(3, state).skipped
        (Path(root).parent / f"log-rank{rank}.txt").write_text("\n".join(messages))
    finally:
        dist.destroy_process_group()


def spawn(fn, world_size: int, root: Path) -> None:
    mp.start_processes(fn, args=(world_size, free_port(), str(root)), nprocs=world_size, start_method="fork")


def test_two_rank_dcp_checkpoint_loads_into_three_ranks_and_into_one(tmp_path):
    root = tmp_path / "ckpt"
    spawn(_save_rank, 2, root)
    step_dir = root / step_dir_name(STEP)
    manifest = read_manifest(step_dir)
    assert manifest.layout == "dcp" and manifest.world_size == 2
    assert {"dcp/.metadata", "tree.json", "rank-00000.safetensors", "rank-00001.safetensors"} <= set(manifest.files)
    assert verify_checkpoint(step_dir).ok
    assert not list(root.glob(".staging-*"))
    assert all(oct(p.stat().st_mode & 0o777) == ("0o700" if p.is_dir() else "0o600") for p in step_dir.rglob("*"))

    spawn(_load_rank, 3, root)

    # world size 1: no process group at all
    state = make_state(seed=42)
    mgr = CheckpointManager(root)
    mgr.load(into=state)
    expected = load_file(str(tmp_path / "expected-rank0.safetensors"))
    for name, value in expected_values(state).items():
        assert torch.equal(value, expected[name]), name
    assert torch.equal(torch.rand(4), expected["next_random"])  # rank 0's RNG


@pytest.mark.parametrize("damaged", [".metadata", "__0_0.distcp"])
def test_a_corrupt_dcp_file_is_caught_before_dcp_unpickles_anything(tmp_path, monkeypatch, damaged):
    root = tmp_path / "ckpt"
    spawn(_save_rank, 2, root)
    target = root / step_dir_name(STEP) / "dcp" / damaged
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    unpickled = []
    monkeypatch.setattr(pickle, "load", lambda *a, **k: unpickled.append(a))
    monkeypatch.setattr(torch, "load", lambda *a, **k: unpickled.append(a))
    assert CheckpointManager(root).load() is None  # the only checkpoint is bad: a fresh start
    assert unpickled == []
    assert len(list((root / ".quarantine").iterdir())) == 1


def test_sharded_saves_apply_retention_skip_committed_steps_and_bypass_the_fast_tier(tmp_path):
    root = tmp_path / "ckpt"
    spawn(_save_steps_rank, 2, root)
    assert sorted(p.name for p in root.glob("step-*")) == [step_dir_name(2), step_dir_name(3)]
    assert not list(root.glob(".staging-*")) and not list(root.glob(".deleting-*"))
    # the fast tier holds only suspend_save()'s node memory parts (test_checkpoint_memory.py)
    assert not list((tmp_path / "fast").glob("step-*")) and not list((tmp_path / "fast").glob("parts/step-*"))
    assert "step 3 is already committed" in (tmp_path / "log-rank0.txt").read_text()


class _Counted:
    """A file object that counts the bytes read through it."""

    def __init__(self, f, counter: list[int]) -> None:
        self._f, self._counter = f, counter

    def read(self, *a):
        data = self._f.read(*a)
        self._counter[0] += len(data)
        return data

    def readinto(self, buf):
        n = self._f.readinto(buf)
        self._counter[0] += n or 0
        return n

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __getattr__(self, name):
        return getattr(self._f, name)


def count_checkpoint_reads(root: str, counter: list[int]) -> None:
    """From now on, every open() of a file below `root` (builtins.open or io.open, which
    pathlib and DCP use) counts its reads into counter[0]."""
    import builtins
    import io

    real_open = io.open

    def counting_open(file, mode="r", *a, **kw):
        f = real_open(file, mode, *a, **kw)
        return _Counted(f, counter) if "r" in mode and str(file).startswith(root) else f

    builtins.open = io.open = counting_open


def _save_big_rank(rank: int, world_size: int, port: int, root: str) -> None:
    init_gloo(rank, world_size, port)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(700, 700)  # ~1.9 MiB of weights: the checkpoint's bulk
        CheckpointManager(root).save(STEP, {"model": model})
    finally:
        dist.destroy_process_group()


def _load_big_rank(rank: int, world_size: int, port: int, root: str) -> None:
    init_gloo(rank, world_size, port)
    try:
        torch.manual_seed(rank + 7)
        model = torch.nn.Linear(700, 700)
        mgr = CheckpointManager(root)
        counter = [0]
        count_checkpoint_reads(root, counter)
        mgr.load(into={"model": model})
        read = counter[0]
        torch.manual_seed(0)
        assert torch.equal(model.weight, torch.nn.Linear(700, 700).weight), rank  # the saved replica
        (Path(root).parent / f"read-rank{rank}").write_text(str(read))
    finally:
        dist.destroy_process_group()


def test_replicated_state_is_read_from_storage_once_and_broadcast(tmp_path):
    """DDP's replicas: rank 0 reads the checkpoint (verify, then load: its page cache serves
    the second pass), the others get it over the process group and read only the small
    files. Before, every rank read all of it."""
    root = tmp_path / "ckpt"
    spawn(_save_big_rank, 2, root)
    spawn(_load_big_rank, 4, root)
    size = sum(p.stat().st_size for p in (root / step_dir_name(STEP)).rglob("*") if p.is_file())
    read = [int((tmp_path / f"read-rank{r}").read_text()) for r in range(4)]
    assert read[0] <= 2.2 * size, (read, size)  # checksum pass + load pass, each once
    assert all(r <= 0.05 * size for r in read[1:]), (read, size)
    assert sum(read) <= 2.4 * size  # against 5x before: a 1/4 share to verify + 1x to load, per rank
