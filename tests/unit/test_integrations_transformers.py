"""The Hugging Face Trainer's SuspendCallback, in process, with a tiny GPT-2 from a config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import slurm_hai.integrations.transformers as hai_hf
from slurm_hai.checkpoint import verify_checkpoint


class Suspended(Exception):
    """Stands for go_suspend(), which never returns."""


def make_trainer(tmp_path: Path, steps: int, callback: hai_hf.SuspendCallback, **overrides) -> Trainer:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=8))
    tokens = torch.randint(0, 64, (24, 8), generator=torch.Generator().manual_seed(1))
    settings = dict(output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=4,
                    learning_rate=1e-3, save_strategy="steps", save_steps=5, logging_strategy="no", report_to=[],
                    use_cpu=True, seed=42, disable_tqdm=True) | overrides
    return Trainer(model=model, args=TrainingArguments(**settings),
                   train_dataset=[{"input_ids": t, "labels": t} for t in tokens], callbacks=[callback])


def committed(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "ckpt").glob("step-*"))


@pytest.fixture
def notice_at(monkeypatch):
    """notice_at(step, callback): the notice arrives after that optimizer step (once); go_suspend raises."""
    calls: list[str] = []

    def arm(step: int, callback: hai_hf.SuspendCallback) -> list[str]:
        monkeypatch.setattr(hai_hf, "receive_suspend_command", lambda: callback.seen_steps.append(1) or
                            len(callback.seen_steps) == step)

        def go_suspend():
            calls.append("go_suspend")
            raise Suspended

        monkeypatch.setattr(hai_hf, "go_suspend", go_suspend)
        callback.seen_steps = []
        return calls

    return arm


def test_every_trainer_save_is_committed_and_output_dir_keeps_none(tmp_path):
    callback = hai_hf.SuspendCallback(tmp_path / "ckpt")
    make_trainer(tmp_path, 10, callback).train(resume_from_checkpoint=callback.resume_from())
    assert committed(tmp_path) == ["step-000000000005", "step-000000000010"]
    assert all(verify_checkpoint(tmp_path / "ckpt" / name).ok for name in committed(tmp_path))
    assert not list((tmp_path / "out").glob("checkpoint-*"))
    assert callback.resume_from() == str(tmp_path / "ckpt" / "step-000000000010")


def test_on_the_notice_the_trainer_saves_commits_and_then_suspends(tmp_path, notice_at):
    callback = hai_hf.SuspendCallback(tmp_path / "ckpt")
    calls = notice_at(3, callback)
    with pytest.raises(Suspended):
        make_trainer(tmp_path, 10, callback).train()
    assert calls == ["go_suspend"]
    assert committed(tmp_path) == ["step-000000000003"]  # committed before go_suspend
    result = verify_checkpoint(tmp_path / "ckpt" / "step-000000000003")
    assert result.ok and {"model.safetensors", "optimizer.pt", "rng_state.pth", "trainer_state.json"} <= set(
        result.manifest.files)


def test_a_suspended_and_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(tmp_path, notice_at):
    whole = make_trainer(tmp_path / "whole", 12, hai_hf.SuspendCallback(tmp_path / "whole" / "ckpt"))
    whole.train()
    callback = hai_hf.SuspendCallback(tmp_path / "ckpt")
    notice_at(7, callback)  # mid-epoch (6 steps per epoch), between periodic saves
    with pytest.raises(Suspended):
        make_trainer(tmp_path, 12, callback).train(resume_from_checkpoint=callback.resume_from())
    resumed = hai_hf.SuspendCallback(tmp_path / "ckpt")
    assert resumed.resume_from().endswith("step-000000000007")
    trainer = make_trainer(tmp_path, 12, resumed)
    trainer.train(resume_from_checkpoint=resumed.resume_from())
    a, b = whole.model.state_dict(), trainer.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_torn_checkpoint_dir_from_a_kill_is_never_resumed_nor_reused(tmp_path):
    callback = hai_hf.SuspendCallback(tmp_path / "ckpt")
    make_trainer(tmp_path, 5, callback).train()
    torn = tmp_path / "out" / "checkpoint-99"  # a kill during the Trainer's save: no trainer_state.json
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"half a model")
    assert get_last_checkpoint(str(tmp_path / "out")) == str(torn)  # what the Trainer itself would pick
    assert callback.resume_from() == str(tmp_path / "ckpt" / "step-000000000005")
    stray = tmp_path / "out" / "checkpoint-10" / "stray.bin"  # a torn save of a step saved again
    stray.parent.mkdir()
    stray.write_bytes(b"from the killed run")
    make_trainer(tmp_path, 10, callback).train(resume_from_checkpoint=callback.resume_from())
    assert "stray.bin" not in verify_checkpoint(tmp_path / "ckpt" / "step-000000000010").manifest.files


@pytest.mark.parametrize("setting", ["save_only_model", "load_best_model_at_end"])
def test_settings_that_cannot_resume_exactly_are_refused_in_one_line(tmp_path, setting):
    args = TrainingArguments(output_dir=str(tmp_path / "out"), save_strategy="steps", save_steps=5,
                             eval_strategy="steps", eval_steps=5, use_cpu=True, report_to=[], **{setting: True})
    with pytest.raises(ValueError, match="^SuspendCallback .* do not set"):
        hai_hf.SuspendCallback(tmp_path / "ckpt").on_init_end(args, None, None)
