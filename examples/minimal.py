"""The smallest resumable slurm-hai job (one node, one process): copy it and fill in.

    hai-submit -p LOW --gpus-per-node 8 examples/minimal.py
    hai run-local examples/minimal.py --suspend-after 3      # try the suspend locally

For several processes and nodes see examples/train.py.
"""

import os
import time

import torch

import slurm_hai as hai
from slurm_hai.checkpoint import CheckpointManager, TrainingState

STEPS = 200

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
state = TrainingState(model, optimizer)  # + scheduler, sampler, extra={...} when you have them
mgr = CheckpointManager(os.path.join(os.environ.get("HAI_JOB_DIR", "."), "checkpoints"))
mgr.load(into=state)  # resume from the newest valid checkpoint; nothing on a fresh start
print(f"run {hai.restart_count()} starts at step {state.step}", flush=True)

while state.step < STEPS:
    if hai.receive_suspend_command():  # a higher level needs the node
        mgr.save(state.step, state)  # blocking: committed when it returns
        hai.go_suspend()  # requeued; this script starts again from the top later
    x = torch.randn(32, 8)
    loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    state.step += 1
    if state.step % 50 == 0:
        mgr.save(state.step, state, blocking=False)  # periodic, in the background
        print(f"step {state.step} loss {loss.item():.4f}", flush=True)
    time.sleep(0.02)  # stands for the rest of a real step

mgr.wait()
print(f"done at step {state.step}: weight {model.weight.data.flatten().tolist()[:3]}...", flush=True)
