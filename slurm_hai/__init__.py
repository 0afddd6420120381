"""slurm-hai: the HAI Platform time-sharing model on Slurm.

Import map (imports only go downwards):

    cli/*            click front ends (hai, hai-submit, hai-admin)
    submit, daemon   use cases
    slurm/           the one place that talks to Slurm (CLI backend, optional pyslurm)
    policy, levels, jobstate, contract   pure logic, no I/O beyond reading a file
    client           the in-job suspend protocol (stdlib only, imported by training code)
    checkpoint/      atomic verified checkpoints (needs the torch extra)
"""

__version__ = "0.1.0"
