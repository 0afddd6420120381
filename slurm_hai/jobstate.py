"""The HAI view of a job (pure): Slurm's record + the job directory -> one state in words.

States (HAI's lifecycle): waiting (never started yet), running, suspended (requeued after a
suspend or preemption, waiting to run again), finished-succeeded, finished-failed,
finished-stopped.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .slurm.records import JobInfo

SLURM_REASONS = {
    "None": "",
    "Priority": "higher-priority jobs are ahead in line",
    "Resources": "waiting for free nodes",
    "BeginTime": "held back briefly after a requeue",
    "QOSMaxNodePerUserLimit": "over the per-user node quota of its level",
    "QOSMaxTRESPerUser": "over the per-user quota of its level",
    "JobHoldMaxRequeue": "held by Slurm after too many requeues",
    "JobHeldUser": "held by its user",
    "JobHeldAdmin": "held by an administrator",
    "PartitionDown": "its node group is down",
    "ReqNodeNotAvail": "the nodes it needs are not available",
}


@dataclass(frozen=True)
class HaiStatus:
    job_id: int
    name: str
    user: str
    state: str
    reason: str
    level: str
    nodes: int
    node_list: str
    restarts: int
    exit_code: int | None

    def as_dict(self) -> dict:
        return asdict(self)


def hai_state(job: JobInfo | None, final: dict | None, suspended_runs: int) -> str:
    if final:
        return f"finished-{final['state']}"
    if job is None:
        return "unknown"
    if job.state in ("RUNNING", "CONFIGURING"):
        return "running"
    if job.state == "COMPLETING":  # not final (no final.json): the run is ending for a requeue
        return "suspended"
    if job.state in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED", "PREEMPTED"):
        return "suspended" if (job.restart_count > 0 or suspended_runs > 0) else "waiting"
    if job.state == "COMPLETED":
        return "finished-succeeded"
    if job.state == "CANCELLED":
        return "finished-stopped"
    return "finished-failed"


def reason_in_words(job: JobInfo | None, final: dict | None) -> str:
    if final:
        return final.get("reason") or {"succeeded": "exited 0", "stopped": "stopped by its user"}.get(final["state"], "")
    if job is None:
        return "Slurm no longer knows this job"
    return SLURM_REASONS.get(job.reason, job.reason)


def level_of(job: JobInfo | None, request: dict) -> str:
    if job is not None and job.qos:
        return job.qos.upper()
    return request.get("level", "?")


def status(job_id: int, job: JobInfo | None, final: dict | None, request: dict, suspended_runs: int,
           explained: str | None = None, last_run: int = 0) -> HaiStatus:
    """`explained`: the policy's account of a live job (scheduling.explain), if there is one;
    `last_run`: the newest run the job directory saw start (Slurm forgets ended jobs)."""
    return HaiStatus(
        job_id=job_id,
        name=job.name if job else request.get("name", "?"),
        user=job.user if job else request.get("user", "?"),
        state=hai_state(job, final, suspended_runs),
        reason=explained if (explained and not final) else reason_in_words(job, final),
        level=level_of(job, request),
        nodes=job.num_nodes if job else int(request.get("nodes", 0)),
        node_list=job.node_list if job else "",
        restarts=job.restart_count if job else last_run,
        exit_code=final.get("exit_code") if final else (
            job.exit_code if job and job.state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING") else None),
    )
