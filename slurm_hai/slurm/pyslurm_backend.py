"""Backend on pyslurm 25.11 (Slurm's C API in-process), for Slurm 25.11 only.

pyslurm is built against the running Slurm's headers and library (docs/admin-guide.md,
"pyslurm"); PyPI has it only for Slurm 25.11. `backend()` picks this one when
HAI_SLURM_BACKEND=pyslurm (or `auto`) and pyslurm's version matches the running Slurm.

Through pyslurm (no process started):
- reads: `jobs()`/`job()` (one RPC for the whole queue: `pyslurm.Jobs.load`, or
  `pyslurm.Job.load` per asked id), `accounting()` (`pyslurm.db.Job`), `config()` and
  `preempt_sends_user_signal()` (`pyslurm.slurmctld.Config`), `partitions()`
  (`pyslurm.Partitions`, the keys slurm-hai reads, spelt as scontrol does), `idle_nodes()`
  (`pyslurm.Nodes`), `node_addr()` (`pyslurm.Node`), `expand_hostlist()`
  (`pyslurm.utils.nodelist_from_range_str`);
- writes: `requeue()` (`Job.requeue`), `cancel()` with or without a signal
  (`Job.send_signal`, to the job's steps but not the batch shell, as scancel does),
  `update_job()` of Priority, QOS, StartTime, Comment and AdminComment (`Job.modify`),
  `release()` (`Job.release`).

Kept on the Slurm commands (inherited from the CLI backend), mostly because pyslurm lacks them:
- `submit()`: pyslurm submits a JobSubmitDescription, not a batch script with sbatch's
  options; hai-submit renders a script and sbatch argv;
- `accounting_since()` (the timeline): every run of a requeued job as its own record is
  what `sacct --json --duplicates` gives; pyslurm.db's job map holds one record per id;
- `qos()`, `associations()`, `users()` and `apply()` (sacctmgr, scontrol create/update):
  pyslurm.db has no QOS/association writes for all that `hai-admin apply` changes, and
  the reads stay beside the writes they are compared with;
- `nodes()` (`scontrol show node -o`: GPUs and partitions; one call per hai-submit, not
  worth a second GRES parser) and `run_step()` (a job step is srun's process, not an RPC);
- `update_job()` of any other field, or with an empty value: pyslurm cannot clear a
  string (an empty value means "unchanged" to it);
- the record of a job pyslurm cannot give exactly (`records.pyslurm_exact`): a reason
  that is a description (pyslurm gives it in place of the reason's name), an exit code of
  1..127, or 0 for a FAILED job (pyslurm reports `exit 143` as 15 and `exit 128` as 0).
  Those few jobs are read again with one squeue, so both backends give the same JobInfo.

pyslurm's errors (pyslurm.RPCError and others) become a one-line SlurmError.
"""

from __future__ import annotations

import logging
import re
import shutil
import signal as signals
import subprocess
from typing import Sequence

from .cli import CliBackend
from .errors import SlurmError
from .records import (PYSLURM, PYSLURM_DB, JobInfo, attributes, job_from_record, minutes_text, node_is_idle,
                      pyslurm_exact)

log = logging.getLogger("slurm_hai.slurm")

# Job.load per id up to this many ids; more: one Jobs.load of the whole queue.
LOAD_EACH_UP_TO = 16
# squeue --jobs=ID,... for up to this many jobs pyslurm cannot tell exactly; more: all of squeue.
SQUEUE_BY_ID_UP_TO = 200
JOB_ATTRS = attributes(PYSLURM)
DB_ATTRS = attributes(PYSLURM_DB)
# scontrol update field -> JobSubmitDescription attribute (and how its value is given)
UPDATABLE = {"Priority": ("priority", int), "QOS": ("qos", str), "StartTime": ("begin_time", str),
             "Comment": ("comment", str), "AdminComment": ("admin_comment", str)}


def _slurm_version() -> str | None:
    if not shutil.which("sinfo"):
        return None
    out = subprocess.run(["sinfo", "--version"], text=True, capture_output=True).stdout
    m = re.search(r"(\d+)\.(\d+)", out)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def why_not() -> str | None:
    """None when pyslurm is importable and made for this Slurm, else the reason it is not."""
    try:
        import pyslurm  # lazy: pyslurm, an optional extra  # noqa: F401
    except ImportError as e:
        return "pyslurm is not installed" if e.name == "pyslurm" else f"pyslurm does not load ({_line(e)})"
    version = getattr(pyslurm, "__version__", "")
    running = _slurm_version()
    if not running or not version.startswith(running):
        return f"pyslurm {version or '?'} does not match Slurm {running or '?'}"
    return None


def usable() -> bool:
    return why_not() is None


def _line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _pyslurm():
    import pyslurm  # lazy: pyslurm, an optional extra

    return pyslurm


def _call(what: str, fn, *args, **kwargs):
    """fn(...), with pyslurm's exceptions as one-line SlurmErrors naming `what`."""
    pyslurm = _pyslurm()
    try:
        return fn(*args, **kwargs)
    except (pyslurm.PyslurmError, ValueError, TypeError, KeyError, OSError, MemoryError) as e:
        raise SlurmError(f"pyslurm {what}: {_line(e)}") from None


def _invalid_job(e: BaseException) -> bool:
    return "invalid job id" in str(e).lower()


def _record(obj, names: Sequence[str]) -> dict:
    return {name: getattr(obj, name) for name in names}


def _signal_number(sig: str | int) -> int:
    """USR2, SIGUSR2, 12 -> 12 (as scancel --signal takes them)."""
    text = str(sig).strip().upper()
    if text.isdigit():
        return int(text)
    try:
        return int(signals.Signals[text if text.startswith("SIG") else "SIG" + text])
    except KeyError:
        raise SlurmError(f"unknown signal {sig!r}") from None


class PyslurmBackend(CliBackend):
    name = "pyslurm"

    def __init__(self) -> None:
        self.where = f"pyslurm {getattr(_pyslurm(), '__version__', '?')}"

    # ------------------------------------------------------------------ reads

    def _loaded(self, job_ids: Sequence[int]) -> list:
        pyslurm = _pyslurm()
        if job_ids and len(job_ids) <= LOAD_EACH_UP_TO:
            out = []
            for jid in dict.fromkeys(int(j) for j in job_ids):
                try:
                    out.append(pyslurm.Job.load(jid))
                except pyslurm.PyslurmError as e:
                    if not _invalid_job(e):
                        raise SlurmError(f"{self.where} Job.load({jid}): {_line(e)}") from None
            return out
        loaded = _call("Jobs.load()", pyslurm.Jobs.load, preload_passwd_info=True)
        wanted = {int(j) for j in job_ids}
        return [job for job in loaded.values() if not wanted or job.id in wanted]

    def jobs(self, job_ids: Sequence[int] = (), user: str | None = None) -> list[JobInfo]:
        """Every job slurmctld has (as `squeue --states=all`), or the ones asked for.
        A record that cannot be read is logged and left out, unless it was asked for."""
        where = f"{self.where} Jobs.load()"
        out: list[JobInfo] = []
        inexact: list[int] = []
        for job in self._loaded(job_ids):
            try:
                rec = _call("job record", _record, job, JOB_ATTRS)
                info = job_from_record(rec, PYSLURM, where)
            except SlurmError as e:
                if job_ids:
                    raise
                log.warning("left out of the queue: %s", e)
                continue
            if user and info.user != user:
                continue
            out.append(info)
            if not pyslurm_exact(info):
                inexact.append(info.job_id)
        if inexact:  # described reasons, doubtful exit codes: squeue knows
            ask = inexact if len(inexact) <= SQUEUE_BY_ID_UP_TO else ()  # else one squeue of all
            again = {j.job_id: j for j in CliBackend.jobs(self, ask) if j.job_id in set(inexact)}
            out = [again.get(j.job_id, j) if j.job_id in inexact else j for j in out]
            out = [j for j in out if j.job_id not in inexact or j.job_id in again]
        return out

    def job(self, job_id: int) -> JobInfo | None:
        found = [j for j in self.jobs([job_id]) if j.job_id == job_id]
        return found[0] if found else None

    def accounting(self, job_id: int) -> JobInfo | None:
        """The job as slurmdbd recorded it (pyslurm.db, as `sacct --json -j ID`)."""
        pyslurm = _pyslurm()
        where = f"{self.where} db.Jobs.load()"
        jobs = _call("db.Jobs.load()", lambda: pyslurm.db.Jobs.load(pyslurm.db.JobFilter(ids=[int(job_id)])))
        found = [job for job in jobs.values() if job.id == int(job_id)]
        if not found:
            return None
        return job_from_record(_call("db job record", _record, found[-1], DB_ATTRS), PYSLURM_DB, where)

    def _config(self):
        pyslurm = _pyslurm()
        return _call("slurmctld.Config.load()", pyslurm.slurmctld.Config.load)

    def config(self) -> dict[str, str]:
        """The scontrol keys slurm-hai reads (a subset of `scontrol show config`)."""
        conf = self._config()
        out = {}
        for key, attr in CONFIG_KEYS.items():
            value = getattr(conf, attr, None)
            if isinstance(value, dict):
                value = ",".join(k if v is True else f"{k}={v}" for k, v in value.items())
            elif isinstance(value, (list, tuple)):
                value = ",".join(map(str, value))
            out[key] = "(null)" if value in (None, "") else str(value)
        return out

    def preempt_sends_user_signal(self) -> bool:
        conf = self._config()
        params = {**(conf.slurmctld_parameters or {}), **(conf.preempt_parameters or {})}
        return any(k.lower() in ("preempt_send_user_signal", "send_user_signal") for k in params)

    def node_addr(self, node: str) -> str:
        pyslurm = _pyslurm()
        addr = _call(f"Node.load({node})", lambda: pyslurm.Node.load(node).address)
        if not addr:
            raise SlurmError(f"pyslurm: node {node} has no NodeAddr")
        return addr

    def expand_hostlist(self, hostlist: str) -> list[str]:
        pyslurm = _pyslurm()
        return list(_call(f"nodelist_from_range_str({hostlist})", pyslurm.utils.nodelist_from_range_str, hostlist))

    def partitions(self) -> list[dict[str, str]]:
        """One dict per partition with the keys slurm-hai reads, spelt and valued as in
        `scontrol show partition -o`."""
        pyslurm = _pyslurm()
        parts = _call("Partitions.load()", pyslurm.Partitions.load)
        out = []
        for p in parts.values():
            out.append({
                "PartitionName": p.name,
                "Nodes": p.nodes or "(null)",
                "Default": "YES" if p.is_default else "NO",
                "PriorityTier": str(p.priority_tier or 0),
                "AllowQos": ",".join(p.allowed_qos or ["ALL"]),
                "State": p.state,
                "MaxTime": minutes_text(p.max_time),
                "TotalNodes": str(p.total_nodes or 0),
            })
        return out

    def idle_nodes(self) -> dict[str, int]:
        """Partition -> number of its nodes that are idle now (what `sinfo %t` calls idle)."""
        pyslurm = _pyslurm()
        idle = {p: 0 for p in _call("Partitions.load()", pyslurm.Partitions.load).keys()}
        for node in _call("Nodes.load()", pyslurm.Nodes.load).values():
            if node_is_idle(node.state):
                for part in node.partitions or ():
                    idle[part] = idle.get(part, 0) + 1
        return idle

    # ------------------------------------------------------------------ writes

    def requeue(self, job_id: int | str) -> None:
        if isinstance(job_id, str):  # an array's task ("ARRAY_TASK"): pyslurm takes numbers only
            return CliBackend.requeue(self, job_id)
        pyslurm = _pyslurm()
        _call(f"requeue of job {job_id}", pyslurm.Job(int(job_id)).requeue)

    def cancel(self, job_id: int | str, signal: str | None = None) -> None:
        """Without a signal: cancel the job. With one: send it to the job's steps but not
        to the batch shell, as `scancel --signal` does."""
        if isinstance(job_id, str):  # an array's task ("ARRAY_TASK"): pyslurm takes numbers only
            return CliBackend.cancel(self, job_id, signal)
        pyslurm = _pyslurm()
        job = pyslurm.Job(int(job_id))
        if signal is None:
            _call(f"cancel of job {job_id}", job.cancel)
        else:
            _call(f"signal {signal} to job {job_id}", job.send_signal, _signal_number(signal))

    def update_job(self, job_id: int | str, **fields: str) -> None:
        if not fields:
            return
        if isinstance(job_id, str) or any(k not in UPDATABLE or str(v) == "" for k, v in fields.items()):
            # an array's task ("ARRAY_TASK"): pyslurm takes numbers only
            return CliBackend.update_job(self, job_id, **fields)  # pyslurm lacks it (or cannot clear)
        pyslurm = _pyslurm()
        try:
            changes = {UPDATABLE[k][0]: UPDATABLE[k][1](v) for k, v in fields.items()}
        except ValueError as e:
            raise SlurmError(f"job {job_id}: {_line(e)}") from None
        desc = _call("JobSubmitDescription", pyslurm.JobSubmitDescription, **changes)
        what = " ".join(f"{k}={v}" for k, v in fields.items())
        _call(f"update of job {job_id} ({what})", pyslurm.Job(int(job_id)).modify, desc)

    def release(self, job_id: int | str) -> None:
        if isinstance(job_id, str):  # an array's task ("ARRAY_TASK"): pyslurm takes numbers only
            return CliBackend.release(self, job_id)
        pyslurm = _pyslurm()
        _call(f"release of job {job_id}", pyslurm.Job(int(job_id)).release)


# scontrol show config key -> pyslurm.slurmctld.Config attribute
CONFIG_KEYS = {
    "ClusterName": "cluster_name",
    "SlurmctldParameters": "slurmctld_parameters",
    "PreemptParameters": "preempt_parameters",
    "PreemptMode": "preempt_mode",
    "PreemptType": "preempt_type",
    "SchedulerParameters": "scheduler_parameters",
    "MaxJobCount": "max_job_count",
    "AuthInfo": "auth_info",  # the MUNGE socket a part asks its lighthouse through (runtime/parts.py)
}
