"""An elastic training job: runs on any node count between MIN and MAX, resumes at each size.

    hai-submit -n 2:4 -p LOW examples/elastic_train.py -- --steps 300
    python examples/elastic_train.py --steps 300        # the same run on one process, no cluster

When a higher job needs some of its nodes, the job is preempted, commits a checkpoint and
runs again on the nodes left; when nodes stay idle, the policy daemon asks it to grow back
(docs/user-guide.md, "Elastic jobs"). Each run may have another world size, so:

1. The global batch stays the same: `GlobalBatch(48, micro=8).plan(world)` gives each rank
   its micro-batch and the gradient accumulation steps (4 ranks: 6 x 2; 3 ranks: 8 x 2;
   2 ranks: 8 x 3). Choose a global batch that every size of the job's range divides, and a
   data set of whole global batches (an epoch then ends with a step).
2. The data position is a global sample count (`ResumableSampler`): every step consumes the
   same samples at every size, and each sample of an epoch is seen once.
3. Model and optimizer are saved with `CheckpointManager` (DCP) and resharded on load.
4. `TrainingState(on_resize=...)` is the place to change the learning rate or the batch at
   a size change; a rank that did not exist at save time gets a derived RNG stream.

In float64 the final weights match an uninterrupted run within 1e-9 (only the order of the
sums differs across sizes), and the samples of every step are the same
(tests/cluster/test_elastic_resize.py). `--ids-out` logs them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import slurm_hai as hai
from slurm_hai import get_rank, get_world_size, init_process_group, spawn
from slurm_hai.checkpoint import CheckpointManager, GlobalBatch, ResumableSampler, TrainingState

TAG = "[elastic]"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    job_dir = os.environ.get("HAI_JOB_DIR")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps in all")
    ap.add_argument("--global-batch", type=int, default=48,
                    help="samples per optimizer step, at every size (48: any size from 1 to 4, 6 or 8)")
    ap.add_argument("--micro", type=int, default=8, help="the most samples one rank computes at once")
    ap.add_argument("--samples", type=int, default=960, help="size of the synthetic data set (whole global batches)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--ckpt-dir", default=os.path.join(job_dir, "checkpoints") if job_dir else "checkpoints")
    ap.add_argument("--out", default=os.path.join(job_dir, "final-weights.safetensors") if job_dir
                    else "final-weights.safetensors", help="where rank 0 writes the final weights")
    ap.add_argument("--ids-out", default="", help="rank 0 appends each step's sample ids here (JSON lines)")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (a watchable demo)")
    ap.add_argument("--sleep-until", default="", help="with --step-sleep: no more sleeping once this file exists")
    args = ap.parse_args(argv)
    if args.samples % args.global_batch:
        ap.error(f"--samples {args.samples} is not a whole number of global batches of {args.global_batch}")
    return args


def log(msg: str) -> None:
    if get_rank() == 0:
        print(f"{TAG} {msg}", flush=True)


def synthetic_dataset(n: int, seed: int) -> TensorDataset:
    """Regression on a fixed random 'teacher', with each sample's id as the third field."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g, dtype=torch.float64)
    y = torch.tanh(x @ torch.randn(16, 4, generator=g, dtype=torch.float64))
    return TensorDataset(x, y, torch.arange(n))


def main(local_rank: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    init_process_group("gloo")
    rank, world = get_rank(), get_world_size()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    dataset = synthetic_dataset(args.samples, args.seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).double()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sampler = ResumableSampler(len(dataset), shuffle=True, seed=args.seed)
    micro, accumulation = GlobalBatch(args.global_batch, args.micro).plan(world)
    loader = DataLoader(dataset, batch_size=micro, sampler=sampler, generator=torch.Generator())

    def resized(old: int, new: int) -> None:  # the per-size hook: the global batch is kept, so the LR is too
        log(f"world size {old} -> {new}: micro-batch {micro} x {accumulation} accumulation steps per rank")

    state = TrainingState(model, optimizer, None, sampler, on_resize=resized)
    # HAI_NODE_MEMORY: suspend saves go to node memory and the nodes' persist agents make them
    # durable; a restart at another size waits for that and reshards from the durable copy.
    mgr = CheckpointManager(args.ckpt_dir, keep_last=2, fast_dir=os.environ.get("HAI_NODE_MEMORY"))
    mgr.load(into=state)
    log(f"run {hai.restart_count()}: world {world}, step {state.step}, micro-batch {micro} x {accumulation}")

    batches = iter(loader)
    notice = torch.zeros(1)
    while state.step < args.steps:
        notice[0] = 1.0 if hai.receive_suspend_command() else 0.0
        dist.all_reduce(notice, op=dist.ReduceOp.MAX)
        if notice.item():
            if rank == 0:
                log(f"notice at step {state.step}: next run on {hai.target_size()} node(s) (0: suspended whole)")
            mgr.suspend_save(state.step, state)  # collective: committed to every node's memory
            if rank == 0:
                hai.go_suspend()
            while True:
                time.sleep(1)
        optimizer.zero_grad(set_to_none=True)
        ids: list[int] = []
        for k in range(accumulation):
            try:
                x, y, idx = next(batches)
            except StopIteration:  # the epoch ended with the last step
                batches = iter(loader)
                x, y, idx = next(batches)
            with ddp.no_sync() if k < accumulation - 1 else contextlib.nullcontext():
                (nn.functional.mse_loss(ddp(x), y) / accumulation).backward()
            ids += idx.tolist()
        optimizer.step()
        sampler.advance(args.global_batch)
        state.step += 1
        per_rank = [None] * world
        dist.all_gather_object(per_rank, ids)
        if rank == 0 and args.ids_out:  # the step's samples in global order: rank r's k-th is k * world + r
            in_order = [per_rank[r][k] for k in range(len(ids)) for r in range(world)]
            with open(args.ids_out, "a") as f:
                f.write(json.dumps({"step": state.step, "ids": in_order}) + "\n")
        if state.step % 50 == 0:
            log(f"step {state.step}/{args.steps}")
        if args.step_sleep and not (args.sleep_until and os.path.exists(args.sleep_until)):
            time.sleep(args.step_sleep)

    if rank == 0:
        from safetensors.torch import save_file

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{args.out}.tmp")
        os.replace(f"{args.out}.tmp", args.out)
        log(f"done at step {state.step}")
    dist.barrier()
    del ddp
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # past gloo's teardown (see examples/train.py)


if __name__ == "__main__":
    spawn(main, args=(parse_args(sys.argv[1:]),), nprocs=1)
