"""An elastic job in place: parts that leave and rejoin while the others train on.

    hai-submit --in-place -n 2:4 -p LOW examples/parts_train.py --steps 300 --out ~/parts
    python examples/parts_train.py --steps 300 --reference ~/parts/one.json   # one process, no cluster

Each part is one node's worth of training and one torchft replica group
(slurm_hai.runtime.parts; docs/elastic-in-place.md). When a higher level needs some of the
job's nodes, the parts on them die of the notice and their tasks wait in the queue; the
other parts go on without a restart. When the nodes come back, the parts that left start
again, copy a live peer's state and train with the others.

1. Every part starts from the same weights: seed the initialization (checked at step 0).
2. The global batch stays the same: `part.share(BATCH)` is this part's rows of the step's
   batch, by its rank among the parts of the step (none while it heals).
3. `part.sum_gradients` sums the gradients over the parts; `OptimizerWrapper` steps only when
   every part of the step got the sum, so a step a part left half done is taken again.
4. The data position is the step (`manager.current_step()`), which a healing part receives.
5. With `--checkpoint-dir`, one part commits the job's state every `--save-every` steps; a
   job whose parts all left (its lighthouse was lost) comes back and resumes from there.
6. No part trains below the job's MIN: the first parts wait for MIN (up to `--quorum-timeout`
   seconds), and parts left below MIN (Slurm runs fewer than MIN of the job's parts) commit
   the job's state and leave; the job waits in the queue for MIN nodes and resumes from that
   commit.

In float64 every part ends bitwise equal to the others and within 1e-9 of one process
(`--reference`): only the order of the sums differs (tests/cluster/test_parts.py). Each part
writes its final weights to `--out`/part<N>.json, as exact hex floats.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

BATCH, FEATURES = 12, 6


def data(steps: int):
    import torch

    g = torch.Generator().manual_seed(1)
    return (torch.randn(steps * BATCH, FEATURES, generator=g, dtype=torch.float64),
            torch.randn(steps * BATCH, 1, generator=g, dtype=torch.float64))


def model_and_optimizer():
    import torch

    torch.manual_seed(0)  # every part starts alike
    model = torch.nn.Linear(FEATURES, 1, dtype=torch.float64)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def hexes(model) -> list[str]:
    return [float(w).hex() for p in model.parameters() for w in p.detach().flatten().tolist()]


def loss(model, x, y):
    return (model(x) - y).pow(2).sum() / BATCH


def one_process(steps: int) -> list[str]:
    """The same global batches on one process: what the parts must end with."""
    x, y = data(steps)
    model, opt = model_and_optimizer()
    for step in range(steps):
        opt.zero_grad()
        loss(model, x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]).backward()
        opt.step()
    return hexes(model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--step-sleep", type=float, default=0.05, help="seconds per step, so that it runs a while")
    ap.add_argument("--hurry", type=Path, help="sleep between steps only until this file exists (tests)")
    ap.add_argument("--out", type=Path, help="directory for each part's log and final weights")
    ap.add_argument("--reference", type=Path, help="run on one process (no cluster) and write its weights here")
    ap.add_argument("--checkpoint-dir", type=Path, help="the job's durable checkpoints (a directory every node sees)")
    ap.add_argument("--save-every", type=int, default=50, help="steps between two commits there")
    ap.add_argument("--quorum-timeout", type=float, default=60.0,
                    help="seconds a part waits for a quorum of the job's MIN parts before it leaves")
    args = ap.parse_args()
    if args.reference:
        args.reference.write_text(json.dumps(one_process(args.steps)))
        return

    from datetime import timedelta

    from slurm_hai.runtime.parts import join, leave_on

    leave_on()  # at the notice this part leaves, even while it imports torch
    from torchft.optim import OptimizerWrapper

    index = int(os.environ["SLURM_ARRAY_TASK_ID"])
    assert args.out is not None, "--out is needed for a part"
    args.out.mkdir(parents=True, exist_ok=True)  # every part may be first: each makes it if need be
    log = (args.out / f"part{index}.log").open("a")

    def note(**fields) -> None:
        log.write(json.dumps({"t": time.time(), "part": index, **fields}) + "\n")
        log.flush()

    x, y = data(args.steps)
    model, inner = model_and_optimizer()

    def save():
        return {"model": model.state_dict(), "opt": inner.state_dict()}

    def load(state) -> None:  # from a live peer, or from the job's checkpoint
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["opt"])

    part = join(save, load, checkpoint_dir=args.checkpoint_dir, quorum_timeout=timedelta(seconds=args.quorum_timeout))
    opt = OptimizerWrapper(part.manager, inner)
    note(event="joined", run=int(os.environ.get("SLURM_RESTART_COUNT", "0")))
    first = True
    while part.manager.current_step() < args.steps:
        opt.zero_grad()  # this step's quorum
        share = part.share(BATCH)  # after the quorum (and a heal): the step is the quorum's
        step = part.manager.current_step()
        if first:
            first = False
            if share is None:
                note(event="healed", step=step)
            elif part.resumed_at is not None:
                note(event="resumed", step=step)
        if share is not None:
            rows = slice(step * BATCH, (step + 1) * BATCH)
            loss(model, x[rows][share], y[rows][share]).backward()
        part.sum_gradients(model.parameters())
        opt.step()
        if part.save_every(args.save_every):
            note(event="saved", step=part.manager.current_step())
        note(event="step", step=step, parts=part.manager.num_participants(), healing=share is None,
             committed=part.manager.current_step() > step)
        if not (args.hurry and args.hurry.exists()):
            time.sleep(args.step_sleep)
    (args.out / f"part{index}.json").write_text(json.dumps(hexes(model)))
    note(event="end")
    part.exit()  # out before the interpreter's clean-up, in which torchft's threads may abort


if __name__ == "__main__":
    main()
