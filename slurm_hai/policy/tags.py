"""The `key=value` tags slurm-hai keeps in a job's Slurm comments (pure; no I/O).

Admin comment (only slurmctld's job_submit.lua, root and SlurmUser can write it: trusted):
    hai-level=NAME        the level the job was submitted at (job_submit.lua)
    hai-demoted=NAME      the policy daemon demoted the running job to NAME
    hai-yield=JOB@EPOCH   the daemon asked the job to give way to JOB at EPOCH (a demoted job,
                          or a later job of another user at the level of JOB, earlier in line)
Job comment (written by hai-submit, editable by the job's owner: a hint, never trusted):
    hai-dir=PATH          where the job's state directory lives
"""

from __future__ import annotations

from typing import Iterable, Mapping

LEVEL = "hai-level"
DEMOTED = "hai-demoted"
YIELD = "hai-yield"
DIR = "hai-dir"


def parse(*texts: str) -> dict[str, str]:
    """The tags in `texts` (later texts win); words without `=` are not tags."""
    out: dict[str, str] = {}
    for text in texts:
        for part in text.replace(";", " ").split():
            key, sep, value = part.partition("=")
            if sep:
                out[key] = value
    return out


def with_tags(comment: str, set_: Mapping[str, str] = {}, drop: Iterable[str] = ()) -> str:
    """`comment` with tags set or dropped, other words kept in order."""
    drop = set(drop) | set(set_)
    words = [w for w in comment.replace(";", " ").split() if w.partition("=")[0] not in drop]
    return " ".join(words + [f"{k}={v}" for k, v in set_.items()])


def parse_yield(value: str) -> tuple[int, int] | None:
    """`JOB@EPOCH` -> (job id, epoch)."""
    job, _, at = value.partition("@")
    return (int(job), int(at)) if job.isdigit() and at.isdigit() else None
