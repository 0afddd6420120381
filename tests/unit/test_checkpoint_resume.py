"""Bitwise resume: a run killed mid-training and resumed through TrainingState ends with
exactly the weights of an uninterrupted run; ResumableSampler survives world-size changes."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, TensorDataset

from slurm_hai.checkpoint import CheckpointError, CheckpointManager, ResumableSampler, TrainingState

FORK = multiprocessing.get_context("fork")
TOTAL_STEPS = 23  # 10 steps per epoch: the kill and the end fall in different epochs
KILL_AFTER_STEP = 14
BATCH = 4


def build(seed: int):
    """Model, optimizer, scheduler, sampler, loader; seed only affects the initial weights
    and RNG, which a resume must overwrite."""
    torch.manual_seed(seed)
    data = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(40, 8, generator=data), torch.randint(0, 4, (40,), generator=data))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)
    sampler = ResumableSampler(len(dataset), seed=7)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, generator=torch.Generator())
    return TrainingState(model, optimizer, scheduler, sampler), loader


def train(checkpoint_dir: str | None, result_path: str, *, seed: int, kill_after: int | None = None) -> None:
    torch.set_num_threads(1)
    random.seed(seed)
    np.random.seed(seed)
    state, loader = build(seed)
    mgr = CheckpointManager(checkpoint_dir, keep_last=2) if checkpoint_dir else None
    if mgr is not None:
        mgr.load(into=state)
    model, optimizer, scheduler, sampler = state.model, state.optimizer, state.scheduler, state.sampler
    while state.step < TOTAL_STEPS:
        for inputs, targets in loader:
            # python and numpy randomness too, so their RNG state must be restored as well
            noise = torch.from_numpy(np.random.normal(0, 0.01, size=inputs.shape).astype(np.float32))
            scale = 1.0 + random.random() * 0.01
            loss = torch.nn.functional.cross_entropy(model(inputs * scale + noise), targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            sampler.advance(len(inputs))
            state.step += 1
            state.epoch = sampler.epoch
            if mgr is not None and state.step % 3 == 0:
                mgr.save(state.step, state, blocking=False)
            if state.step == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)  # preempted without warning
            if state.step == TOTAL_STEPS:
                break
    if mgr is not None:
        mgr.wait()
    final = {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}
    for index, param_state in optimizer.state_dict()["state"].items():
        final.update({f"opt.{index}.{k}": v.reshape(-1).contiguous() for k, v in param_state.items()})
    save_file(final, result_path)


def run(*args, **kwargs) -> int | None:
    child = FORK.Process(target=train, args=args, kwargs=kwargs)
    child.start()
    child.join(120)
    return child.exitcode


def test_killed_and_resumed_training_is_bitwise_identical(tmp_path):
    assert run(None, str(tmp_path / "straight.safetensors"), seed=1) == 0
    ckpt = str(tmp_path / "ckpt")
    assert run(ckpt, str(tmp_path / "never.safetensors"), seed=1, kill_after=KILL_AFTER_STEP) == -signal.SIGKILL
    resumed_from = CheckpointManager(ckpt).latest_step()
    assert resumed_from is not None and 0 < resumed_from <= KILL_AFTER_STEP
    # Different seed: weights and RNG at start-up differ, so only the checkpoint can make it match.
    assert run(ckpt, str(tmp_path / "resumed.safetensors"), seed=999) == 0
    straight, resumed = load_file(tmp_path / "straight.safetensors"), load_file(tmp_path / "resumed.safetensors")
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


def positions(sampler: ResumableSampler) -> list[int]:
    return list(iter(sampler))


def test_sampler_resumes_at_the_same_global_sample_with_another_world_size():
    # 2 ranks consume 3 global steps of 2 samples per rank = 12 samples.
    two = [ResumableSampler(50, seed=3, rank=r, world_size=2) for r in range(2)]
    full_order = torch.randperm(50, generator=torch.Generator().manual_seed(3)).tolist()
    assert positions(two[0])[:3] == full_order[0:6:2] and positions(two[1])[:3] == full_order[1:6:2]
    for sampler in two:
        sampler.advance(12)
    saved = two[0].state_dict()
    three = [ResumableSampler(50, seed=3, rank=r, world_size=3) for r in range(3)]
    for sampler in three:
        sampler.load_state_dict(saved)
    next_global = sorted(i for s in three for i in positions(s)[:2])
    assert next_global == sorted(full_order[12:18])
    assert len(three[0]) == (50 - 12) // 3


def test_sampler_rolls_over_to_a_new_epoch_with_a_new_order():
    sampler = ResumableSampler(10, seed=0, world_size=1, rank=0)
    first = positions(sampler)
    sampler.advance(10)
    assert sampler.epoch == 1 and sorted(positions(sampler)) == list(range(10)) and positions(sampler) != first
    unshuffled = ResumableSampler(10, shuffle=False, world_size=3, rank=1)
    assert positions(unshuffled) == [1, 4, 7]
    unshuffled.advance(9)  # one sample left for 3 ranks: the epoch is over
    assert unshuffled.epoch == 1 and positions(unshuffled) == [1, 4, 7]


def test_sampler_refuses_a_checkpoint_of_another_dataset():
    saved = ResumableSampler(10, world_size=1, rank=0).state_dict()
    with pytest.raises(CheckpointError, match="dataset_len"):
        ResumableSampler(11, world_size=1, rank=0).load_state_dict(saved)


def test_training_state_restores_every_rng(tmp_path):
    state, _ = build(0)
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, state)
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(6)
    np.random.seed(6)
    torch.manual_seed(6)
    mgr.load(into=state)
    assert (random.random(), np.random.rand()) == expected[:2] and torch.equal(torch.rand(1), expected[2])
