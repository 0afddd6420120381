import os
import time

import torch

import slurm_hai as hai
from slurm_hai.checkpoint import CheckpointManager, TrainingState

STEPS = 300
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)


def train_one_step():
    x = torch.randn(32, 8)
    loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
    optimizer.zero_grad(); loss.backward(); optimizer.step()
    time.sleep(0.01)                               # stands for the rest of a real step


state = TrainingState(model, optimizer)            # + scheduler, sampler, RNG: all captured
mgr = CheckpointManager(f"{os.environ.get('HAI_JOB_DIR', '.')}/checkpoints")
mgr.load(into=state)                               # newest checkpoint that verifies, if any
print(f"run {hai.restart_count()} starts at step {state.step}", flush=True)
while state.step < STEPS:
    if hai.receive_suspend_command():              # only rank 0's node gets the notice
        mgr.save(state.step, state)                # committed (atomic, checksummed) on return
        print(f"suspending at step {state.step}", flush=True)
        hai.go_suspend()                           # requeued now; never returns
    train_one_step(); state.step += 1
    if state.step % 100 == 0:
        mgr.save(state.step, state, blocking=False)   # staged in memory, written in background
mgr.wait()
print(f"done at step {state.step}", flush=True)
