"""torch.distributed under the HAI contract (RANK and WORLD_SIZE count nodes, not processes).

    init_process_group("gloo")   # or "nccl"; inside a process started by spawn() or torchrun
    get_rank(), get_world_size()  # global, over all processes of all nodes
"""

from __future__ import annotations

import datetime
import os

from ..policy.contract import master_port


def get_rank() -> int:
    return int(os.environ.get("HAI_GLOBAL_RANK", os.environ.get("RANK", "0")))


def get_world_size() -> int:
    return int(os.environ.get("HAI_GLOBAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def init_process_group(backend: str = "gloo", timeout_seconds: float = 300) -> None:
    import torch.distributed as dist  # lazy: torch, an optional extra

    timeout = datetime.timedelta(seconds=timeout_seconds)
    if os.environ.get("TORCHELASTIC_RUN_ID"):  # under torchrun (hai-submit --torchrun): its agent
        dist.init_process_group(backend, timeout=timeout)  # holds the store; env:// joins it
        return
    dist.init_process_group(
        backend,
        init_method=f"tcp://{os.environ.get('MASTER_IP', '127.0.0.1')}:{os.environ.get('MASTER_PORT', master_port(os.environ))}",
        world_size=get_world_size(),
        rank=get_rank(),
        timeout=timeout,
    )
