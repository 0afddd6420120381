"""What a bitwise-exact resume needs: TrainingState and ResumableSampler.

    sampler = ResumableSampler(len(dataset), seed=1234)
    loader = DataLoader(dataset, batch_size=B, sampler=sampler,
                        generator=torch.Generator())   # see the note below
    state = TrainingState(model, optimizer, scheduler, sampler)
    mgr.load(into=state)                               # no-op on a fresh start
    while state.step < total_steps:
        for inputs, targets in loader:                 # resumes mid-epoch
            ...optimizer.step(); scheduler.step()
            sampler.advance(len(inputs) * world_size)  # global samples consumed
            state.step += 1
            if state.step % 100 == 0:
                mgr.save(state.step, state, blocking=False)

Note: each ``iter(DataLoader)`` draws a base seed from its ``generator``, or from the
global torch RNG when it has none; give the DataLoader its own generator so that
starting an iterator after a resume does not shift the restored global RNG stream.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from .errors import CheckpointError
from .serialize import PerRank

log = logging.getLogger(__name__)


def _distributed_rank_and_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ResumableSampler(Sampler[int]):
    """This rank's share of one global sample stream, positioned by a global count.

    The global stream is epoch 0's order, then epoch 1's, ... (a permutation seeded with
    seed + epoch, or 0..n-1 without shuffle). The position is (epoch, samples consumed
    in that epoch by all ranks together); with W ranks, rank r yields positions
    p + r, p + r + W, ... So a restart with another world size continues at the same
    sample. An epoch ends when fewer than W samples are left (they are skipped, so all
    ranks yield the same count). Call advance() with the GLOBAL number of samples each
    optimizer step consumed; the sampler cannot see what the DataLoader prefetched.
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if dataset_len < 1:
            raise CheckpointError("ResumableSampler needs a non-empty dataset")
        default_rank, default_size = _distributed_rank_and_size()
        self.dataset_len = dataset_len
        self.shuffle = shuffle
        self.seed = seed
        self.rank = default_rank if rank is None else rank
        self.world_size = default_size if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise CheckpointError(f"rank {self.rank} is outside world size {self.world_size}")
        if dataset_len < self.world_size:
            raise CheckpointError(f"a dataset of {dataset_len} samples cannot feed {self.world_size} ranks")
        self.epoch = 0
        self.epoch_offset = 0  # global samples consumed in the current epoch
        self.consumed_samples = 0  # global samples consumed since the start of training
        self._order_cache: tuple[int, list[int]] | None = None

    def _order(self, epoch: int) -> list[int]:
        if self._order_cache is None or self._order_cache[0] != epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(self.dataset_len, generator=generator).tolist()
            else:
                order = list(range(self.dataset_len))
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def _roll_over_if_exhausted(self) -> None:
        if self.dataset_len - self.epoch_offset < self.world_size:
            self.epoch += 1
            self.epoch_offset = 0

    def advance(self, global_samples: int) -> None:
        """Record that all ranks together consumed global_samples more samples."""
        if global_samples < 0:
            raise CheckpointError("advance() takes a non-negative sample count")
        self.consumed_samples += global_samples
        self.epoch_offset = min(self.epoch_offset + global_samples, self.dataset_len)
        self._roll_over_if_exhausted()

    def __len__(self) -> int:
        return (self.dataset_len - self.epoch_offset) // self.world_size

    def __iter__(self) -> Iterator[int]:
        self._roll_over_if_exhausted()
        order = self._order(self.epoch)
        start = self.epoch_offset + self.rank
        for k in range(len(self)):
            yield order[start + k * self.world_size]

    def state_dict(self) -> dict[str, Any]:
        return {
            "dataset_len": self.dataset_len,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "epoch": self.epoch,
            "epoch_offset": self.epoch_offset,
            "consumed_samples": self.consumed_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("dataset_len", "shuffle", "seed"):
            if state[key] != getattr(self, key):
                raise CheckpointError(
                    f"checkpoint sampler has {key}={state[key]!r} but this one has {getattr(self, key)!r}; "
                    "resume with the same dataset and sampler settings"
                )
        self.epoch = int(state["epoch"])
        self.epoch_offset = int(state["epoch_offset"])
        self.consumed_samples = int(state["consumed_samples"])
        self._roll_over_if_exhausted()  # the saving run may have had fewer ranks


@dataclass(frozen=True)
class GlobalBatch:
    """A global batch that stays the same at every world size (elastic jobs): each optimizer
    step consumes `size` samples, split over the ranks in micro-batches of at most `micro`.

        micro, accumulation = GlobalBatch(64, micro=8).plan(world_size)   # 4 ranks: 8 x 2

    Each rank runs `accumulation` micro-batches of `micro` samples (gradients accumulated,
    each loss divided by `accumulation`, DDP averaging over the ranks) before one optimizer
    step: the same samples make each step at every size (with ResumableSampler), so only
    the order of the sums differs.
    """

    size: int
    micro: int

    def plan(self, world_size: int) -> tuple[int, int]:
        """(micro-batch, accumulation steps) for `world_size` ranks: the largest micro-batch
        up to `micro` that divides this rank's share."""
        if world_size < 1 or self.micro < 1 or self.size % world_size:
            raise CheckpointError(f"a global batch of {self.size} samples does not split over {world_size} ranks; "
                                  "choose a global batch that every world size the job may run on divides")
        share = self.size // world_size
        micro = next(m for m in range(min(self.micro, share), 0, -1) if share % m == 0)
        return micro, share // micro


def derived_seed(seed: int, rank: int, step: int) -> int:
    """A seed for a rank that has no saved RNG stream (it did not exist at save time): the
    same for the same (seed, rank, step) on every run."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{rank}:{step}".encode()).digest()[:8], "little") >> 1


def seed_rng(seed: int) -> None:
    """Seed python, numpy (legacy global), torch CPU and CUDA from one seed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng() -> dict[str, Any]:
    """This process's RNG states: python, numpy (legacy global), torch CPU, CUDA."""
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state_all()
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": cuda,
    }


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        if len(state["cuda"]) != torch.cuda.device_count():
            log.warning("checkpoint has CUDA RNG state for %d devices, this node has %d: CUDA RNG not restored",
                        len(state["cuda"]), torch.cuda.device_count())
        else:
            torch.cuda.set_rng_state_all(state["cuda"])


class TrainingState:
    """Model, optimizer, scheduler, sampler, step/epoch counters and this rank's RNG, as
    one object with state_dict()/load_state_dict() for CheckpointManager.save/load.

    The RNG state is saved per rank (PerRank), so each rank restores its own stream; a
    rank that did not exist when the checkpoint was written (an elastic job that grew) gets
    a stream derived from (`seed`, its rank, the step): the same on every such resume.
    `seed` defaults to the sampler's.
    extra: more stateful objects or plain values to carry along (e.g. a GradScaler).
    on_resize(old, new): called after a load that finds another world size than the
    checkpoint's (an elastic job that shrank or grew): change the learning rate or the
    batch there. `resized` is (old, new) after such a load, else None.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        sampler: ResumableSampler | None = None,
        *,
        extra: dict[str, Any] | None = None,
        seed: int | None = None,
        on_resize: Callable[[int, int], None] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.sampler = sampler
        self.extra = extra or {}
        self.seed = seed if seed is not None else (sampler.seed if sampler is not None else 0)
        self.on_resize = on_resize
        self.resized: tuple[int, int] | None = None
        self.step = 0
        self.epoch = 0

    def _parts(self) -> dict[str, Any]:
        parts = {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler, "sampler": self.sampler}
        return {name: part for name, part in parts.items() if part is not None}

    def state_dict(self) -> dict[str, Any]:
        state = {name: part.state_dict() for name, part in self._parts().items()}
        state["progress"] = {"step": self.step, "epoch": self.epoch, "world_size": _distributed_rank_and_size()[1]}
        state["extra"] = {
            name: value.state_dict() if callable(getattr(value, "state_dict", None)) else value
            for name, value in self.extra.items()
        }
        state["rng"] = PerRank(capture_rng())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, part in self._parts().items():
            if name not in state:
                raise CheckpointError(f"checkpoint has no {name} state; it was saved without one")
            part.load_state_dict(state[name])
        self.step = int(state["progress"]["step"])
        self.epoch = int(state["progress"]["epoch"])
        for name, value in self.extra.items():
            if callable(getattr(value, "load_state_dict", None)):
                value.load_state_dict(state["extra"][name])
            else:
                self.extra[name] = state["extra"][name]
        # RNG last: loading the other parts must not consume random numbers afterwards.
        rank, world = _distributed_rank_and_size()
        if state.get("rng") is None:  # this rank did not exist when it was saved
            seed_rng(derived_seed(self.seed, rank, self.step))
        else:
            restore_rng(state["rng"])
        saved = int(state["progress"].get("world_size", world))
        self.resized = (saved, world) if saved != world else None
        if self.resized and self.on_resize is not None:
            self.on_resize(*self.resized)
