"""The Hugging Face Trainer and Lightning integrations training on the GPU: a run suspended
mid-epoch and resumed from its committed checkpoint ends with the weights of an
uninterrupted one, bit for bit. The runs are the unit tests' (tests/unit), on CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the unit tests' runs and notice

import test_integrations_lightning as pl_runs  # noqa: E402
import test_integrations_transformers as hf_runs  # noqa: E402
import torch  # noqa: E402

import slurm_hai.integrations.lightning as hai_pl  # noqa: E402
import slurm_hai.integrations.transformers as hai_hf  # noqa: E402

notice_at_hf = hf_runs.notice_at
notice_at_pl = pl_runs.notice_at


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_trainer_suspended_on_the_gpu_resumes_to_the_weights_of_an_uninterrupted_run(cuda, tmp_path, notice_at_hf):
    whole = hf_runs.make_trainer(tmp_path / "whole", 12, hai_hf.SuspendCallback(tmp_path / "whole" / "ckpt"),
                                 use_cpu=False)
    whole.train()
    assert whole.model.device.type == "cuda"
    callback = hai_hf.SuspendCallback(tmp_path / "ckpt")
    notice_at_hf(7, callback)  # mid-epoch (6 steps per epoch), between periodic saves
    with pytest.raises(hf_runs.Suspended):
        hf_runs.make_trainer(tmp_path, 12, callback, use_cpu=False).train(resume_from_checkpoint=callback.resume_from())
    resumed = hai_hf.SuspendCallback(tmp_path / "ckpt")
    assert resumed.resume_from().endswith("step-000000000007")
    trainer = hf_runs.make_trainer(tmp_path, 12, resumed, use_cpu=False)
    trainer.train(resume_from_checkpoint=resumed.resume_from())
    assert trainer.model.device.type == "cuda"
    assert same_weights(whole.model.state_dict(), trainer.model.state_dict())


class DeviceProbe(lightning.Callback):
    """The devices the module trained on (Lightning moves it back to the CPU when fit ends)."""

    def __init__(self) -> None:
        self.devices: set[str] = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.devices.add(pl_module.device.type)


def test_a_lightning_fit_suspended_on_the_gpu_resumes_to_the_weights_of_an_uninterrupted_one(cuda, tmp_path,
                                                                                             notice_at_pl):
    whole = pl_runs.fit(tmp_path / "whole", 15, hai_pl.SuspendCallback(tmp_path / "whole" / "ckpt"), accelerator="gpu")
    notice_at_pl(8)  # mid-epoch (6 batches per epoch)
    with pytest.raises(pl_runs.Suspended):
        pl_runs.fit(tmp_path, 15, hai_pl.SuspendCallback(tmp_path / "ckpt"), accelerator="gpu")
    probe = DeviceProbe()
    resumed = pl_runs.fit(tmp_path, 15, hai_pl.SuspendCallback(tmp_path / "ckpt"), accelerator="gpu", probe=probe)
    assert probe.devices == {"cuda"}
    assert same_weights(whole.state_dict(), resumed.state_dict())
