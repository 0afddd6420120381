"""A small but real resumable training job for slurm-hai: copy it and put your model in.

    hai-submit -n 2 -p LOW --gpus-per-node 8 examples/train.py -- --nprocs 2 --steps 300
    hai run-local examples/train.py --suspend-after 3 --restarts 2 -- --step-sleep 0.05   # no cluster needed

What it shows, in the order a job meets it:

1. `spawn(main, nprocs=N)` starts N processes on each node (one per GPU on a real cluster;
   here N CPU processes). The job runs this script once per node; RANK / WORLD_SIZE count
   nodes, `get_rank()`/`get_world_size()` turn them into the global process rank and size.
2. `init_process_group("gloo")` (use "nccl" on GPUs) joins all processes of all nodes.
3. Model, optimizer, LR schedule, a shuffled `ResumableSampler` and each rank's RNG are
   bundled in one `TrainingState`; `CheckpointManager.load(into=state)` resumes from the
   newest checkpoint that was committed and verifies (or does nothing on a fresh start).
4. Every step, rank 0's node asks `receive_suspend_command()`. Only the processes of node 0
   can see the notice, so the answer is shared with every rank through one all_reduce;
   then all ranks save a checkpoint together (blocking: it must be committed before we
   let go) and `go_suspend()` hands the nodes back. The job is requeued and runs this
   script again from the top, landing in step 3.
5. Periodic checkpoints (`--save-every`) bound what a crash costs.
6. At the end rank 0 writes the final weights (safetensors) and prints their digest. A
   resumed run gives bit for bit the weights of an uninterrupted one (same world size):
   everything random is seeded and restored, and nothing depends on wall-clock time.

Do NOT install a handler for the notice signal (the policy's notice_signal: USR2, USR1 or
TERM) or SIGTERM: the launcher turns Slurm's signals into the flag that
receive_suspend_command() reads, and makes your processes ignore the notice signal.

Uses only the public API: `slurm_hai` (the suspend protocol, spawn, init_process_group,
get_rank, get_world_size) and `slurm_hai.checkpoint`.
"""

from __future__ import annotations

import argparse
import hashlib
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
from slurm_hai.checkpoint import CheckpointError, CheckpointManager, PerRank, ResumableSampler, TrainingState

# The lines the demo (examples/demo.py) and the tests read from the log start with this.
TAG = "[train]"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    job_dir = os.environ.get("HAI_JOB_DIR")  # set by hai-submit / hai run-local: per job, shared by all nodes
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", type=int, default=2, help="processes per node (one per GPU on a real cluster)")
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps in all")
    ap.add_argument("--batch", type=int, default=16, help="samples per process per step")
    ap.add_argument("--samples", type=int, default=2048, help="size of the synthetic data set")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--save-every", type=int, default=20, help="periodic checkpoint interval (steps)")
    ap.add_argument("--keep-last", type=int, default=3, help="checkpoints to keep")
    ap.add_argument("--ckpt-dir", default=os.path.join(job_dir, "checkpoints") if job_dir else "checkpoints",
                    help="checkpoint directory on a file system every node sees")
    ap.add_argument("--out", default=os.path.join(job_dir, "final-weights.safetensors") if job_dir
                    else "final-weights.safetensors", help="where rank 0 writes the final weights")
    ap.add_argument("--step-sleep", type=float, default=0.0,
                    help="seconds to sleep per step, to make a demo watchable (does not change the result)")
    ap.add_argument("--ballast-mb", type=float, default=0.0,
                    help="extra MiB carried in every checkpoint, to make saves take as long as a real model's")
    ap.add_argument("--ballast-per-rank", action="store_true",
                    help="each rank carries its own --ballast-mb (as an FSDP shard is its rank's) instead of one "
                         "copy that a single rank saves: every node's share of a checkpoint is that large")
    return ap.parse_args(argv)


def log(msg: str) -> None:
    """Rank 0 speaks for the job; its output lands in `hai logs JOB` (node rank 0's log)."""
    if get_rank() == 0:
        print(f"{TAG} {time.strftime('%H:%M:%S')} {msg}", flush=True)


def synthetic_dataset(n: int, seed: int) -> TensorDataset:
    """A 4-class problem drawn from a fixed random 'teacher': no download, same on every rank."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    teacher = torch.randn(16, 4, generator=g)
    y = (x @ teacher + 0.3 * torch.randn(n, 4, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    # ~2.6k parameters; Dropout makes the result depend on every rank's RNG stream, which
    # TrainingState saves and restores per rank.
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 24), nn.ReLU(),
                         nn.Linear(24, 4))


def weights_digest(model: nn.Module) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in a fixed order."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def settled(mgr: CheckpointManager) -> None:
    """Wait for the periodic save in flight. One that failed (a full disk, the file system
    away) says why in one line, and training goes on: the newest good checkpoint stays, and
    the next periodic save tries again."""
    try:
        mgr.wait()
    except CheckpointError as exc:
        log(f"checkpoint failed: {exc} Training goes on; the next save tries again.")


class RankBallast:
    """--ballast-per-rank: a tensor saved in each rank's own file (PerRank), not once for all
    ranks as a tensor every rank holds (the model's, a plain ballast) is."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def state_dict(self) -> dict:
        return {"tensor": PerRank(self.tensor)}

    def load_state_dict(self, state: dict) -> None:
        if state["tensor"] is not None:  # None: a rank the checkpoint had no file of
            self.tensor = state["tensor"]


def suspend_now(mgr: CheckpointManager, state: TrainingState) -> None:
    """Every rank comes here together (the notice was shared). Commit, then let go.
    suspend_save() commits to every node's memory and returns; each node's persist agent
    makes the durable copy after the job has let go (without agents: a blocking save)."""
    settled(mgr)  # a periodic save still in flight
    t0 = time.monotonic()
    try:
        handle = mgr.suspend_save(state.step, state)  # collective with several ranks
    except CheckpointError as exc:  # never go_suspend() without a committed checkpoint
        log(f"suspend checkpoint failed: {exc} Not calling go_suspend(): the job is forced off at the "
            "end of its grace and resumes from its newest good checkpoint.")
        while True:
            time.sleep(1)
    took = time.monotonic() - t0
    log(f"checkpoint step {state.step} committed in {took:.3f} s ({handle.nbytes / 1024:.1f} KiB, "
        f"{handle.where}); calling go_suspend()")
    if get_rank() == 0:
        hai.go_suspend()  # requeues the job now; never returns
    # The other ranks wait to be stopped with the step (any rank could call go_suspend too).
    while True:
        time.sleep(1)


def main(local_rank: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # one core per process; also keeps CPU kernels' reductions fixed
    init_process_group("gloo")
    rank, world = get_rank(), get_world_size()
    run = hai.restart_count()

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    dataset = synthetic_dataset(args.samples, args.seed)
    model = make_model()
    torch.manual_seed(args.seed + 1 + rank)  # then each rank its own stream (dropout)
    # find_unused_parameters=True keeps DDP's gradient buckets as first laid out: by default
    # DDP rebuilds them after the first step, so a resumed run (whose "first step" is step
    # N+1) would sum gradients in another order than the uninterrupted run: not bitwise equal.
    # (DDP then logs once per rank that it found no unused parameters: expected.)
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    sampler = ResumableSampler(len(dataset), shuffle=True, seed=args.seed)  # rank/world from torch.distributed
    # Its own generator: otherwise each iter(loader) draws from the global RNG (see docs/checkpoint.md).
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, generator=torch.Generator())
    extra = None
    if args.ballast_mb:
        ballast = torch.zeros(int(args.ballast_mb * 2**20) // 4)
        extra = {"ballast": RankBallast(ballast) if args.ballast_per_rank else ballast}
    state = TrainingState(model, optimizer, scheduler, sampler, extra=extra)

    # HAI_NODE_MEMORY: the job's directory in this node's memory (set by the launcher), where
    # suspend_save() leaves the suspend checkpoint; a restart on the same nodes loads it there.
    mgr = CheckpointManager(args.ckpt_dir, keep_last=args.keep_last, fast_dir=os.environ.get("HAI_NODE_MEMORY"))
    t0 = time.monotonic()
    if mgr.load(into=state) is None:
        log(f"run {run}: fresh start, {world} processes ({world // args.nprocs} node(s) x {args.nprocs})")
    else:
        log(f"run {run}: resumed from step {mgr.loaded_step} (checkpoint loaded in "
            f"{time.monotonic() - t0:.3f} s, from {mgr.loaded_from}), {world} processes")

    suspend_flag = torch.zeros(1)
    while state.step < args.steps:
        for inputs, targets in loader:  # after a resume this continues mid-epoch
            # 1. The suspend notice: visible only on node 0; every rank must learn it in the
            #    same step, or the collective save below would hang.
            suspend_flag[0] = 1.0 if hai.receive_suspend_command() else 0.0
            dist.all_reduce(suspend_flag, op=dist.ReduceOp.MAX)
            if suspend_flag.item():
                log(f"suspend notice received at step {state.step}")
                suspend_now(mgr, state)

            # 2. One ordinary training step.
            ddp.train()
            loss = nn.functional.cross_entropy(ddp(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            sampler.advance(len(inputs) * world)  # GLOBAL samples consumed this step
            state.step += 1
            state.epoch = sampler.epoch
            if state.step % 20 == 0 or state.step == args.steps:
                log(f"step {state.step}/{args.steps} epoch {state.epoch} loss {loss.item():.4f}")

            # 3. Periodic checkpoint. blocking=False returns after one host copy in a single
            #    process; with several ranks it is a collective save (see docs/checkpoint.md).
            if state.step % args.save_every == 0:
                settled(mgr)
                mgr.save(state.step, state, blocking=False)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if state.step >= args.steps:
                break

    settled(mgr)  # every in-flight save committed, or said why not
    if rank == 0:
        from safetensors.torch import save_file

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{args.out}.tmp"
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp)
        os.replace(tmp, args.out)
        log(f"done: step {state.step}, final weights sha256={weights_digest(model)} -> {args.out}")
    dist.barrier()
    del ddp  # its reducer holds work objects of the process group
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: gloo's threads can still abort it now and
    # then (seen: "terminate called without an active exception", exit 134 after a run
    # that had finished), which would turn a finished job into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    spawn(main, args=(args,), nprocs=args.nprocs)
