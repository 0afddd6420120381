"""CheckpointManager with a model and optimizer on the GPU, in one process: blocking, async
and suspend saves, each loaded back into CUDA tensors bit for bit, CUDA RNG included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slurm_hai.checkpoint import CheckpointManager, TrainingState, verify_checkpoint
from slurm_hai.checkpoint import memory


def trained_state(device: torch.device, seed: int = 0) -> TrainingState:
    """A small MLP with AdamW after three steps on `device` (so the optimizer has state)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(256, 8)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        loss = model(torch.randn(32, 64, device=device)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    state = TrainingState(model, optimizer)
    state.step = 3
    return state


def snapshot(state: TrainingState) -> dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer, copied to the CPU."""
    values = {f"model.{k}": v.detach().cpu().clone() for k, v in state.model.state_dict().items()}
    for index, param_state in state.optimizer.state_dict()["state"].items():
        values.update({f"opt.{index}.{k}": torch.as_tensor(v).cpu().clone() for k, v in param_state.items()})
    return values


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes on the CPU: equal bits, NaNs included, for any dtype (fp8 too)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise(state: TrainingState, expected: dict[str, torch.Tensor], device: torch.device) -> None:
    assert all(p.device == device for p in state.model.parameters())
    got = snapshot(state)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and torch.equal(bits(got[name]), bits(value)), name


def fresh_state(device: torch.device) -> TrainingState:
    state = trained_state(device, seed=99)  # other weights, other optimizer moments
    torch.cuda.manual_seed_all(12345)  # another CUDA RNG stream than the saved one
    return state


def test_a_blocking_save_of_cuda_state_loads_back_bitwise_with_the_cuda_rng(cuda, tmp_path):
    state = trained_state(cuda)
    expected = snapshot(state)
    mgr = CheckpointManager(tmp_path / "ckpt")
    mgr.save(state.step, state)
    next_draw = torch.rand(1000, device=cuda)  # what the CUDA RNG gives after the save
    assert verify_checkpoint(tmp_path / "ckpt" / "step-000000000003").ok

    resumed = fresh_state(cuda)
    loaded = CheckpointManager(tmp_path / "ckpt").load(into=resumed)
    assert resumed.step == 3
    assert_bitwise(resumed, expected, cuda)
    assert torch.equal(torch.rand(1000, device=cuda), next_draw)  # dropout continues the same stream
    # load() hands back host tensors: nothing of the checkpoint is left on the GPU
    assert all(not t.is_cuda for t in loaded["model"].values())


def test_an_async_save_holds_the_values_the_gpu_had_when_save_returned(cuda, tmp_path):
    state = trained_state(cuda)
    mgr = CheckpointManager(tmp_path / "ckpt", fast_dir=tmp_path / "fast")
    with torch.no_grad():
        torch.cuda._sleep(200_000_000)  # ~0.1 s of queued GPU work before the last update lands
        for p in state.model.parameters():
            p.add_(1.0)
    expected = snapshot(state)  # (synchronises: the values after the queued update)
    with torch.no_grad():
        torch.cuda._sleep(200_000_000)
        for p in state.model.parameters():
            p.mul_(3.0)  # queued before save(): the save must see it
    expected = {k: (v * 3.0 if k.startswith("model.") else v) for k, v in expected.items()}
    handle = mgr.save(state.step, state, blocking=False)
    with torch.no_grad():  # training goes on at once: these must not reach the checkpoint
        for p in state.model.parameters():
            p.zero_()
    handle.wait()
    staged = mgr._buffer.reserve(1)
    assert staged.is_pinned() and staged.data_ptr() % 4096 == 0  # DMA copies, O_DIRECT writes
    for where in ("fast", "ckpt"):
        assert verify_checkpoint(tmp_path / where / "step-000000000003").ok

    resumed = fresh_state(cuda)
    mgr.load(into=resumed)
    assert mgr.loaded_from == str(tmp_path / "fast")
    assert_bitwise(resumed, expected, cuda)


@pytest.fixture
def with_agent(tmp_path, monkeypatch) -> Path:
    """This process stands in for the node's persist agent (its pid file), as in the unit tests."""
    spool = tmp_path / "spool"
    spool.mkdir()
    monkeypatch.setenv("HAI_PERSIST_SPOOL", str(spool))
    memory.write_agent_pidfile(spool)
    return spool


def test_a_suspend_save_of_cuda_state_goes_to_node_memory_and_loads_back_to_the_gpu(cuda, tmp_path, with_agent):
    state = trained_state(cuda)
    expected = snapshot(state)
    mgr = CheckpointManager(tmp_path / "ckpt", fast_dir=tmp_path / "shm")
    handle = mgr.suspend_save(state.step, state)
    assert handle.done() and handle.where == "node memory"
    assert handle.nbytes > sum(v.numel() * v.element_size() for v in expected.values())
    next_draw = torch.rand(1000, device=cuda)
    assert list(with_agent.glob("*.json")), "no request for the persist agent was filed"

    resumed = fresh_state(cuda)
    restart = CheckpointManager(tmp_path / "ckpt", fast_dir=tmp_path / "shm")
    restart.load(into=resumed)
    assert restart.loaded_from == "node memory" and restart.loaded_step == 3
    assert_bitwise(resumed, expected, cuda)
    assert torch.equal(torch.rand(1000, device=cuda), next_draw)


def test_bf16_and_fp8_gpu_tensors_keep_their_dtype_and_bits(cuda, tmp_path):
    generator = torch.Generator(device=cuda).manual_seed(7)
    tensors = {
        "bf16": torch.randn(4096, 33, device=cuda, generator=generator).to(torch.bfloat16),
        "fp16": torch.randn(513, device=cuda, generator=generator).half(),
        "fp8": torch.randn(1024, device=cuda, generator=generator).to(torch.float8_e4m3fn),
        "int64": torch.randint(-2**40, 2**40, (77,), device=cuda, generator=generator),
        "strided": torch.randn(64, 64, device=cuda, generator=generator).t(),  # not contiguous
        "empty": torch.empty(0, 3, device=cuda),
    }
    mgr = CheckpointManager(tmp_path / "ckpt")
    mgr.save(1, {"t": tensors})
    targets = {name: torch.full_like(t, 0) for name, t in tensors.items()}
    mgr.load(into={"t": targets})
    for name, t in tensors.items():
        assert targets[name].device == t.device and targets[name].dtype == t.dtype, name
        assert torch.equal(bits(targets[name]), bits(t)), name
