"""Polling helper shared by the live-cluster tests (tests/cluster, tests/with_pyslurm import it by name)."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")

# How long the first job of a test may take to start on idle nodes: a job an earlier test
# cancelled while Slurm was still launching it keeps its nodes from the main scheduler for up
# to ~40 s though sinfo shows them idle (seen in slurmctld.log on 22.05, where
# LiveCluster.settle also reconfigures; 25.11 and 26.05 too, in CI).
FIRST_START = 75.0


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.3) -> T:
    """Poll `predicate` until it returns something true; fail the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
