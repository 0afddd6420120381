"""Job records as slurm-hai sees them, parsed from Slurm's JSON (pure, no I/O).

One `JobInfo` from every shape Slurm prints, for every version slurm-hai supports:
- `squeue --json` and `scontrol show job --json` (the same job record): data_parser
  v0.0.38 (Slurm 22.05) prints plain values; from v0.0.39 numbers may be
  `{"set": true, "infinite": false, "number": N}` and `job_state` is a list of the base
  state and its flags (`["PENDING", "REQUEUED"]`); `exit_code` becomes an object.
- `sacct --json` (the accounting record): `state.current`, `time.submission`, ...,
  `comment.administrator`, with the same kinds of values.
Recorded examples of each, with the command that recorded them: tests/fixtures/slurm/.

A record that does not have the shape this module knows raises `RecordError`, one line that
names the Slurm release, the command and the field; `jobs_from_json` skips such a record and
reports it, so one odd job never hides the others (the daemon logs it and goes on).
"""

from __future__ import annotations

import functools
import math
import re
import time
from dataclasses import dataclass, fields
from typing import Any, Callable

from ..policy import tags
from .errors import SlurmError
from . import squeue

# Slurm's base job states (everything else in a v0.0.39+ state list is a flag).
BASE_STATES = ("PENDING", "RUNNING", "SUSPENDED", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT",
               "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY")


# The states of a job that is over for good (a requeued job is PENDING again, a held one too).
ENDED_STATES = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY")


class RecordError(SlurmError):
    """A Slurm record in a shape slurm-hai does not know (one line: release, command, field)."""


@dataclass(frozen=True)
class JobInfo:
    job_id: int
    name: str
    user: str
    # Slurm's job state in one word, as squeue prints it: a flag that hides the base state
    # (COMPLETING, CONFIGURING, REQUEUED, ...), else the base state (PENDING, RUNNING, COMPLETED,
    # ...). sacct's records (accounting) hold the base state.
    state: str
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
    # the id of the job array it is a task (or the pending rest) of, else its own id, as squeue
    # prints it (the JSON and pyslurm records say 0 for a job of no array; read as its id)
    array_job_id: int = 0

    def __post_init__(self) -> None:
        if not self.array_job_id:
            object.__setattr__(self, "array_job_id", self.job_id)

    @functools.cached_property  # read-only: parsed once per record (hai list reads it often)
    def tags(self) -> dict[str, str]:
        """slurm-hai's tags from the comment and the admin comment (policy/tags.py)."""
        return tags.parse(self.comment, self.admin_comment)


# ------------------------------------------------------------------ value shapes


class _Shape(Exception):
    """Internal: a value of the wrong shape (turned into a RecordError with context)."""


def _number(value: object) -> int:
    """An integer from a plain number or a v0.0.39+ `{set, infinite, number}` object.
    Unset or infinite counts as 0 (slurm-hai reads 0 as "none")."""
    if value is None:
        return 0
    if isinstance(value, bool):
        raise _Shape("a boolean, expected a number")
    if isinstance(value, float):
        if not math.isfinite(value):  # json.loads reads NaN and Infinity
            raise _Shape(f"{value}, expected a number")
        value = int(value)
    if isinstance(value, int):
        if value in _UNSET64:  # Slurm's NO_VAL64 and INFINITE64 as plain numbers: as the object's
            return 0
        if not -2**63 <= value < 2**63:  # what no Slurm field (time_t, uint32, int64) holds
            raise _Shape(f"a number of {len(str(abs(value)))} digits, out of range")
        return value
    if isinstance(value, dict) and "number" in value:
        if not value.get("set", True) or value.get("infinite"):
            return 0
        return _number(value["number"])
    raise _Shape(f"{_kind(value)}, expected a number")


_UNSET64 = (2**64 - 2, 2**64 - 1)


def _text(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    raise _Shape(f"{_kind(value)}, expected text")


def _state(value: object) -> str:
    """The base state from a plain string or a v0.0.39+ list of state and flags."""
    if isinstance(value, str) and value.strip():
        return value.split()[0]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return next((v for v in value if v in BASE_STATES), value[0])
    raise _Shape(f"{_kind(value)}, expected a job state")


def _wait_status(value: object) -> int | None:
    """squeue v0.0.38 reports the wait(2) status: return the exit code, or 128+signal."""
    raw = _number(value)
    return 128 + (raw & 0x7F) if raw & 0x7F else raw >> 8


def _exit_object(value: object) -> int | None:
    """`{"status": ..., "return_code": N, "signal": {"id": S}}` (sacct, and squeue v0.0.39+):
    the exit code, or 128+signal."""
    if not isinstance(value, dict):
        raise _Shape(f"{_kind(value)}, expected an exit code object")
    status = value.get("status")
    statuses = status if isinstance(status, list) else [status]
    signal = value.get("signal") or {}
    if "SIGNALED" in statuses and isinstance(signal, dict):
        sig = _number(signal.get("id") if "id" in signal else signal.get("signal_id"))
        if sig:
            return 128 + sig
    if statuses == ["PENDING"] or status is None and value.get("return_code") is None:
        return None
    return _number(value.get("return_code"))


def _exit(value: object) -> int | None:
    if value is None:
        return None
    return _exit_object(value) if isinstance(value, dict) else _wait_status(value)


def _kind(value: object) -> str:
    return {dict: "an object", list: "a list", str: "text", bool: "a boolean"}.get(type(value), type(value).__name__)


# ------------------------------------------------------------------ record shapes

# JobInfo field -> (path in the record, converter, required). A missing optional field takes
# the converter's value for None.
Spec = dict[str, tuple[tuple[str, ...], Callable[[object], object], bool]]

JOB_INFO: Spec = {  # squeue --json / scontrol show job --json
    "job_id": (("job_id",), _number, True),
    "name": (("name",), _text, False),
    "user": (("user_name",), _text, False),
    "state": (("job_state",), _state, True),
    "reason": (("state_reason",), _text, False),
    "qos": (("qos",), _text, False),
    "partition": (("partition",), _text, False),
    "num_nodes": (("node_count",), _number, False),
    "node_list": (("nodes",), _text, False),
    "restart_count": (("restart_cnt",), _number, False),
    "submit_time": (("submit_time",), _number, False),
    "start_time": (("start_time",), _number, False),
    "eligible_time": (("eligible_time",), _number, False),
    "priority": (("priority",), _number, False),
    "exit_code": (("exit_code",), _exit, False),
    "batch_host": (("batch_host",), _text, False),
    "comment": (("comment",), _text, False),
    "admin_comment": (("admin_comment",), _text, False),
    "account": (("account",), _text, False),
    "preempt_time": (("preempt_time",), _number, False),
    "end_time": (("end_time",), _number, False),
    "array_job_id": (("array_job_id",), _number, False),
}

ACCOUNTING: Spec = {  # sacct --json
    "job_id": (("job_id",), _number, True),
    "name": (("name",), _text, False),
    "user": (("user",), _text, False),
    "state": (("state", "current"), _state, True),
    "reason": (("state", "reason"), _text, False),
    "qos": (("qos",), _text, False),
    "partition": (("partition",), _text, False),
    "num_nodes": (("allocation_nodes",), _number, False),
    "node_list": (("nodes",), _text, False),
    "restart_count": (("restart_cnt",), _number, False),
    "submit_time": (("time", "submission"), _number, False),
    "start_time": (("time", "start"), _number, False),
    "eligible_time": (("time", "eligible"), _number, False),
    "priority": (("priority",), _number, False),
    "exit_code": (("exit_code",), _exit, False),
    "comment": (("comment", "job"), _text, False),
    "admin_comment": (("comment", "administrator"), _text, False),
    "account": (("account",), _text, False),
    "end_time": (("time", "end"), _number, False),
    "array_job_id": (("array", "job_id"), _number, False),
}
# Slurm 22.05's `sacct --json` (dbv0.0.38) reports every job's exit code as 0 ("SUCCESS"),
# also for a job `sacct -o exitcode` shows as 3:0: that exit code is unknown, not 0.
ACCOUNTING_V38: Spec = {**ACCOUNTING, "exit_code": (("exit_code",), lambda value: None, False)}

# ------------------------------------------------------------------ squeue --Format text
# What slurm-hai reads of the queue: `squeue --noheader --Format=NAME:0SEP,...` (commands.
# queue_argv), each field unpadded (width 0) and followed by SEP, a token made at random for
# each call, so no job name or comment can forge a field, and newlines in them do no harm.
# squeue prints the fields with Slurm's own text: a job state as ONE word (job_state_string:
# a flag that hides the base state, COMPLETING, CONFIGURING, REQUEUED, ..., else the base
# state), a reason's name or, when the job has one, its state description in place of the
# name (`reason_name`; the backend reads a job whose description names none again as JSON),
# times as SLURM_TIME_FORMAT says (%s: epoch seconds) or N/A, NONE (no end: no time limit),
# Unknown; a NULL string as "(null)", the exit status as the raw wait(2) status (22.05) or
# CODE:SIGNAL (23.02 and later), nothing when it is unset.

_NULL = "(null)"


def _text_count(value: str) -> int:
    if not (value.isascii() and value.isdigit()):
        raise _Shape(f"{value[:40]!r}, expected a number")
    if len(value) > 18 and int(value) >= 2**63:  # what no Slurm field (time_t, uint32, int64) holds
        raise _Shape(f"a number of {len(value)} digits, out of range")
    return int(value)


def _text_time(value: str) -> int:
    """Epoch seconds; the words Slurm prints for no time (N/A, NONE, Unknown, NOT_SET,
    UNLIMITED) are 0, as slurm-hai reads 0 as "none"."""
    if value in ("N/A", "NONE", "Unknown", "NOT_SET", "UNLIMITED", ""):
        return 0
    try:
        return _text_count(value)
    except _Shape:
        raise _Shape(f"{value[:40]!r}, expected epoch seconds (SLURM_TIME_FORMAT=%s)") from None


def _text_string(value: str) -> str:
    return "" if value == _NULL else value


def _text_host(value: str) -> str:
    return "" if value in (_NULL, "n/a") else value


def _text_state(value: str) -> str:
    if value and value.isupper() and value.replace("_", "").isalpha():
        return value
    raise _Shape(f"{value[:40]!r}, expected a job state")


def _text_exit(value: str) -> int | None:
    if value == "":
        return None
    code, colon, signal = value.partition(":")
    if colon and code.isascii() and code.isdigit() and signal.isascii() and signal.isdigit() and len(value) < 12:
        return 128 + int(signal) if int(signal) else int(code)
    if not colon and value.isascii() and value.isdigit() and len(value) < 12:
        return _wait_status(int(value))
    raise _Shape(f"{value[:40]!r}, expected an exit code")


def _record_start(value: str) -> int:
    """The job id, the first field of a record: it starts a line."""
    if not value.startswith("\n"):
        raise _Shape(f"{value[:40]!r}, expected a job id at the start of a line")
    return _text_count(value[1:])


def _text_reason(value: str) -> str:
    return value or "None"


# How each field of squeue.FIELDS is read back, by JobInfo field
_TEXT_READERS: dict[str, Callable[[str], Any]] = {
    "job_id": _record_start, "name": _text_string, "user": _text_string, "state": _text_state,
    "reason": _text_reason, "qos": _text_string, "partition": _text_string, "num_nodes": _text_count,
    "node_list": _text_string, "restart_count": _text_count, "submit_time": _text_time, "start_time": _text_time,
    "eligible_time": _text_time, "priority": _text_count, "exit_code": _text_exit, "batch_host": _text_host,
    "comment": _text_string, "admin_comment": _text_string, "account": _text_string,
    "preempt_time": _text_time, "end_time": _text_time, "array_job_id": _text_count,
}
# JobInfo field -> (squeue --Format field, converter), in the order asked for: JobInfo's own.
QUEUE_FORMAT: tuple[tuple[str, str, Callable[[str], Any]], ...] = tuple(
    (name, field, _TEXT_READERS[name]) for name, field in squeue.FIELDS)


def jobs_from_text(text: str, sep: str, where: str = "squeue",
                   known: dict[tuple[str, ...], JobInfo] | None = None) -> tuple[list[JobInfo], list[RecordError]]:
    """Every readable job of squeue's text in the QUEUE_FORMAT fields, each followed by `sep`,
    and one RecordError per record that could not be read. RecordError when the text is not
    in that format at all (another squeue, or an error message on stdout).

    `known`: the records of the previous read and their jobs, for a reader that reads the
    queue again and again (the policy daemon): a record whose every field is as it was is
    that same (frozen) JobInfo, its tags parsed already; `known` is left holding this read's.
    Parsing is much of what reading a large queue costs, so a record parsed once is not parsed again."""
    width = len(QUEUE_FORMAT)
    cells = ("\n" + text).split(sep)  # each record's first field starts its line
    rest = cells.pop()  # what follows the last field: the last record's newline
    if rest.strip() or len(cells) % width:
        raise RecordError(f"{where} printed something that is not the queue it was asked for: "
                          f"{' '.join(text.split())[:80] or '(nothing)'}")
    jobs, problems = [], []
    last, seen = known or {}, {}
    for record in zip(*[iter(cells)] * width):  # JobInfo's fields are QUEUE_FORMAT's, in its order
        job = last.get(record)
        if job is None:
            try:
                job = JobInfo(*[convert(raw) for convert, raw in zip(_TEXT_CONVERTERS, record)])
            except _Shape:
                problems.append(_text_problem(record, where))
                continue
        jobs.append(job)
        if known is not None:
            seen[record] = job
    if known is not None:
        known.clear()
        known.update(seen)
    return jobs, problems


_TEXT_CONVERTERS = [convert for _, _, convert in QUEUE_FORMAT]
assert [f.name for f in fields(JobInfo)] == [name for name, _, _ in QUEUE_FORMAT]


def _text_problem(record: tuple[str, ...], where: str) -> RecordError:
    """The one line that says which field of a record could not be read."""
    job = record[0].strip()[:40] or "?"
    for (_, slurm_name, _), convert, raw in zip(QUEUE_FORMAT, _TEXT_CONVERTERS, record):
        try:
            convert(raw)
        except _Shape as e:
            return RecordError(f"{where}: job {job} field {slurm_name} is {e}; this Slurm version is not "
                               "supported by this slurm-hai")
    return RecordError(f"{where}: job {job} could not be read")


# ------------------------------------------------------------------ pyslurm (25.11)
# pyslurm hands over Python values instead of JSON: None for unset numbers and text, the
# string "UNLIMITED" for infinite ones, a job state as ONE word (Slurm's job_state_string:
# the first flag if the job has one, "COMPLETING", else the base state), the reason as the
# job's state description when it has one, else the reason's name, and an exit code as two
# attributes (`exit_code`, `exit_code_signal`).


def _pyslurm_number(value: object) -> int:
    """pyslurm's numbers: None (unset) and "UNLIMITED" count as 0, as in the JSON shapes."""
    if isinstance(value, str) and value.upper() == "UNLIMITED":
        return 0
    return _number(value)


def _pyslurm_state(value: object) -> str:
    """pyslurm's one-word job state: a base state, or a flag that hides the base state,
    as squeue prints it (see QUEUE_FORMAT)."""
    if isinstance(value, str) and value and value.split()[0] == value:
        return value
    raise _Shape(f"{_kind(value)}, expected a job state")


def _pyslurm_exit(rec: object) -> int | None:
    """`exit_code` and `exit_code_signal` of a pyslurm record: the exit code, or 128+signal."""
    if not isinstance(rec, dict):
        raise _Shape(f"{_kind(rec)}, expected a record")
    code, signal = rec.get("exit_code"), rec.get("exit_code_signal")
    if signal:
        return 128 + _number(signal)
    return None if code is None else _number(code)


def _pyslurm_end(rec: object) -> int:
    """A job's end, 0 for one without a time limit that has not ended: squeue prints NONE
    (Slurm keeps a time a year on)."""
    if not isinstance(rec, dict):
        raise _Shape(f"{_kind(rec)}, expected a record")
    end, limit = _pyslurm_number(rec.get("end_time")), rec.get("time_limit")
    unlimited = limit is None or isinstance(limit, str) and limit.upper() == "UNLIMITED"
    return 0 if unlimited and end > time.time() else end


def _pyslurm_allocated_nodes(rec: object) -> int:
    """pyslurm.db.Job.num_nodes is the requested count for a job that never started; sacct's
    allocation_nodes is 0 then."""
    if not isinstance(rec, dict):
        raise _Shape(f"{_kind(rec)}, expected a record")
    return _number(rec.get("num_nodes")) if rec.get("start_time") else 0


PYSLURM: Spec = {  # pyslurm.Job attributes (pyslurm 25.11); () is the whole record
    "job_id": (("id",), _number, True),
    "name": (("name",), _text, False),
    "user": (("user_name",), _text, False),
    "state": (("state",), _pyslurm_state, True),
    "reason": (("state_reason",), _text, False),
    "qos": (("qos",), _text, False),
    "partition": (("partition",), _text, False),
    "num_nodes": (("num_nodes",), _pyslurm_number, False),
    "node_list": (("allocated_nodes",), _text, False),
    "restart_count": (("requeue_count",), _pyslurm_number, False),
    "submit_time": (("submit_time",), _pyslurm_number, False),
    "start_time": (("start_time",), _pyslurm_number, False),
    "eligible_time": (("eligible_time",), _pyslurm_number, False),
    "priority": (("priority",), _pyslurm_number, False),
    "exit_code": ((), _pyslurm_exit, False),
    "batch_host": (("batch_host",), _text, False),
    "comment": (("comment",), _text, False),
    "admin_comment": (("admin_comment",), _text, False),
    "account": (("account",), _text, False),
    "preempt_time": (("preempt_time",), _pyslurm_number, False),
    "end_time": ((), _pyslurm_end, False),
    "array_job_id": (("array_id",), _pyslurm_number, False),
}

PYSLURM_DB: Spec = {  # pyslurm.db.Job attributes (pyslurm 25.11): what sacct --json reads
    **{name: row for name, row in PYSLURM.items() if name not in ("batch_host", "preempt_time")},
    "state": (("state",), _state, True),
    "num_nodes": ((), _pyslurm_allocated_nodes, False),
    "node_list": (("nodelist",), _text, False),
    "end_time": (("end_time",), _pyslurm_number, False),
}


def attributes(spec: Spec) -> tuple[str, ...]:
    """The attributes a backend reads from a pyslurm object to make a record for `spec`."""
    names = {path[0] for path, _, _ in spec.values() if path}
    for path, convert, _ in spec.values():
        if not path:  # a whole-record converter
            names |= _WHOLE_RECORD_READS[convert]
    return tuple(sorted(names))


_WHOLE_RECORD_READS: dict[Callable, set[str]] = {
    _pyslurm_exit: {"exit_code", "exit_code_signal"},
    _pyslurm_allocated_nodes: {"num_nodes", "start_time"},
    _pyslurm_end: {"end_time", "time_limit"},
}


# Every reason name Slurm has (job_state_reason.c: 218 in 25.11) is one capitalised word;
# a state description (squeue's Reason and pyslurm print it in place of the name when the
# job has one) is not: "launch failure limit exceeded requeued held", "ReqNodeNotAvail,
# UnavailableNodes:n1".
_REASON_NAME = re.compile(r"[A-Z][A-Za-z0-9]*")
_NAMED_DESCRIPTION = re.compile(rf"({_REASON_NAME.pattern})[,:]")


def reason_name(reason: str) -> str | None:
    """The reason's name when `reason` is one, or a description that starts with one
    ("ReqNodeNotAvail, UnavailableNodes:n1"); None for a description that names none."""
    if _REASON_NAME.fullmatch(reason):
        return reason
    head = _NAMED_DESCRIPTION.match(reason)
    return head.group(1) if head else None


def pyslurm_exact(job: JobInfo) -> bool:
    """Whether a JobInfo read through pyslurm is what squeue says. pyslurm gives the state
    description in place of the reason's name (`ReqNodeNotAvail, UnavailableNodes:n1`) and
    reports an exit code of 128 or more that is not a signal as code - 128 (`exit 143` reads
    15, `exit 128` reads 0: a signal reads 128+N here, so 1..127 and a FAILED job's 0 are in
    doubt); such jobs have to be read again from squeue. Its one-word state is squeue's."""
    doubtful_exit = job.exit_code is not None and (0 < job.exit_code < 128
                                                   or job.exit_code == 0 and job.state == "FAILED")
    return job.reason == reason_name(job.reason) and not doubtful_exit


def node_is_idle(state: object) -> bool:
    """Whether pyslurm's node state (`IDLE`, `IDLE+DRAIN`, `MIXED`, ...) is what `sinfo %t`
    prints as `idle`: base state IDLE and no flag that sinfo shows (drain, not responding,
    reserved, powered down, planned, ...)."""
    if not isinstance(state, str) or not state:
        return False
    base, *flags = state.upper().split("+")
    return base == "IDLE" and all(flag in _IDLE_FLAGS for flag in flags)


_IDLE_FLAGS = frozenset({"CLOUD", "DYNAMIC_FUTURE", "DYNAMIC_NORM", "EXTERNAL", "RESUME"})


def minutes_text(value: object) -> str:
    """A time limit in minutes (pyslurm) as scontrol prints it: UNLIMITED, M:SS or D-HH:MM:SS."""
    if value is None or isinstance(value, str) and value.upper() == "UNLIMITED":
        return "UNLIMITED"
    minutes = _number(value)
    days, rest = divmod(minutes * 60, 86400)
    hours, rest = divmod(rest, 3600)
    return f"{days}-{hours:02d}:{rest // 60:02d}:{rest % 60:02d}" if days else f"{hours:02d}:{rest // 60:02d}:{rest % 60:02d}"


def _lookup(rec: dict, path: tuple[str, ...]) -> tuple[bool, object]:
    value: object = rec
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return False, None
        value = value[key]
    return True, value


def release_of(doc: dict) -> str:
    """The Slurm release that printed `doc` ("22.05.8"), from its meta block."""
    meta = doc.get("meta") if isinstance(doc, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    slurm = meta.get("slurm") or meta.get("Slurm") or {}
    release = slurm.get("release") if isinstance(slurm, dict) else None
    return release if isinstance(release, str) and release else "(unknown version)"


def job_from_record(rec: object, spec: Spec = JOB_INFO, where: str = "squeue --json") -> JobInfo:
    """One JobInfo from one record of the given shape; RecordError (one line) if it has
    another shape. `where` names the release and command for that line."""
    if not isinstance(rec, dict):
        raise RecordError(f"{where}: a job record is {_kind(rec)}, expected an object")
    job = _job_label(rec.get("job_id", rec.get("id", "?")))
    values: dict[str, Any] = {}  # JobInfo's fields, each of the type its converter in `spec` gives
    for name, (path, convert, required) in spec.items():
        found, raw = _lookup(rec, path)
        if not found and required:
            raise RecordError(f"{where}: job {job} has no field {'.'.join(path)}; "
                              "this Slurm version is not supported by this slurm-hai")
        try:
            values[name] = convert(raw)
        except (_Shape, TypeError, ValueError) as e:
            raise RecordError(f"{where}: job {job} field {'.'.join(path) or name} is {e}; "
                              "this Slurm version is not supported by this slurm-hai") from None
    values["reason"] = values["reason"] or "None"
    return JobInfo(**values)


def _job_label(value: object) -> str:
    """A job id for an error line: the number, or a short one-line repr of what stands there."""
    if isinstance(value, int) and not isinstance(value, bool) or value == "?":
        return str(value)
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def jobs_from_json(doc: object, command: str = "squeue --json") -> tuple[list[JobInfo], list[RecordError]]:
    """Every readable job of a `squeue --json`, `scontrol show job --json` or `sacct --json`
    document, and one RecordError per record that could not be read."""
    if not isinstance(doc, dict) or not isinstance(doc.get("jobs"), list):
        raise RecordError(f"Slurm {release_of(doc) if isinstance(doc, dict) else '(unknown version)'} "
                          f"{command}: no job list in its output")
    where = f"Slurm {release_of(doc)} {command}"
    spec = JOB_INFO
    if command.startswith("sacct"):
        spec = ACCOUNTING_V38 if release_of(doc).startswith("22.05.") else ACCOUNTING
    jobs, problems = [], []
    for rec in doc["jobs"]:
        try:
            jobs.append(job_from_record(rec, spec, where))
        except RecordError as e:
            problems.append(e)
    return jobs, problems
