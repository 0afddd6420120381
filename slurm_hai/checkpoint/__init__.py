"""Atomic, verified checkpoints for preemptible training (needs the ``torch`` extra).

    from slurm_hai.checkpoint import CheckpointManager, TrainingState, ResumableSampler

The torch-dependent names are imported on first use, so ``slurm_hai.checkpoint.manifest``
(verification, used by ``hai ckpt``) works without torch. Format and guarantees:
docs/checkpoint.md.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .errors import CheckpointError, CorruptCheckpointError, Problem, SupersededRunError
from .manifest import VerifyResult, verify_checkpoint

if TYPE_CHECKING:
    from .manager import CheckpointManager
    from .serialize import PerRank
    from .staging import SaveHandle
    from .training import GlobalBatch, ResumableSampler, TrainingState

_LAZY = {
    "CheckpointManager": "manager",
    "SaveHandle": "staging",
    "PerRank": "serialize",
    "TrainingState": "training",
    "ResumableSampler": "training",
    "GlobalBatch": "training",
}

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CorruptCheckpointError",
    "GlobalBatch",
    "PerRank",
    "Problem",
    "ResumableSampler",
    "SaveHandle",
    "SupersededRunError",
    "TrainingState",
    "VerifyResult",
    "verify_checkpoint",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
