"""What a compute node's warm-start service preloads (`hai-admin warm-start --preload
slurm_hai.runtime.preload`; contrib/systemd/slurm-hai-warm.service, the local cluster's
nodes): what a job's command and an elastic job's part import before their first step, so a
process forked from the service imports none of it:

- torch;
- torch._dynamo, which torch imports only when a script makes its first optimizer
  (`torch.optim.SGD(...)`: 822 modules, sympy among them, 0.87 s on this VM; cluster_bench
  --first-step);
- torchft and slurm_hai.runtime.parts, where torchft is installed (the `elastic` extra);
- the job's batch driver (slurm_hai.runtime.batch, started through the service by the job's
  script at every run: templates/job/sbatch.sh.j2) with the launcher and the Slurm backends
  it loads: 0.1 s of CPU a cold start took to import at every start and restart of a job.

None of them starts CUDA: a child forked after that could not use the GPU."""

import importlib.util

import torch  # noqa: F401
import torch._dynamo  # noqa: F401

if importlib.util.find_spec("torchft") is not None:
    import torchft  # noqa: F401

    from . import parts  # noqa: F401

from . import batch  # noqa: F401
from ..slurm import cli, pyslurm_backend  # noqa: F401  (the backend batch picks)
