"""Fixed limits of the HAI contract that Python, the SPANK plugin (spank/hai_spank.c, its
HAI_DEFAULT_* values) and the rendered plugstack.conf must agree on (pure).

tests/unit/test_vocabulary.py fails when the C defaults drift from these values.
"""

from __future__ import annotations

# The most a job may ask between its suspend notice and a forced stop (hai-submit --grace,
# sbatch --hai-grace).
MAX_GRACE = 300
# A job's rendezvous port, when nothing sets HAI_MASTER_PORT: MASTER_PORT_BASE +
# (job id % MASTER_PORT_SPAN), so that two jobs sharing a node do not collide. Below Linux's
# ephemeral ports (net.ipv4.ip_local_port_range, 32768-60999 by default): a port in that range
# may be held as the local end of any outgoing connection, and rank 0's listen then fails with
# EADDRINUSE (seen in CI with 40000 + job id).
MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 10000
# The most levels a ladder may have, and the longest level name: the plugin's fixed tables
# (HAI_MAX_LEVELS, HAI_NAME_LEN - 1). A ladder beyond them would be refused by the plugin,
# which would then fall back to HAI's default ladder.
MAX_LEVELS = 32
MAX_LEVEL_NAME = 31


def spank_arguments(levels_arg: str) -> dict[str, object]:
    """What plugstack.conf passes to hai_spank.so (templates/slurm/plugstack.conf.j2)."""
    return {"levels_arg": levels_arg, "max_grace": MAX_GRACE, "master_port_base": MASTER_PORT_BASE,
            "master_port_span": MASTER_PORT_SPAN}
