"""torchrun under the HAI contract: what `hai-submit --torchrun SCRIPT ARGS` runs on every node.

The launcher runs this module once per node as the job's command, with the HAI contract in
its environment; it replaces itself with torchrun (`PYTHON -m torch.distributed.run`) on a
static rendezvous:

    --nnodes=WORLD_SIZE         the contract's node count
    --node-rank=RANK            the contract's node rank
    --master-addr=MASTER_ADDR   rank 0's node, and the job's port (--master-port=MASTER_PORT)
    --nproc-per-node=N          from hai-submit: the GPUs per node, 1 on CPU nodes
    --max-restarts=0            a failed run is the job's to retry (hai-submit --retries)

Static, not c10d: the node ranks stay the contract's, so global rank 0 runs on node 0, the
node whose processes receive the suspend notice, and every run of the job (a requeue starts
torchrun afresh) meets at the same address and port. torchrun sets RANK, LOCAL_RANK,
WORLD_SIZE, ... for its workers; NODE_RANK, MASTER_IP, HAI_RESTART_COUNT, HAI_JOB_DIR and
(node 0) HAI_SUSPEND_FLAG reach them unchanged (docs/user-guide.md, "torchrun").

torchrun's agent stops its workers on SIGTERM, SIGINT, SIGHUP and SIGQUIT. Where SIGTERM is
the suspend notice (the launcher then starts this command with SIGTERM ignored) the agent
must leave it alone: the signal list drops it (torchrun's --signals-to-handle, read from
PET_SIGNALS_TO_HANDLE; TORCHELASTIC_SIGNALS_TO_HANDLE where torchrun has no such option), so
the agent and its workers ignore the notice like any HAI job.

`python -m slurm_hai.runtime.torchrun --nproc-per-node N [--python PY] -- SCRIPT ARGS...`
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Mapping

AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torchrun's default set
SIGNALS_ENV = ("PET_SIGNALS_TO_HANDLE", "TORCHELASTIC_SIGNALS_TO_HANDLE")


def torchrun_argv(python: str, nproc_per_node: int, contract: Mapping[str, str], script: list[str]) -> list[str]:
    """torchrun's command line for this node, from the HAI contract (pure)."""
    return [python, "-m", "torch.distributed.run", f"--nnodes={contract['WORLD_SIZE']}",
            f"--node-rank={contract['RANK']}", f"--nproc-per-node={nproc_per_node}", "--rdzv-backend=static",
            f"--master-addr={contract['MASTER_ADDR']}", f"--master-port={contract['MASTER_PORT']}",
            "--max-restarts=0", *script]


def agent_signals(term_is_notice: bool) -> str:
    """The signals torchrun's agent may stop its workers on (SIGNALS_ENV)."""
    return ",".join(s for s in AGENT_SIGNALS if not (term_is_notice and s == "SIGTERM"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m slurm_hai.runtime.torchrun")
    ap.add_argument("--nproc-per-node", type=int, required=True)
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs torchrun and SCRIPT")
    ap.add_argument("script", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        ap.error("no script given after --")
    missing = [k for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        ap.error(f"{', '.join(missing)} not set: this runs under the slurm-hai launcher (hai-submit --torchrun)")
    os.environ.update(dict.fromkeys(SIGNALS_ENV, agent_signals(signal.getsignal(signal.SIGTERM) == signal.SIG_IGN)))
    cmd = torchrun_argv(args.python, args.nproc_per_node, os.environ, script)
    sys.stdout.flush()
    try:
        os.execvp(cmd[0], cmd)  # --python may be a name on PATH
    except OSError as e:
        print(f"slurm-hai: cannot start torchrun with {cmd[0]!r}: {e}", file=sys.stderr, flush=True)
        return 127


if __name__ == "__main__":
    sys.exit(main())
