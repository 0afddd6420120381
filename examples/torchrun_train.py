"""A torchrun script that survives preemption on slurm-hai: torchrun's own variables, DDP,
and the suspend protocol in a few lines.

    hai-submit --torchrun -n 2 -p LOW examples/torchrun_train.py --steps 300
    torchrun --standalone --nproc-per-node 4 examples/torchrun_train.py --ckpt-dir /tmp/ck

`hai-submit --torchrun` runs one torchrun per node, one process per GPU; torchrun sets
RANK, LOCAL_RANK and WORLD_SIZE as usual (docs/user-guide.md, "torchrun"). Every process
of node 0 receives the suspend notice; one all_reduce per step shares it with the other
nodes, all ranks commit a checkpoint together, and rank 0 calls go_suspend(). The job is
requeued and runs this script again from the top, resuming from that checkpoint: the final
weights are bit for bit those of an uninterrupted run with the same world size (the second
command above prints them too).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import slurm_hai as hai
from slurm_hai.checkpoint import CheckpointManager, TrainingState

TAG = "[torchrun]"  # the lines the tests read from the log start with this


def parse_args() -> argparse.Namespace:
    job_dir = os.environ.get("HAI_JOB_DIR", ".")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--save-every", type=int, default=50, help="periodic checkpoint interval (steps)")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (does not change the result)")
    ap.add_argument("--ckpt-dir", default=os.path.join(job_dir, "checkpoints"))
    return ap.parse_args()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of `rank` at `step`: a function of the two only, so a resumed run draws the same data."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(32, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.contiguous().numpy().tobytes())
    return h.hexdigest()


def say(line: str) -> None:
    """One write per line: the processes of a node share its log, and print() writes the
    text and its newline apart, so two ranks' lines could run together."""
    sys.stdout.write(f"{TAG} {line}\n")
    sys.stdout.flush()


def main() -> None:
    args = parse_args()
    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")  # torchrun's rendezvous (env://); "nccl" on GPUs
    ranks = torch.tensor([float(rank)])
    dist.all_reduce(ranks)  # over every process of every node: 0 + 1 + ... + (world - 1)
    say(f"rank {rank}/{world} local_rank {local_rank}/{os.environ['LOCAL_WORLD_SIZE']} node "
        f"{os.environ['GROUP_RANK']} run {hai.restart_count()} threads {torch.get_num_threads()} "
        f"sum of ranks {int(ranks.item())}")

    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    # find_unused_parameters=True keeps DDP's gradient buckets as first laid out, so a resumed
    # run sums gradients in the same order as an uninterrupted one (docs/user-guide.md)
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = TrainingState(model, optimizer)
    mgr = CheckpointManager(args.ckpt_dir, fast_dir=os.environ.get("HAI_NODE_MEMORY"))  # node memory: suspend saves
    if mgr.load(into=state) is not None and rank == 0:
        say(f"resumed from step {state.step}")

    flag = torch.zeros(1)
    while state.step < args.steps:
        flag[0] = float(hai.receive_suspend_command())  # True on every process of node 0 ...
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # ... and now on every node, in the same step
        if flag.item():
            mgr.suspend_save(state.step, state)  # all ranks: committed to every node's memory on return
            say(f"rank {rank} suspends at step {state.step} (notice on this node: {hai.receive_suspend_command()})")
            if rank == 0:
                hai.go_suspend()  # requeued now; never returns
            while True:  # the requeue stops the other ranks
                time.sleep(1)
        x, y = batch(state.step, rank)
        loss = nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        state.step += 1
        if rank == 0 and state.step % 20 == 0:
            say(f"step {state.step}/{args.steps} loss {loss.item():.5f}")
        if state.step % args.save_every == 0:
            mgr.save(state.step, state)
        time.sleep(args.step_sleep)
    mgr.wait()
    if rank == 0:
        say(f"done at step {state.step}: weights sha256={digest(model)}")
    dist.barrier()
    del ddp
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: gloo's threads can abort it now and then
    # (exit 134 after a finished run, see examples/train.py), which would fail the job.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
