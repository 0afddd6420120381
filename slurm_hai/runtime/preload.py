"""What a compute node's warm-start service preloads (`hai-admin warm-start --preload
slurm_hai.runtime.preload`; contrib/systemd/slurm-hai-warm.service, the local cluster's
nodes): what a job's command and an elastic job's part import before their first step, so a
process forked from the service imports none of it:

- torch;
- torch._dynamo, which torch imports only when a script makes its first optimizer
  (`torch.optim.SGD(...)`: 822 modules, sympy among them, 0.87 s on this VM; cluster_bench
  --first-step);
- torchft and slurm_hai.runtime.parts, where torchft is installed (the `elastic` extra).

None of them starts CUDA: a child forked after that could not use the GPU."""

import importlib.util

import torch  # noqa: F401
import torch._dynamo  # noqa: F401

if importlib.util.find_spec("torchft") is not None:
    import torchft  # noqa: F401

    from . import parts  # noqa: F401
