"""slurm-hai: the HAI Platform time-sharing model on Slurm.

The in-job API, for training code (`import slurm_hai as hai`):

    hai.receive_suspend_command() -> bool   True once a suspend notice reached this node
    hai.target_size() -> int | None         after it: the node count of the next run (elastic
                                            jobs shrink and grow; 0: suspended whole)
    hai.go_suspend()                        checkpoint committed: requeue now; never returns
    hai.restart_count() -> int              0 on the first run, then 1, 2, ...
    hai.get_whole_life_state() / hai.set_whole_life_state(int)
    hai.spawn(fn, args, nprocs)             one process per GPU on this node
    hai.init_process_group(), hai.get_rank(), hai.get_world_size()   over all processes

Each name is imported on first use, so `import slurm_hai` costs nothing and pulls in no
torch, click or jinja2. The package map is in docs/design.md.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_API = {
    "receive_suspend_command": "runtime.client", "target_size": "runtime.client", "go_suspend": "runtime.client",
    "restart_count": "runtime.client", "get_whole_life_state": "runtime.client",
    "set_whole_life_state": "runtime.client", "spawn": "runtime.multiprocessing",
    "init_process_group": "runtime.distributed", "get_rank": "runtime.distributed",
    "get_world_size": "runtime.distributed",
}
__all__ = sorted(_API)


def __getattr__(name: str) -> object:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'slurm_hai' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
