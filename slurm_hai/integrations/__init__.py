"""The suspend protocol for training frameworks' own loops (docs/integrations.md).

    slurm_hai.integrations.transformers   SuspendCallback for the Hugging Face Trainer
                                          (pip install 'slurm-hai[transformers]')
    slurm_hai.integrations.lightning      HaiEnvironment + SuspendCallback for Lightning
                                          (pip install 'slurm-hai[lightning]')

On the suspend notice each makes the framework save, commits what it wrote with
slurm-hai's protocol (atomic, checksummed, keep-last; committed.py) and calls
go_suspend(); on restart it names the newest committed checkpoint that verifies.
This package imports neither framework: each module imports its own.
"""
