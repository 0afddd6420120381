"""The node counts a job may run on (pure; no I/O).

A fixed job runs on N nodes. An elastic job runs on any allowed size between MIN and MAX:
MIN, MIN+STEP, MIN+2*STEP, ... up to MAX. Spelled
    N               fixed
    MIN:MAX[:STEP]  hai-submit's spelling
    MIN-MAX[:STEP]  Slurm's (`sbatch --nodes=2-4`; Slurm 23.02+ also reads `2-8:2`)
Slurm allocates between MIN and MAX by itself; the step and the range itself are kept by
slurm-hai, in the admin comment tag `hai-nodes=MIN:MAX:STEP` (policy/tags.py), because the
job's own node count in Slurm is what the policy daemon changes when it resizes a job.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_NODES = 10000
_SPELLING = re.compile(r"([0-9]+)(?:[:-]([0-9]+)(?::([0-9]+))?)?")


@dataclass(frozen=True)
class NodeRange:
    min: int
    max: int
    step: int = 1

    @classmethod
    def parse(cls, text: str | int, what: str = "--nodes") -> NodeRange:
        """`text` in one of the spellings above; ValueError (one line: what to write) if not."""
        m = _SPELLING.fullmatch(str(text).strip())
        if not m:
            raise ValueError(f"{what} {text!r}: give a node count N, or a range MIN:MAX (or MIN:MAX:STEP) "
                             "for an elastic job, e.g. 2:4")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        step = int(m.group(3)) if m.group(3) else 1
        if not 1 <= lo <= MAX_NODES or not 1 <= hi <= MAX_NODES:
            raise ValueError(f"{what} {text!r}: node counts must be between 1 and {MAX_NODES}")
        if hi < lo:
            raise ValueError(f"{what} {text!r}: MIN is above MAX; write MIN:MAX, e.g. {hi}:{lo}")
        if step < 1:
            raise ValueError(f"{what} {text!r}: STEP must be at least 1")
        if (hi - lo) % step:
            below = hi - (hi - lo) % step
            raise ValueError(f"{what} {text!r}: steps of {step} from {lo} do not reach {hi}; "
                             f"write {lo}:{below}:{step} or {lo}:{below + step}:{step}")
        return cls(lo, hi, step if hi > lo else 1)

    @property
    def elastic(self) -> bool:
        return self.max > self.min

    def sizes(self) -> list[int]:
        return list(range(self.min, self.max + 1, self.step))

    def allows(self, n: int) -> bool:
        return self.min <= n <= self.max and (n - self.min) % self.step == 0

    def largest_at_most(self, n: int) -> int | None:
        """The largest allowed size not above `n`; None below MIN."""
        if n < self.min:
            return None
        n = min(n, self.max)
        return n - (n - self.min) % self.step

    def slurm(self) -> str:
        """For `--nodes`: N or MIN-MAX (the step is ours: 22.05 cannot read it)."""
        return f"{self.min}-{self.max}" if self.elastic else str(self.min)

    def tag(self) -> str:
        """The `hai-nodes` tag value: MIN:MAX:STEP."""
        return f"{self.min}:{self.max}:{self.step}"

    def __str__(self) -> str:
        """How people read it: 2, 2:4 or 2:8:2."""
        if not self.elastic:
            return str(self.min)
        return f"{self.min}:{self.max}" + (f":{self.step}" if self.step > 1 else "")


def from_tag(value: str | None) -> NodeRange | None:
    """The range of a `hai-nodes=MIN:MAX:STEP` tag; None for none or a malformed one."""
    if not value:
        return None
    try:
        return NodeRange.parse(value, "hai-nodes")
    except ValueError:
        return None
