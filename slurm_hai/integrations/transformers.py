"""The suspend protocol for the Hugging Face Trainer (`pip install 'slurm-hai[transformers]'`).

    from slurm_hai.integrations.transformers import SuspendCallback

    suspend = SuspendCallback()                       # committed checkpoints: $HAI_JOB_DIR/checkpoints
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[suspend])
    trainer.train(resume_from_checkpoint=suspend.resume_from())   # None on the first run

After every optimizer step the callback polls the notice (all ranks agree through one
all_reduce). On the notice it makes the Trainer save `checkpoint-N/` as usual, commits
that directory with slurm-hai's protocol (integrations/committed.py) and calls
`go_suspend()`. Every save the Trainer makes (`save_steps`) is committed the same way, so
the Trainer's `output_dir` never keeps a checkpoint: a torn `checkpoint-N/` left there by
a kill is never read. `resume_from()` names the newest committed checkpoint that verifies;
the Trainer then restores model, optimizer, scheduler, its RNG state and skips the batches
already trained, so the run continues exactly (same thread count in every run).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

import torch
import transformers
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..runtime.client import go_suspend, receive_suspend_command
from .committed import FrameworkCheckpoints

__all__ = ["SuspendCallback"]

log = logging.getLogger(__name__)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1


def _notice_on_any_rank(device: torch.device) -> bool:
    """Only the processes of node 0 see the notice; every rank must save together."""
    notice = receive_suspend_command()
    if not _distributed():
        return notice
    flag = torch.tensor([1.0 if notice else 0.0], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def _barrier() -> None:
    if _distributed():
        torch.distributed.barrier()


class SuspendCallback(TrainerCallback):
    """Save, commit and suspend on the HAI notice; resume from the newest verified checkpoint.

    checkpoint_dir: where committed checkpoints live (default: $HAI_JOB_DIR/checkpoints,
    else ./checkpoints); a file system every node sees. keep_last: valid checkpoints kept.
    """

    def __init__(self, checkpoint_dir: str | os.PathLike[str] | None = None, *, keep_last: int = 3) -> None:
        self.checkpoints = FrameworkCheckpoints(checkpoint_dir, keep_last=keep_last, framework="transformers",
                                                version=transformers.__version__)
        self.suspending = False

    def resume_from(self) -> str | None:
        """The newest committed checkpoint that verifies (for `trainer.train(resume_from_checkpoint=...)`),
        or None: start from scratch. Call it on every rank."""
        path = self.checkpoints.latest()
        return None if path is None else str(path)

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if args.save_only_model:
            raise ValueError("SuspendCallback needs the optimizer, scheduler and RNG in every checkpoint to "
                             "resume exactly: do not set save_only_model=True")
        if args.load_best_model_at_end:
            raise ValueError("SuspendCallback moves every checkpoint out of output_dir into its committed "
                             "store, so load_best_model_at_end cannot find them: do not set it")
        return control

    def _checkpoint_dir(self, args: TrainingArguments, state: TrainerState) -> Path:
        assert args.output_dir is not None  # the Trainer gives every run one
        return Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if _notice_on_any_rank(args.device):
            self.suspending = True
            control.should_save = True
        if control.should_save:
            if state.is_world_process_zero:
                # Every save that completes is moved out of output_dir: one found there now
                # is a save a kill tore. The Trainer would write into it, keeping its strays.
                shutil.rmtree(self._checkpoint_dir(args, state), ignore_errors=True)
            _barrier()
        return control

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        _barrier()  # every rank wrote its part (rng_state_<rank>.pth) before the commit
        if state.is_world_process_zero:
            committed = self.checkpoints.adopt(state.global_step, self._checkpoint_dir(args, state),
                                               world_size=args.world_size)
            where = committed or self.checkpoints.store.step_path(state.global_step)
            log.info("checkpoint step %d committed: %s", state.global_step, where)
            if self.suspending:
                print(f"slurm-hai: suspend notice: step {state.global_step} committed in {where}; suspending",
                      file=sys.stderr, flush=True)
        _barrier()  # nobody lets go of the nodes before the commit
        if self.suspending:
            go_suspend()
        return control
