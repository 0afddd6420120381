"""A sharded job on the GPU: two processes over gloo (one per simulated node), each holding
CUDA tensors (a replicated model and optimizer, and DTensor shards on a CUDA mesh). They
save blocking, async and to node memory at a suspend; fresh processes load each back into
CUDA tensors bit for bit, each rank's CUDA RNG stream included; the agents then commit the
suspend checkpoint durably."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from slurm_hai.checkpoint import CheckpointManager, TrainingState, verify_checkpoint
from slurm_hai.checkpoint import memory
from slurm_hai.checkpoint.agent import Agent, prepare_spool
from slurm_hai.checkpoint.manifest import step_dir_name

WORLD = 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join(rank: int, port: int, base: Path) -> Path:
    """This process as rank `rank` on node n<rank+1> (its name, its agent's spool); returns its memory."""
    os.environ["SLURMD_NODENAME"] = f"n{rank + 1}"
    os.environ["HAI_PERSIST_SPOOL"] = str(base / f"n{rank + 1}" / "spool")
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    return base / f"n{rank + 1}" / "shm"


def make_state(rank: int, fill: float | None = None) -> dict:
    """A replicated model + optimizer (as under DDP) and two row-sharded DTensors, on the GPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    cuda = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Dropout(0.2), torch.nn.Linear(64, 4)).to(cuda)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):  # the same batch on every rank: the replicas stay equal without an all-reduce
        loss = model(torch.randn(16, 32, device=cuda, generator=torch.Generator(cuda).manual_seed(1))).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    training = TrainingState(model, optimizer)
    mesh = init_device_mesh("cuda", (WORLD,))
    generator = torch.Generator(cuda).manual_seed(10 + rank)
    shards = [torch.randn(2048, 512, device=cuda, generator=generator),
              torch.randn(3, 5, device=cuda, generator=generator).to(torch.bfloat16)]
    if fill is not None:
        for p in model.parameters():
            p.data.fill_(fill)
        for shard in shards:
            shard.fill_(fill)
    torch.cuda.manual_seed(100 + rank if fill is None else 999)  # each rank's own CUDA stream
    return {"train": training, "shards": {f"w{i}": DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
                                          for i, t in enumerate(shards)}}


def host_copy(state: dict) -> dict[str, torch.Tensor]:
    values = {f"model.{k}": v.detach().cpu().clone() for k, v in state["train"].model.state_dict().items()}
    for index, param_state in state["train"].optimizer.state_dict()["state"].items():
        values.update({f"opt.{index}.{k}": torch.as_tensor(v).cpu().reshape(-1).clone()
                       for k, v in param_state.items()})
    values.update({name: d.to_local().cpu().clone() for name, d in state["shards"].items()})
    return values


def bump(state: dict, by: float) -> None:
    with torch.no_grad():
        for p in state["train"].model.parameters():
            p.add_(by)
        for d in state["shards"].values():
            d.to_local().add_(by)


def _save_rank(rank: int, port: int, base: str) -> None:
    base_path = Path(base)
    fast = join(rank, port, base_path)
    try:
        state = make_state(rank)
        mgr = CheckpointManager(base_path / "durable", fast_dir=fast)
        state["train"].step = 1
        mgr.save(1, state)

        bump(state, 1.0)
        state["train"].step = 2
        expected = host_copy(state)
        handle = mgr.save(2, state, blocking=False)
        bump(state, 100.0)  # right after save() returns: must not reach step 2
        handle.wait()
        save_file(expected, str(base_path / f"step2-rank{rank}.safetensors"))

        state["train"].step = 3
        assert mgr.suspend_save(3, state).where == "node memory"
        expected = host_copy(state)
        expected["next_random"] = torch.rand(64, device="cuda").cpu()
        save_file(expected, str(base_path / f"step3-rank{rank}.safetensors"))
        mgr.close()
    finally:
        dist.destroy_process_group()


def _load_rank(rank: int, port: int, base: str, step: int) -> None:
    base_path = Path(base)
    fast = join(rank, port, base_path)
    try:
        state = make_state(rank, fill=0.0)
        mgr = CheckpointManager(base_path / "durable", fast_dir=fast)
        mgr.load(into=state) if step == 3 else mgr.load(step, into=state)
        assert mgr.loaded_step == step, mgr.loaded_step
        where = "node memory" if step == 3 else str(base_path / "durable")
        assert mgr.loaded_from == where, (mgr.loaded_from, where)
        assert state["train"].step == step
        expected = load_file(str(base_path / f"step{step}-rank{rank}.safetensors"))
        got = host_copy(state)
        if step == 3:
            got["next_random"] = torch.rand(64, device="cuda").cpu()
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            assert got[name].dtype == value.dtype and torch.equal(got[name], value), (rank, step, name)
        assert all(p.is_cuda for p in state["train"].model.parameters())
        assert all(d.to_local().is_cuda for d in state["shards"].values())
        mgr.close()
        (base_path / f"loaded-{step}-{rank}.ok").write_text("")
    finally:
        dist.destroy_process_group()


def spawn(fn, base: Path, *args) -> None:
    """CUDA needs fresh processes (spawn), never forked ones."""
    mp.start_processes(fn, args=(free_port(), str(base), *args), nprocs=WORLD, start_method="spawn")


def test_two_gpu_processes_save_every_way_and_load_back_bitwise(cuda, tmp_path):
    agents = []
    for rank in range(WORLD):
        spool = tmp_path / f"n{rank + 1}" / "spool"
        prepare_spool(spool)
        memory.write_agent_pidfile(spool)  # this test process stands in for each node's agent
        agents.append(Agent(spool))
    spawn(_save_rank, tmp_path)
    for step in (1, 2):
        assert verify_checkpoint(tmp_path / "durable" / step_dir_name(step)).ok
    spawn(_load_rank, tmp_path, 3)  # from node memory: the restart landed where it was saved
    spawn(_load_rank, tmp_path, 2)  # an async save, from the durable directory
    assert len(list(tmp_path.glob("loaded-*.ok"))) == 2 * WORLD
    for agent in agents:
        agent.serve(poll=0.02, once=True)
    assert verify_checkpoint(tmp_path / "durable" / step_dir_name(3)).ok
