"""Elastic jobs resized by the rules (pure; no I/O).

An elastic job (`hai-submit -n MIN:MAX[:STEP]`, policy/sizes.py) is resized by a restart:
it commits a checkpoint on its suspend notice, is requeued, and Slurm starts it again on as
many nodes as it may take, between MIN and MAX.

- Shrink: Slurm preempts the whole job for a higher one; the requeued job starts again at
  once on the nodes left beside it (`shrink_target` says on how many, for the notice).
- Grow: nodes that stayed idle for the policy's `grow_after` seconds, which no waiting job of
  the same or a higher level could use, are offered to a running elastic job below MAX
  (policy/rules.py, rule `grow`; `IdleHistory` tells which nodes stayed idle).

There is no loop between the two: a job grows only after it has run `grow_after` seconds at
its size and the nodes have been idle as long, and it shrinks only for a higher-level job.
"""

from __future__ import annotations

from typing import Mapping

from .sizes import NodeRange

# Samples further apart than this do not show that nodes stayed idle in between.
MAX_SAMPLE_GAP = 10.0


def shrink_target(nodes: NodeRange, now: int, need: int) -> int:
    """The size a job on `now` nodes keeps when `need` of them go to another job: the largest
    allowed size left, or 0 when not even MIN is left (the job is suspended whole)."""
    if need <= 0:
        return now
    return nodes.largest_at_most(now - need) or 0


class IdleHistory:
    """Idle node counts per partition, sampled each daemon cycle: which stayed idle how long."""

    def __init__(self) -> None:
        self._samples: list[tuple[float, Mapping[str, int]]] = []

    def record(self, now: float, idle: Mapping[str, int]) -> None:
        if self._samples and now - self._samples[-1][0] > MAX_SAMPLE_GAP:
            self._samples.clear()  # not watched in between: start again
        self._samples.append((now, dict(idle)))

    def forget(self) -> None:
        """No sample this cycle (nothing could grow): the next one starts a new window."""
        self._samples.clear()

    def steady(self, now: float, window: float) -> dict[str, int]:
        """Per partition, the nodes idle in every sample of the last `window` seconds; empty
        until the samples span that long. Older samples are dropped."""
        start = now - window
        keep = 0
        while keep + 1 < len(self._samples) and self._samples[keep + 1][0] <= start:
            keep += 1
        del self._samples[:keep]
        if not self._samples or self._samples[0][0] > start:
            return {}
        parts = set().union(*(s.keys() for _, s in self._samples))
        return {p: n for p in parts if (n := min(s.get(p, 0) for _, s in self._samples)) > 0}
