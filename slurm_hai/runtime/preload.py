"""What a compute node's warm-start service preloads (`hai-admin warm-start --preload
slurm_hai.runtime.preload`; contrib/systemd/slurm-hai-warm.service, the local cluster's
nodes): what a job's command and an elastic job's part import before their first step, so a
process forked from the service imports none of it:

- torch;
- torch._dynamo, which torch imports only when a script makes its first optimizer
  (`torch.optim.SGD(...)`: 822 modules, sympy among them, 0.87 s on this VM; cluster_bench
  --first-step);
- torchft and slurm_hai.runtime.parts, where torchft is installed (the `elastic` extra);
- what the job's batch driver and each node's launcher import (slurm_hai.runtime.batch and
  .launcher, started through the service at every run: templates/job/sbatch.sh.j2,
  runtime/batch.py launcher_argv), the Slurm backends among it: about 0.1 s of CPU each
  that a cold start took at every start and restart of a job, on every node.

None of them starts CUDA: a child forked after that could not use the GPU."""

import importlib.util
import sys

import torch  # noqa: F401
import torch._dynamo  # noqa: F401

if importlib.util.find_spec("torchft") is not None:
    import torchft  # noqa: F401

    from . import parts  # noqa: F401

from . import batch  # noqa: F401
from ..slurm import cli, pyslurm_backend  # noqa: F401  (the backend batch picks)

# batch and launcher run as __main__ (runpy), which warns of a module imported already and would
# run a second copy of it: what they import stays loaded, they themselves are run afresh.
for _main in ("slurm_hai.runtime.batch", "slurm_hai.runtime.launcher"):
    del sys.modules[_main]
