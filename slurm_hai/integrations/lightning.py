"""The suspend protocol for Lightning (`pip install 'slurm-hai[lightning]'`).

    from slurm_hai.integrations.lightning import HaiEnvironment, SuspendCallback

    suspend = SuspendCallback(every_n_train_steps=500)    # committed checkpoints: $HAI_JOB_DIR/checkpoints
    trainer = Trainer(..., plugins=[HaiEnvironment()], callbacks=[suspend])
    trainer.fit(model, train_loader, ckpt_path=suspend.resume_from())   # None on the first run

HaiEnvironment: Lightning's view of the HAI contract. The job runs the script once per node
(RANK/NODE_RANK = node rank, MASTER_ADDR/MASTER_PORT = rank 0's node); Lightning starts
one process per device itself, or takes the processes `hai.spawn` started (LOCAL_RANK
set). Without it Lightning takes the job for a plain Slurm job (SLURMEnvironment) and
counts one process per node.

SuspendCallback: after every training batch it polls the notice (rank 0 decides for all);
on the notice it saves a checkpoint into a staging dir of slurm-hai's store, commits it
(integrations/committed.py) and calls `go_suspend()`; `every_n_train_steps` adds periodic
committed saves. It stores every rank's python/numpy/torch/CUDA RNG in the checkpoint and
restores it at the first batch after a resume (Lightning stores none; restoring when the
checkpoint loads is too early: starting the DataLoader iterator draws from the RNG). It
switches off Lightning's own SLURM auto-requeue (its SIGUSR1 handler saves an
`hpc_ckpt` and requeues the job itself, racing the suspend protocol). A mid-epoch resume
continues exactly only with a train DataLoader that has `state_dict`/`load_state_dict`
(docs/integrations.md); Lightning restarts the epoch for any other.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, cast

import lightning
import numpy as np
import torch
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer

from ..checkpoint.training import capture_rng, restore_rng
from ..runtime.client import go_suspend, receive_suspend_command
from .committed import FrameworkCheckpoints

__all__ = ["HaiEnvironment", "SuspendCallback"]

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "lightning.ckpt"


class HaiEnvironment(LightningEnvironment):
    """The HAI contract for Lightning: node rank from NODE_RANK, rendezvous at
    MASTER_ADDR:MASTER_PORT (rank 0's node), one process per device on each node; world
    size and global ranks as Lightning computes them (nodes x devices)."""

    @staticmethod
    def detect() -> bool:
        return bool(os.environ.get("HAI_CONTRACT"))

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        nodes = os.environ.get("SLURM_STEP_NUM_NODES") or os.environ.get("SLURM_JOB_NUM_NODES")
        if nodes and int(nodes) != num_nodes:
            raise ValueError(f"Trainer(num_nodes={num_nodes}), but this job has {nodes} node(s): "
                             f"set num_nodes={nodes} (hai-submit -n sets the nodes)")


def _weights_only_rng() -> dict[str, Any]:
    """capture_rng() in types that `torch.load(weights_only=True)` (Lightning's) accepts."""
    state = capture_rng()
    name, keys, pos, has_gauss, cached = state["numpy"]
    state["numpy"] = [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
    return state


def _restore_weights_only_rng(state: dict[str, Any]) -> None:
    name, keys, pos, has_gauss, cached = state["numpy"]
    restore_rng({**state, "numpy": (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached)})


class SuspendCallback(Callback):
    """Save, commit and suspend on the HAI notice; resume from the newest verified checkpoint.

    checkpoint_dir: where committed checkpoints live (default: $HAI_JOB_DIR/checkpoints,
    else ./checkpoints); a file system every node sees. keep_last: valid checkpoints kept.
    every_n_train_steps: also save and commit every N optimizer steps (None: only on the
    notice).
    """

    def __init__(self, checkpoint_dir: str | os.PathLike[str] | None = None, *, keep_last: int = 3,
                 every_n_train_steps: int | None = None) -> None:
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be at least 1, got {every_n_train_steps}")
        self.checkpoints = FrameworkCheckpoints(checkpoint_dir, keep_last=keep_last, framework="lightning",
                                                version=lightning.__version__)
        self.every_n_train_steps = every_n_train_steps
        self._last_saved_step: int | None = None
        self._rng_to_restore: dict[str, Any] | None = None

    def resume_from(self) -> str | None:
        """The newest committed checkpoint that verifies (for `trainer.fit(..., ckpt_path=...)`),
        or None: start from scratch. Call it on every rank."""
        path = self.checkpoints.latest()
        return None if path is None else str(path / CHECKPOINT_FILE)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Before Lightning installs its signal handlers (Trainer._run): no SIGUSR1 requeue.
        environment = trainer._accelerator_connector.cluster_environment
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            environment.auto_requeue = False
            log.info("switched off Lightning's SLURM auto-requeue: slurm-hai handles the suspend notice "
                     "(pass plugins=[HaiEnvironment()] so that Lightning reads the HAI contract)")

    def state_dict(self) -> dict[str, Any]:
        rng = _weights_only_rng()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            every_rank: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(every_rank, rng)
            return {"rng": every_rank}
        return {"rng": [rng]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        rank = torch.distributed.get_rank() if torch.distributed.is_available() and \
            torch.distributed.is_initialized() else 0
        saved = state_dict.get("rng", [])
        if rank < len(saved):
            self._rng_to_restore = saved[rank]
        else:
            log.warning("the checkpoint has no RNG state for rank %d (saved by %d ranks): not restored", rank,
                        len(saved))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._rng_to_restore is not None:
            _restore_weights_only_rng(self._rng_to_restore)
            self._rng_to_restore = None

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        notice = trainer.strategy.broadcast(receive_suspend_command(), src=0)  # rank 0 is on node 0
        due = self.every_n_train_steps is not None and step % self.every_n_train_steps == 0
        if (notice or due) and step != self._last_saved_step:
            where = self._save(trainer, step)
            if notice and trainer.is_global_zero:
                print(f"slurm-hai: suspend notice: step {step} committed in {where}; suspending", file=sys.stderr,
                      flush=True)
        if notice:
            go_suspend()

    def _save(self, trainer: Trainer, step: int) -> Path:
        mine = self.checkpoints.new_staging(step) if trainer.is_global_zero else None
        staging = Path(cast(Path, trainer.strategy.broadcast(mine, src=0)))  # rank 0's, on every rank
        trainer.save_checkpoint(staging / CHECKPOINT_FILE)  # every rank: it is collective
        if trainer.is_global_zero:
            self.checkpoints.commit(step, staging, world_size=trainer.world_size)
        trainer.strategy.barrier("slurm-hai commit")  # nobody lets go of the nodes before the commit
        self._last_saved_step = step
        return self.checkpoints.store.step_path(step)
