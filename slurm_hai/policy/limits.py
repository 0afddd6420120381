"""The bounds of every policy value, stated once (pure).

`policy/model.py` refuses a policy outside them (`hai-admin check`), so that every value it
accepts works in every component: hai-submit, job_submit.lua, the SPANK plugin
(spank/hai_spank.c, whose own range checks tests/unit/test_spank_policy.py keeps equal to
these), slurm.conf (KillWait), the QOS (GraceTime), sbatch's --signal and scancel.
"""

from __future__ import annotations

# The grace between a job's suspend notice and its forced suspend, in whole seconds: at least
# 1 (a notice the job cannot answer is no notice; Slurm's GraceTime 0 means no signal at all),
# at most an hour (KillWait and --signal's time are 16-bit in Slurm, at most 65533 and 65535
# s; the notice comes grace + NOTICE_MARGIN s before a time limit).
MIN_GRACE = 1
MAX_GRACE = 3600
# hai-submit asks Slurm for the notice this many seconds before the grace when a time limit
# approaches (sbatch --signal=SIG@grace+NOTICE_MARGIN).
NOTICE_MARGIN = 30
# Signals a policy may name as the suspend notice: ones scancel --signal and sbatch --signal
# take (Slurm's sig_name2num), that end a process by default (so a job that does not expect
# them fails loudly instead of hanging) and that the launcher does not use for anything else.
NOTICE_SIGNALS = ("USR1", "USR2", "TERM")
# A job's rendezvous port, when nothing sets HAI_MASTER_PORT: MASTER_PORT_BASE +
# (job id % MASTER_PORT_SPAN), so that two jobs sharing a node do not collide. Below Linux's
# ephemeral ports (net.ipv4.ip_local_port_range, 32768-60999 by default): a port in that range
# may be held as the local end of any outgoing connection, and rank 0's listen then fails with
# EADDRINUSE (seen in CI with 40000 + job id).
MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 10000
# The most levels a ladder may have, and the longest level name: the plugin's fixed tables
# (HAI_MAX_LEVELS, HAI_NAME_LEN - 1).
MAX_LEVELS = 32
MAX_LEVEL_NAME = 31
# A level's value: QOS Priority is value + 1, and a job's priority (value + 1) * LEVEL_STRIDE
# must stay below Slurm's 32-bit job priority.
MAX_LEVEL_VALUE = 1000
