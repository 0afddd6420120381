"""The `key=value` tags slurm-hai keeps in a job's Slurm comments (pure; no I/O).

Admin comment (only slurmctld's job_submit.lua, root and SlurmUser can write it: trusted):
    hai-level=NAME        the level the job was submitted at (job_submit.lua)
    hai-grace=SECONDS     the grace the job gets between its suspend notice and a forced stop:
                          what it asked (sbatch --hai-grace, or hai-grace= in its comment at
                          submission), else the policy's grace_seconds (job_submit.lua)
    hai-nodes=MIN:MAX:STEP
                          an elastic job's node range (job_submit.lua, from --nodes=MIN-MAX and
                          the step hai-submit asks for): the job's own node count in Slurm is
                          what the policy daemon changes when it resizes the job
    hai-parts=MIN:MAX     an elastic job in place: the tag of its comment, well formed
                          (job_submit.lua), which accounting keeps (it keeps no job comment
                          unless AccountingStoreFlags=job_comment)
    hai-submission=TIME.N.R
                          an elastic job in place: a mark of its submission (job_submit.lua),
                          kept across its tasks' requeues; its directory is this submission's
                          (a job id Slurm gives again after losing its state finds an older
                          job's directory, which is moved aside: jobs/jobdir.py claim())
    hai-demoted=NAME      the policy daemon demoted the running job to NAME
    hai-yield=JOB@EPOCH   the daemon asked the job to give way to JOB at EPOCH (a demoted job,
                          or a later job of another user at the level of JOB, earlier in line)
    hai-behind=JOB        the job yielded to JOB and was released once JOB ran: it waits behind
                          JOB and never takes its nodes back by its place in line; dropped when
                          the job runs again
    hai-grow=SIZE@EPOCH   the daemon asked the elastic job at EPOCH to restart on SIZE nodes,
                          into nodes that stayed idle (policy/elastic.py)
    hai-notice=CAUSE:JOB:LEVEL:SIZE@EPOCH
                          why the run that runs at EPOCH got its suspend notice, as the daemon
                          decided it once (the job's launcher reads it from the job's own
                          record: `parse_notice`): CAUSE `demoted` or `earlier_in_line` (its
                          yield to JOB of LEVEL, written with hai-yield), `grow` (written with
                          hai-grow; no JOB, no LEVEL) or `preempted` (by Slurm, at EPOCH its
                          preempt time: JOB and LEVEL the daemon's best guess of the job Slurm
                          preempts it for, empty when none is found); SIZE the node count of
                          the job's next run, 0 when it waits whole. A tag older than the
                          job's start is of an earlier run: it explains nothing to that run's
                          launcher. Kept while the job waits, and into its next run for
                          rules.NOTICE_KEPT_INTO_RUN, whose batch script journals it for a run
                          that left before it came; then dropped
Job comment (written by hai-submit, editable by the job's owner: a hint, never trusted):
    hai-dir=PATH          where the job's state directory lives
    hai-grace=SECONDS     the grace hai-submit asks for (read once, by job_submit.lua, which
                          checks it and stamps it into the admin comment)
    hai-nodes=MIN:MAX:STEP
                          the node range hai-submit asks for (job_submit.lua takes its STEP
                          when MIN and MAX are the job's --nodes=MIN-MAX)
    hai-parts=MIN:MAX     an elastic job in place (hai-submit --in-place): a job array of MAX
                          one-node tasks, one part each (docs/elastic-in-place.md)
    hai-suspend=RUN:HOW:CAUSE:NOTICE:AT
                          the job's batch script, before it asks for the run's requeue: its run
                          RUN ended by a suspend (HOW: go_suspend, forced) marked at AT, after a
                          notice of CAUSE (the launcher's word) at NOTICE (`none` and 0: the job
                          called go_suspend() unasked); times in epoch seconds. The policy daemon
                          requeues a FAILED job whose last run says so (its requeue was lost
                          with a slurmctld), which its owner could do as well; its metrics count
                          the suspend by it
    hai-left=RUN:WHY@AT   a part of a job in place (its task's comment), before its task's requeue:
                          its run RUN left at AT, for WHY (preempted, below_min, lighthouse_lost,
                          time_limit, failed); the daemon's metrics count the departure by it
The job writes these two as its own record, so that the policy daemon reads no user's
directory (issue 55); they are its owner's to write, and read as such: bounded, each field
checked, a malformed one ignored.
"""

from __future__ import annotations

import functools
from typing import Iterable, Mapping, NamedTuple

LEVEL = "hai-level"
GRACE = "hai-grace"
NODES = "hai-nodes"
DEMOTED = "hai-demoted"
YIELD = "hai-yield"
BEHIND = "hai-behind"
GROW = "hai-grow"
DIR = "hai-dir"
PARTS = "hai-parts"
SUBMISSION = "hai-submission"
SUSPEND = "hai-suspend"
SUSPEND_HOWS = ("go_suspend", "forced")
LEFT = "hai-left"
NOTICE = "hai-notice"
# hai-notice's CAUSE -> the notice event's fields (jobs/status.py why_notice words them)
NOTICE_CAUSES: Mapping[str, Mapping[str, object]] = {
    "preempted": {"cause": "preempted"},
    "demoted": {"cause": "preempted", "demoted": True},
    "earlier_in_line": {"cause": "preempted", "earlier_in_line": True},
    "grow": {"cause": "grow"},
}


def parse(*texts: str) -> dict[str, str]:
    """The tags in `texts` (later texts win); words without `=` are not tags."""
    out: dict[str, str] = {}
    for text in texts:
        out.update(_pairs(text))
    return out


@functools.lru_cache(maxsize=4096)
def _pairs(text: str) -> tuple[tuple[str, str], ...]:
    """The tags of one comment, in order. Remembered: a queue's jobs share few comments (the
    same level, grace and directory), and the commands and the daemon read each job's tags
    several times (hai list --all: 40,000 parses at 10,000 jobs)."""
    pairs = []
    for part in text.replace(";", " ").split():
        key, sep, value = part.partition("=")
        if sep:
            pairs.append((key, value))
    return tuple(pairs)


def with_tags(comment: str, set_: Mapping[str, str] = {}, drop: Iterable[str] = ()) -> str:
    """`comment` with tags set or dropped, other words kept in order."""
    drop = set(drop) | set(set_)
    words = [w for w in comment.replace(";", " ").split() if w.partition("=")[0] not in drop]
    return " ".join(words + [f"{k}={v}" for k, v in set_.items()])


def parse_at(value: str) -> tuple[int, int] | None:
    """`JOB@EPOCH` (hai-yield) or `SIZE@EPOCH` (hai-grow) -> (job id or size, epoch)."""
    job, _, at = value.partition("@")
    return (int(job), int(at)) if job.isdigit() and at.isdigit() else None


class Suspended(NamedTuple):
    """A run's suspend as its job says it (hai-suspend)."""

    run: int
    how: str  # SUSPEND_HOWS
    cause: str  # a word; `none`: no notice
    notice_at: float  # 0: no notice
    at: float


class Left(NamedTuple):
    """A part's departure as its task says it (hai-left)."""

    run: int
    why: str  # a word
    at: float


def suspend_value(s: Suspended) -> str:
    return f"{s.run}:{s.how}:{s.cause}:{s.notice_at:.3f}:{s.at:.3f}"


def parse_suspended(value: str | None) -> Suspended | None:
    """hai-suspend's value, or None for none or a malformed one."""
    fields = (value or "").split(":")
    if len(fields) != 5:
        return None
    run, how, cause, notice_at, at = fields[0], fields[1], fields[2], _epoch(fields[3]), _epoch(fields[4])
    if not (_count(run) and how in SUSPEND_HOWS and is_word(cause) and notice_at is not None and at is not None):
        return None
    return Suspended(int(run), how, cause, notice_at, at)


def left_value(left: Left) -> str:
    return f"{left.run}:{left.why}@{left.at:.3f}"


def parse_left(value: str | None) -> Left | None:
    """hai-left's value, or None for none or a malformed one."""
    head, _, at_text = (value or "").partition("@")
    run, sep, why = head.partition(":")
    at = _epoch(at_text)
    return Left(int(run), why, at) if sep and _count(run) and is_word(why) and at is not None else None


def _count(text: str) -> bool:
    return text.isdigit() and len(text) <= 9


def is_word(text: object) -> bool:
    """A word a tag may carry: letters and `_`, 1 to 32 of them."""
    if not isinstance(text, str):
        return False
    return 0 < len(text) <= 32 and text.replace("_", "a").isalpha() and text.isascii()


def _epoch(text: str) -> float | None:
    """Seconds since the epoch, as the job wrote them (0 to 10^11, at most 20 characters)."""
    if len(text) > 20 or not text.replace(".", "", 1).isdigit():
        return None
    t = float(text)
    return t if t < 1e11 else None


def parse_parts(value: str | None) -> tuple[int, int] | None:
    """`MIN:MAX` (hai-parts) -> (MIN, MAX), 1 <= MIN <= MAX; None for none or a malformed one
    (job_submit.lua copies only a well-formed one into the admin comment)."""
    low, sep, high = (value or "").partition(":")
    if not (sep and low.isdigit() and high.isdigit()):
        return None
    return (int(low), int(high)) if 1 <= int(low) <= int(high) else None


def notice_value(cause: str, job: int | None, level: str, size: int, at: int) -> str:
    """hai-notice's value: `cause` one of NOTICE_CAUSES, `job` and `level` the job it gives
    way to (None and "" for none), `size` the node count of the next run, `at` the epoch."""
    if cause not in NOTICE_CAUSES:
        raise ValueError(f"not a cause of hai-notice: {cause!r}")
    return f"{cause}:{job or ''}:{level}:{size}@{at}"


def parse_notice(value: str | None, since: int) -> dict | None:
    """hai-notice's value -> the notice event's fields (cause; by_job and by_level when
    named; demoted or earlier_in_line; target_size), when it is of the run that started at
    `since` (its epoch not older); None for none, an earlier run's, or a malformed one."""
    body, _, at = (value or "").rpartition("@")
    fields = body.split(":")
    if len(fields) != 4 or not at.isdigit() or int(at) < since:
        return None
    cause, job, level, size = fields
    if cause not in NOTICE_CAUSES or not size.isdigit() or not (job == "" or job.isdigit()):
        return None
    named = {"by_job": int(job), "by_level": level} if job else {}
    return {**NOTICE_CAUSES[cause], **named, "target_size": int(size)}
