"""`python -m slurm_hai.cli COMMAND ARGS...`: a command of cli/front.py (hai, hai-submit) as its
console script runs it here; what a login node's warm-start service's child runs."""

import sys

from .front import COMMANDS, run_here

if sys.argv[1:2] and sys.argv[1] in COMMANDS:
    run_here(sys.argv[1], sys.argv[2:])
else:
    print(f"usage: python -m slurm_hai.cli {'|'.join(COMMANDS)} [ARGS...]", file=sys.stderr)
    sys.exit(2)
