"""Slurm versions, and what slurm-hai does differently on each (pure).

Config keys and defaults that changed between the releases slurm-hai supports are decided
here, by feature, so the templates ask `version.has(...)`-style questions rather than
comparing numbers in many places.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class SlurmVersion:
    major: int
    minor: int
    micro: int = 0

    @classmethod
    def parse(cls, text: str) -> "SlurmVersion":
        """From `slurm 25.11.7`, `25.11`, `22.05.8-1`, ...; ValueError if there is none."""
        m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text or "")
        if not m:
            raise ValueError(f"no Slurm version in {text!r}")
        return cls(int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))

    def __str__(self) -> str:
        return f"{self.major}.{self.minor:02d}.{self.micro}"

    @property
    def release(self) -> str:
        """The release series, e.g. "25.11" (a SPANK plugin is built per series)."""
        return f"{self.major}.{self.minor:02d}"

    # -------------------------------------------------------------- features

    @property
    def preempt_parameters(self) -> bool:
        """23.02 moved `SlurmctldParameters=preempt_send_user_signal` to
        `PreemptParameters=send_user_signal`."""
        return self >= SlurmVersion(23, 2)

    @property
    def requeue_delay(self) -> bool:
        """25.11: `SchedulerParameters=requeue_delay=` sets how long a requeued job waits
        (before, the hold is cred_expire + 1 s)."""
        return self >= SlurmVersion(25, 11)

    @property
    def expedited_requeue(self) -> bool:
        """25.11: `--requeue=expedite` with `SlurmctldParameters=enable_expedited_requeue`."""
        return self >= SlurmVersion(25, 11)

    @property
    def requeues_preempted_job_on_exit(self) -> bool:
        """From 24.05 a job whose batch script ends during its preemption grace period is
        requeued by Slurm, and that is the only path that clears Slurm's mark of the
        preemption (GRACE_PREEMPT: src/slurmctld/proc_req.c, _slurm_rpc_complete_batch_script,
        and job_mgr.c, _job_complete; same in 25.11.7 and 26.05.3). `scontrol requeue`
        leaves the mark, and Slurm then requeues the job's next run once more when it ends
        (seen on 25.11: a finished job ran again)."""
        return self >= SlurmVersion(24, 5)

    @property
    def json_scontrol(self) -> bool:
        """`scontrol show job --json` (23.02 and later; 22.05 prints text only)."""
        return self >= SlurmVersion(23, 2)


# What `hai-admin render` assumes when it cannot ask a Slurm: the oldest supported release.
OLDEST_SUPPORTED = SlurmVersion(22, 5)
