"""The login-node side: a job request and its sbatch script, submitting it, the per-job
directory, and a job's state in words."""
