"""Lightning's HaiEnvironment and SuspendCallback, in process, with the tiny module of
tests/fixtures/lightning_tiny.py."""

from __future__ import annotations

import importlib.util
import signal
from pathlib import Path

import lightning
import pytest
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment

import slurm_hai.integrations.lightning as hai_pl
from slurm_hai.checkpoint import verify_checkpoint

_spec = importlib.util.spec_from_file_location(
    "lightning_tiny", Path(__file__).resolve().parents[1] / "fixtures" / "lightning_tiny.py")
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)


class Suspended(Exception):
    """Stands for go_suspend(), which never returns."""


def fit(tmp_path: Path, steps: int, callback: hai_pl.SuspendCallback | None, plugins=None, probe=None,
        accelerator: str = "cpu"):
    lightning.seed_everything(0, verbose=False)
    x = torch.randn(48, 8, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))  # 6 batches per epoch
    model = tiny.TinyModel(step_sleep=0)
    trainer = lightning.Trainer(max_steps=steps, accelerator=accelerator, devices=1,
                                plugins=[hai_pl.HaiEnvironment()] if plugins is None else plugins,
                                callbacks=[c for c in (callback, probe) if c], logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                default_root_dir=tmp_path)
    trainer.fit(model, tiny.ResumableLoader(data, batch_size=8, seed=7), ckpt_path=callback and callback.resume_from())
    return model


def committed(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("step-*"))


@pytest.fixture
def notice_at(monkeypatch):
    """notice_at(step): the notice arrives after that optimizer step (once); go_suspend raises."""
    seen: list[int] = []

    def arm(step: int) -> None:
        monkeypatch.setattr(hai_pl, "receive_suspend_command", lambda: seen.append(1) or len(seen) == step)
        monkeypatch.setattr(hai_pl, "go_suspend", lambda: (_ for _ in ()).throw(Suspended()))

    return arm


def test_the_environment_reads_the_hai_contract(monkeypatch):
    for key, value in {"HAI_CONTRACT": "launcher", "NODE_RANK": "1", "RANK": "1", "WORLD_SIZE": "2",
                       "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "41234", "SLURM_JOB_NUM_NODES": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    env = hai_pl.HaiEnvironment()
    assert hai_pl.HaiEnvironment.detect()
    assert (env.node_rank(), env.main_address, env.main_port) == (1, "10.0.0.7", 41234)
    assert not env.creates_processes_externally  # Lightning starts one process per device
    env.validate_settings(num_devices=4, num_nodes=2)
    with pytest.raises(ValueError, match=r"^Trainer\(num_nodes=1\), but this job has 2 node\(s\): set num_nodes=2"):
        env.validate_settings(num_devices=4, num_nodes=1)
    monkeypatch.setenv("LOCAL_RANK", "3")  # processes that hai.spawn started
    assert env.creates_processes_externally and env.local_rank() == 3
    monkeypatch.delenv("HAI_CONTRACT")
    assert not hai_pl.HaiEnvironment.detect()


@pytest.mark.parametrize("with_callback", [False, True], ids=["lightning-alone", "with-suspend-callback"])
def test_lightnings_slurm_auto_requeue_is_switched_off(tmp_path, monkeypatch, with_callback):
    for key, value in {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "42", "SLURM_PROCID": "0",
                       "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NNODES": "1"}.items():
        monkeypatch.setenv(key, value)
    seen = {}

    class Probe(lightning.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["env"] = trainer._accelerator_connector.cluster_environment
            seen["usr1"] = signal.getsignal(signal.SIGUSR1)

    fit(tmp_path, 2, hai_pl.SuspendCallback(tmp_path / "ckpt") if with_callback else None, plugins=[], probe=Probe())
    assert isinstance(seen["env"], SLURMEnvironment)  # what Lightning picks in a Slurm job
    assert seen["env"].auto_requeue is not with_callback
    assert (seen["usr1"] == signal.SIG_DFL) is with_callback  # no handler that requeues the job itself


def test_on_the_notice_a_checkpoint_with_the_rng_is_committed_before_suspending(tmp_path, notice_at):
    notice_at(3)
    with pytest.raises(Suspended):
        fit(tmp_path, 10, hai_pl.SuspendCallback(tmp_path / "ckpt"))
    assert committed(tmp_path / "ckpt") == ["step-000000000003"]
    result = verify_checkpoint(tmp_path / "ckpt" / "step-000000000003")
    assert result.ok and list(result.manifest.files) == ["lightning.ckpt"]
    saved = torch.load(tmp_path / "ckpt" / "step-000000000003" / "lightning.ckpt", weights_only=True)
    (state,) = [v for k, v in saved["callbacks"].items() if "SuspendCallback" in k]
    assert len(state["rng"]) == 1 and set(state["rng"][0]) == {"python", "numpy", "torch", "cuda"}
    assert not list((tmp_path).glob("hpc_ckpt_*"))


def test_periodic_saves_are_committed_and_keep_last_holds(tmp_path):
    fit(tmp_path, 8, hai_pl.SuspendCallback(tmp_path / "ckpt", keep_last=2, every_n_train_steps=2))
    assert committed(tmp_path / "ckpt") == ["step-000000000006", "step-000000000008"]
    with pytest.raises(ValueError, match="every_n_train_steps must be at least 1"):
        hai_pl.SuspendCallback(tmp_path / "ckpt", every_n_train_steps=0)


def test_a_suspended_and_resumed_fit_ends_with_the_weights_of_an_uninterrupted_one(tmp_path, notice_at):
    whole = fit(tmp_path / "whole", 15, hai_pl.SuspendCallback(tmp_path / "whole" / "ckpt"))
    notice_at(8)  # mid-epoch (6 batches per epoch)
    with pytest.raises(Suspended):
        fit(tmp_path, 15, hai_pl.SuspendCallback(tmp_path / "ckpt"))
    resumed = fit(tmp_path, 15, hai_pl.SuspendCallback(tmp_path / "ckpt"))
    a, b = whole.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
