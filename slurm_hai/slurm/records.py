"""Job records as slurm-hai sees them, parsed from Slurm's JSON (pure, no I/O).

Both backends produce `JobInfo`; the daemon, `hai status` and the tests only read these.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class JobInfo:
    job_id: int
    name: str
    user: str
    state: str  # Slurm's job_state: PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...
    reason: str
    qos: str
    partition: str
    num_nodes: int
    node_list: str
    restart_count: int
    submit_time: int
    start_time: int
    eligible_time: int
    priority: int
    exit_code: int | None = None
    batch_host: str = ""
    comment: str = ""
    admin_comment: str = ""
    account: str = ""
    preempt_time: int = 0  # when Slurm (last) chose this job for preemption; 0 if never
    end_time: int = 0  # for a finished job, when it ended (for a running one, its time limit)
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def tags(self) -> dict[str, str]:
        """`key=value` pairs that slurm-hai stamps into the admin comment and comment."""
        out: dict[str, str] = {}
        for text in (self.comment, self.admin_comment):
            for part in text.replace(";", " ").split():
                if "=" in part:
                    key, value = part.split("=", 1)
                    out[key] = value
        return out


def _exit_status(raw: object) -> int | None:
    """squeue reports the wait(2) status; return the exit code, or 128+signal."""
    if not isinstance(raw, int):
        return None
    if raw & 0x7F:
        return 128 + (raw & 0x7F)
    return raw >> 8


def job_from_squeue(rec: dict) -> JobInfo:
    return JobInfo(
        job_id=int(rec["job_id"]),
        name=rec.get("name", ""),
        user=rec.get("user_name", ""),
        state=rec.get("job_state", ""),
        reason=rec.get("state_reason", "") or "None",
        qos=rec.get("qos", ""),
        partition=rec.get("partition", ""),
        num_nodes=int(rec.get("node_count") or 0),
        node_list=rec.get("nodes", "") or "",
        restart_count=int(rec.get("restart_cnt") or 0),
        submit_time=int(rec.get("submit_time") or 0),
        start_time=int(rec.get("start_time") or 0),
        eligible_time=int(rec.get("eligible_time") or 0),
        priority=int(rec.get("priority") or 0),
        exit_code=_exit_status(rec.get("exit_code")),
        batch_host=rec.get("batch_host", "") or "",
        comment=rec.get("comment", "") or "",
        admin_comment=rec.get("admin_comment", "") or "",
        account=rec.get("account", "") or "",
        preempt_time=int(rec.get("preempt_time") or 0),
        end_time=int(rec.get("end_time") or 0),
    )


def jobs_from_squeue_json(doc: dict) -> list[JobInfo]:
    return [job_from_squeue(rec) for rec in doc.get("jobs", [])]
