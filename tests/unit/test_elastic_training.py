"""What an elastic job needs to resume at another size (issue 11, item 4): the global batch
split per world size, the resize hook, RNG for ranks that did not exist, and the sample
stream continued exactly across sizes."""

from __future__ import annotations

import pytest
import torch

from slurm_hai.checkpoint import CheckpointError, GlobalBatch, ResumableSampler, TrainingState
from slurm_hai.checkpoint.training import derived_seed


def test_the_global_batch_is_split_into_micro_batches_and_accumulation_per_world_size():
    batch = GlobalBatch(64, micro=8)
    assert [batch.plan(w) for w in (1, 2, 4, 8)] == [(8, 8), (8, 4), (8, 2), (8, 1)]
    assert GlobalBatch(48, micro=8).plan(4) == (6, 2)  # 12 per rank: the largest micro-batch that divides it
    assert GlobalBatch(48, micro=8).plan(3) == (8, 2)
    for w in (1, 2, 3, 4, 6):
        micro, acc = GlobalBatch(48, micro=8).plan(w)
        assert micro * acc * w == 48 and micro <= 8
    with pytest.raises(CheckpointError, match="does not split over 5 ranks"):
        GlobalBatch(48, micro=8).plan(5)


def test_the_sample_stream_of_each_step_is_the_same_at_every_world_size():
    """4 ranks, then 2, then 4 again: every step consumes the same samples as one rank would."""
    def steps(sizes_and_counts: list[tuple[int, int]], n: int = 96, g: int = 16) -> list[list[int]]:
        state = None
        out = []
        for world, count in sizes_and_counts:
            samplers = [ResumableSampler(n, seed=7, rank=r, world_size=world) for r in range(world)]
            for s in samplers:
                if state:
                    s.load_state_dict(state)
            iters = [iter(s) for s in samplers]
            for _ in range(count):
                per_rank = [[next(it) for _ in range(g // world)] for it in iters]
                # global order: rank r's k-th sample is position k * world + r
                out.append([per_rank[r][k] for k in range(g // world) for r in range(world)])
                for s in samplers:
                    s.advance(g)
                if samplers[0].epoch_offset == 0:  # a new epoch: new iterators
                    iters = [iter(s) for s in samplers]
            state = samplers[0].state_dict()
        return out

    reference = steps([(1, 15)])
    assert steps([(4, 5), (2, 4), (4, 6)]) == reference
    assert sorted(sum(reference[:6], [])) == list(range(96))  # one epoch: each sample once


def _state(model: torch.nn.Module, **kw) -> TrainingState:
    return TrainingState(model, torch.optim.SGD(model.parameters(), lr=0.1), **kw)


def test_a_resume_at_another_world_size_calls_the_resize_hook_and_a_new_rank_gets_a_derived_rng():
    model = torch.nn.Linear(2, 2)
    saved = _state(model).state_dict()
    saved["progress"]["world_size"] = 4  # as if saved by 4 ranks
    saved["rng"] = None  # this rank (0 here) had no stream of its own then
    calls = []
    state = _state(model, seed=11, on_resize=lambda old, new: calls.append((old, new)))
    state.step = 0
    saved["progress"]["step"] = 30
    state.load_state_dict(saved)
    assert calls == [(4, 1)] and state.resized == (4, 1)
    first = torch.rand(3)
    torch.manual_seed(999)
    _state(model, seed=11).load_state_dict(saved)
    assert torch.equal(torch.rand(3), first)  # the same stream for the same (seed, rank, step)
    assert derived_seed(11, 0, 30) != derived_seed(11, 1, 30) != derived_seed(11, 0, 31)
    # the same world size: no hook, and the saved stream is restored
    same = _state(model).state_dict()
    same["rng"] = same["rng"].value  # what the manager hands this rank
    state = _state(model, on_resize=lambda old, new: calls.append((old, new)))
    state.load_state_dict(same)
    assert state.resized is None and calls == [(4, 1)]
