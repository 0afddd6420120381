"""The HAI environment contract for one node of a job step (pure).

One definition, shared by the launcher and the SPANK plugin (spank/hai_spank.c implements
the same rules in C). When the plugin already set the contract (HAI_CONTRACT=spank) the
launcher takes it as is; otherwise it computes it from Slurm's variables:

    RANK = NODE_RANK      node rank in the step (SLURM_NODEID)
    WORLD_SIZE            number of nodes of the step
    MASTER_IP = MASTER_ADDR   IPv4 address of the step's first node (its NodeAddr)
    MASTER_PORT           HAI_MASTER_PORT, else HAI_MASTER_PORT_BASE (20000)
                          + SLURM_JOB_ID % HAI_MASTER_PORT_SPAN (10000) (policy/limits.py)
    HAI_RESTART_COUNT     SLURM_RESTART_COUNT (0 before the first restart)
"""

from __future__ import annotations

from typing import Mapping

from .hostlist import expand
from .limits import MASTER_PORT_BASE, MASTER_PORT_SPAN

KEYS = ("MASTER_IP", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "NODE_RANK", "HAI_RESTART_COUNT")


def restart_count(env: Mapping[str, str]) -> int:
    return max(int(env.get("SLURM_RESTART_COUNT") or 0), int(env.get("HAI_RESTART_COUNT") or 0))


def master_port(env: Mapping[str, str]) -> int:
    if env.get("HAI_MASTER_PORT"):
        return int(env["HAI_MASTER_PORT"])
    base = int(env.get("HAI_MASTER_PORT_BASE") or MASTER_PORT_BASE)
    span = max(1, int(env.get("HAI_MASTER_PORT_SPAN") or MASTER_PORT_SPAN))
    return base + int(env.get("SLURM_JOB_ID") or 0) % span


def master_node(env: Mapping[str, str]) -> str:
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise KeyError("SLURM_JOB_NODELIST is not set: not inside a Slurm job")
    return expand(nodelist)[0]


def node_contract(env: Mapping[str, str]) -> dict[str, str]:
    """The contract variables for this node. HAI_MASTER_IP (the master node's IPv4 address)
    is looked up once per run by the batch script (runtime/batch.py) before the step starts."""
    if env.get("HAI_CONTRACT") == "spank" and all(env.get(k) for k in KEYS):
        return {k: env[k] for k in KEYS} | {"HAI_CONTRACT": "spank"}
    rank = int(env.get("SLURM_NODEID") or 0)
    world = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    master = env.get("HAI_MASTER_IP")
    if not master:
        raise KeyError("HAI_MASTER_IP is not set: the launcher runs under slurm_hai.runtime.batch")
    return {
        "MASTER_IP": master,
        "MASTER_ADDR": master,
        "MASTER_PORT": str(master_port(env)),
        "WORLD_SIZE": str(world),
        "RANK": str(rank),
        "NODE_RANK": str(rank),
        "HAI_RESTART_COUNT": str(restart_count(env)),
        "HAI_CONTRACT": "launcher",
    }
