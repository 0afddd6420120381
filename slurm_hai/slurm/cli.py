"""The default backend: Slurm's own commands (sbatch, squeue, scontrol, scancel, sacct
--json, sacctmgr, sinfo, srun). Works on 22.05 and later; every call is an argv list, never a
shell line. How a typed operation is spelt as a command is in `commands.py`.
"""

from __future__ import annotations

import json
from dataclasses import replace
import os
import subprocess
import time
from typing import TYPE_CHECKING, Callable, Sequence

from . import commands, squeue
from .base import NodeInfo
from .errors import SlurmError, SlurmMissing
from .records import JobInfo, RecordError, jobs_from_json, jobs_from_text, reason_name
from .version import SlurmVersion

if TYPE_CHECKING:
    from ..policy.ladder import Change


def timeout() -> float:
    """How long a Slurm command may take, in seconds ($HAI_SLURM_TIMEOUT, read at each call)."""
    return float(os.environ.get("HAI_SLURM_TIMEOUT", "60"))


def _run(argv: Sequence[str], input: str | None = None, check: bool = True,
         cwd: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return _finish(_start(argv, cwd, env, stdin=input is not None), argv, input, check)


def _start(argv: Sequence[str], cwd: str | None = None, env: dict[str, str] | None = None,
           stdin: bool = False) -> subprocess.Popen:
    """The command, started, its output to be read by _finish (stdin: it will be given input)."""
    try:
        return subprocess.Popen(list(argv), text=True, stdin=subprocess.PIPE if stdin else None,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env)
    except OSError as e:
        raise _not_run(argv[0], e) from None


def _not_run(command: str, e: OSError) -> SlurmError:
    if isinstance(e, FileNotFoundError):
        return SlurmMissing(f"{command} not found: install the Slurm client commands (slurm-client) "
                            "or put them on PATH")
    if isinstance(e, PermissionError):
        return SlurmMissing(f"{command} could not be run: {e.strerror}")
    return SlurmError(f"{command} could not be run: {e.strerror}")  # e.g. E2BIG: too long an argument list


def _finish(proc: subprocess.Popen, argv: Sequence[str], input: str | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """The command's output once it has ended; SlurmError, one line, when it failed (`check`)."""
    try:
        out, err = proc.communicate(input, timeout=timeout())
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise SlurmError(f"{argv[0]} did not answer within {timeout():.0f} s: is slurmctld up? "
                         "(scontrol ping)") from None
    p = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
    if check and p.returncode != 0:
        if DBD_DOWN in p.stderr:  # three lines of connection errors say one thing
            why = (p.stderr.split(DBD_DOWN)[1].strip(": \n").splitlines() or ["no answer"])[0]
            raise SlurmError(f"{argv[0]}: Slurm's accounting (slurmdbd) does not answer ({why}); running and "
                             "waiting jobs are not affected: try again once it is back")
        raise SlurmError(f"{argv[0]}: {_detail(argv[0], p.stderr or p.stdout) or f'exit {p.returncode}'}")
    return p


GENERIC_FAILURES = ("Batch job submission failed: Unspecified error",)
# What sacctmgr prints, exit status 0, when it made no change it was asked for
SACCTMGR_REFUSALS = ("don't have access to their default qos", "Changes Discarded")
# sacct/sacctmgr's last line when slurmdbd is down or unreachable
DBD_DOWN = "Problem talking to the database"
WATCH_EVERY = 0.1  # s between two calls of run_step's watch


def _detail(command: str, output: str) -> str:
    """A command's error output as one line: without the repeated `sbatch: error:` prefixes
    and without Slurm's generic last line when a specific reason came before it."""
    lines = []
    for line in output.splitlines():
        for prefix in (f"{command}: error:", f"{command}:", "error:"):
            if line.strip().startswith(prefix):
                line = line.strip()[len(prefix):]
                break
        if line.strip():
            lines.append(line.strip())
    specific = [line for line in lines if line not in GENERIC_FAILURES]
    return " ".join(specific or lines)


def _json(text: str, command: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        raise RecordError(f"{command} printed something that is not JSON: "
                          f"{' '.join(text.split())[:80] or '(nothing)'}") from None


def _readable(found: tuple[list[JobInfo], list[RecordError]], wanted: Sequence[int] = ()) -> list[JobInfo]:
    """The jobs a record reader found. A record that cannot be read is logged and left out,
    so one odd job never hides the others; when it is a job that was asked for by id, its
    one-line RecordError is raised instead."""
    jobs, problems = found
    for problem in problems:
        if wanted:
            raise problem
        import logging  # lazy: +3 ms to queue reads

        logging.getLogger("slurm_hai.slurm").warning("left out of the queue: %s", problem)
    return jobs


class CliBackend:
    name = "cli"
    _version: SlurmVersion | None = None

    def __init__(self, remember_queue: bool = False) -> None:
        # remember_queue: the whole queue's records of the last read, for a caller that reads
        # it every few seconds (the policy daemon; records.jobs_from_text `known`)
        self._known: dict[tuple[str, ...], JobInfo] | None = {} if remember_queue else None

    def submit(self, script: str, args: Sequence[str] = ()) -> int:
        out = _run(["sbatch", "--parsable", *args], input=script).stdout.strip()
        return int(out.split(";")[0])

    def jobs(self, job_ids: Sequence[int] = (), user: str | None = None) -> list[JobInfo]:
        """The jobs slurmctld has, in every state (or the ones asked for, or a user's): the
        fields slurm-hai reads, as text (records.QUEUE_FORMAT), not `squeue --json`, which
        costs slurmctld and squeue 10-20x more at 10,000 jobs (docs/results-archive.md)."""
        try:
            read = squeue.take(job_ids, user) or squeue.start(job_ids, user)
        except OSError as e:
            raise _not_run("squeue", e) from None
        p = _finish(read.proc, read.argv, check=False)
        if p.returncode != 0:
            if "Invalid job id" in p.stderr:
                return []
            raise SlurmError("squeue: " + (" ".join(p.stderr.split()) or (
                f"killed by signal {-p.returncode}" if p.returncode < 0 else f"exit {p.returncode}")))
        known = self._known if not job_ids and user is None else None
        return self._named(_readable(jobs_from_text(p.stdout, read.sep, known=known), job_ids))

    def _named(self, jobs: list[JobInfo]) -> list[JobInfo]:
        """The jobs with their reasons' names. squeue prints a job's state description in
        place of its reason's name when the job has one; a description that starts with the
        name ("ReqNodeNotAvail, UnavailableNodes:n1") gives it, and the few jobs whose
        description names none ("launch failure limit exceeded requeued held", a job
        held by the requeue limit) are read again, as JSON, which has both (on 22.05, whose
        squeue --json ignores --jobs, that is the whole queue)."""
        fixed: dict[int, JobInfo] = {}
        unnamed: set[int] = set()
        for j in jobs:
            name = reason_name(j.reason)
            if name is None:
                unnamed.add(j.job_id)
            elif name != j.reason:
                fixed[j.job_id] = replace(j, reason=name)
        if unnamed:
            p = _run(["squeue", "--json", "--states=all", "--jobs=" + ",".join(map(str, sorted(unnamed)))],
                     check=False)
            if p.returncode == 0:  # else (one job, and it just left the queue): as squeue's text said
                fixed |= {j.job_id: j for j in _readable(jobs_from_json(_json(p.stdout, "squeue --json")))
                          if j.job_id in unnamed}
        return [fixed.get(j.job_id, j) for j in jobs]

    def job(self, job_id: int) -> JobInfo | None:
        found = [j for j in self.jobs([job_id]) if j.job_id == job_id]
        return found[0] if found else None

    def accounting(self, job_id: int) -> JobInfo | None:
        """The job as slurmdbd recorded it (`sacct --json`): also once slurmctld forgot it."""
        out = _run(["sacct", "--json", "-j", str(job_id)]).stdout
        found = [j for j in _readable(jobs_from_json(_json(out, "sacct --json"), "sacct --json"), [job_id])
                 if j.job_id == job_id]
        return found[-1] if found else None

    def accounting_since(self, since: float, user: str | None = None) -> list[JobInfo]:
        """Every run of the jobs that held nodes at some time since `since` (epoch seconds),
        as slurmdbd recorded them (`sacct --json --duplicates`): a job requeued K times is K+1
        records, each with the nodes, start and end of its run (a requeued run ends at its
        requeue). The jobs of `user`, else of every user the caller may see."""
        start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(since))
        argv = ["sacct", "--json", "--duplicates", "--allocations", f"--starttime={start}", "--endtime=now",
                f"--user={user}" if user else "--allusers"]
        jobs = _readable(jobs_from_json(_json(_run(argv).stdout, "sacct --json"), "sacct --json"))
        # 22.05's `sacct --json` ignores --user (seen: every user's jobs, also for a non-root caller)
        return [j for j in jobs if user is None or j.user == user]

    def last_run_ends(self, job_ids: Sequence[int]) -> dict[int, str]:
        """How the newest ended run of each job ended, as slurmdbd recorded it (`sacct
        --duplicates`, one row per run); a job whose last run is not recorded as ended is left out."""
        return commands.last_run_ends(_run(commands.run_ends_argv(job_ids)).stdout)

    def requeue(self, job_id: int | str) -> None:
        _run(["scontrol", "requeue", str(job_id)])

    def version(self) -> SlurmVersion:
        """The version of the Slurm the commands talk to (asked once per process)."""
        if self._version is None:
            self._version = SlurmVersion.parse(_run(["scontrol", "--version"]).stdout)
        return self._version

    def requeued_when_batch_ends(self, job_id: int) -> bool:
        """Whether Slurm itself requeues the job as soon as its batch script ends: a job in
        its preemption grace period, on Slurm 24.05 and later."""
        if not self.version().requeues_preempted_job_on_exit:
            return False
        job = self.job(job_id)
        return job is not None and job.state == "RUNNING" and bool(job.preempt_time)

    def cancel(self, job_id: int | str, signal: str | None = None) -> None:
        argv = ["scancel"]
        if signal:
            argv.append(f"--signal={signal}")
        _run([*argv, str(job_id)])

    def cancel_waiting_tasks(self, job_id: int) -> None:
        _run(["scancel", "--state=PENDING", str(job_id)])

    def update_job(self, job_id: int | str, **fields: str) -> None:
        _run(["scontrol", "update", f"JobId={job_id}", *(f"{k}={v}" for k, v in fields.items())])

    def release(self, job_id: int | str) -> None:
        _run(["scontrol", "release", str(job_id)])

    def array_task(self, job_id: int) -> str | None:
        """squeue of the array `job_id` names: each task's own id (%A) and its array name (%i:
        ARRAY_TASK, ARRAY_[TASKS] for the pending rest); the name of the one with `job_id`."""
        out = _run(["squeue", "--noheader", "--states=all", f"--jobs={job_id}", "--format=%A %i"],
                   env=squeue.queue_env(os.environ)).stdout
        for line in out.splitlines():
            own, _, name = line.strip().partition(" ")
            if own == str(job_id) and name.startswith(f"{job_id}_"):
                return name
        return None

    def shrink_allocation(self, job_id: int, nodes: int) -> None:
        """Slurm keeps the first `nodes` nodes and frees the others at once. scontrol writes
        slurm_job_<id>_resize.{sh,csh} where it runs: in a directory of its own, removed."""
        import tempfile  # lazy: +3 ms to every command that reaches Slurm

        with tempfile.TemporaryDirectory(prefix="hai-resize-") as scratch:
            _run(["scontrol", "update", f"JobId={job_id}", f"NumNodes={nodes}"], cwd=scratch)

    def config(self) -> dict[str, str]:
        out = _run(["scontrol", "show", "config"]).stdout
        conf: dict[str, str] = {}
        for line in out.splitlines():
            key, sep, value = line.partition("=")
            if sep:
                conf[key.strip()] = value.strip()
        return conf

    def preempt_sends_user_signal(self) -> bool:
        """Whether a preempted job gets its --signal instead of SIGTERM: 22.05 spells it
        SlurmctldParameters=preempt_send_user_signal, 23.02 and later also
        PreemptParameters=send_user_signal (slurmctld accepts both)."""
        conf = self.config()
        return ("preempt_send_user_signal" in conf.get("SlurmctldParameters", "").lower()
                or "send_user_signal" in conf.get("PreemptParameters", "").lower())

    def node_addr(self, node: str) -> str:
        found = commands.nodes_from_text(_run(["scontrol", "show", "node", "-o", node]).stdout)
        if not found or not found[0].addr:
            raise SlurmError(f"scontrol: node {node} has no NodeAddr")
        return found[0].addr

    def nodes(self) -> list[NodeInfo]:
        """Every node: its GPUs (gpu GRES) and partitions (`scontrol show node -o`)."""
        return commands.nodes_from_text(_run(["scontrol", "show", "node", "-o"]).stdout)

    def expand_hostlist(self, hostlist: str) -> list[str]:
        return _run(["scontrol", "show", "hostnames", hostlist]).stdout.split()

    def _show(self, entity: str, fields: Sequence[str]) -> list[dict[str, str]]:
        return commands.parsable_rows(_run(commands.show_argv(entity, fields)).stdout, fields)

    def qos(self) -> list[dict[str, str]]:
        """Every QOS, keyed by commands.QOS_FIELDS, as `sacctmgr show qos` prints them."""
        return self._show("qos", commands.QOS_FIELDS)

    def associations(self) -> list[dict[str, str]]:
        """Every association (commands.ASSOC_FIELDS); User is "" for an account's own."""
        return self._show("assoc", commands.ASSOC_FIELDS)

    def users(self) -> list[dict[str, str]]:
        """Every accounting user and their default account (commands.USER_FIELDS)."""
        return self._show("user", commands.USER_FIELDS)

    def apply(self, change: Change) -> None:
        """Make one policy change (sacctmgr -i / scontrol create|update); a failure names the command."""
        argv = commands.change_argv(change)
        try:
            p = _run(argv)
        except SlurmError as e:
            raise SlurmError(f"{e} (while: {' '.join(argv)})") from None
        # sacctmgr refuses some changes in words and still exits 0 (a default QOS that an
        # association below could not use: "don't have access to their default qos")
        refused = next((line.strip() for line in (p.stdout + p.stderr).splitlines()
                        if any(sign in line for sign in SACCTMGR_REFUSALS)), None)
        if refused:
            raise SlurmError(f"sacctmgr: {refused} (while: {' '.join(argv)})")

    def partitions(self) -> list[dict[str, str]]:
        """`scontrol show partition -o`: one dict of KEY=VALUE per partition."""
        out = _run(["scontrol", "show", "partition", "-o"]).stdout
        parts = []
        for line in out.splitlines():
            fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
            if "PartitionName" in fields:
                parts.append(fields)
        return parts

    def idle_nodes(self) -> dict[str, int]:
        """Partition -> number of its nodes that are idle now."""
        out = _run(["sinfo", "-h", "-o", "%R %t %D"]).stdout
        idle: dict[str, int] = {}
        for line in out.splitlines():
            part, state, count = (line.split() + ["", "", "0"])[:3]
            idle.setdefault(part, 0)
            if state == "idle":
                idle[part] += int(count)
        return idle

    def run_step(self, command: Sequence[str], nodes: int | str, gpus_per_node: int = 0, job_name: str = "hai",
                 watch: Callable[[], None] | None = None) -> int:
        """Run `command` as one job step, once on each of `nodes` nodes (from inside a batch
        script), and wait for it: its exit status. Slurm's SIGTERM to the batch script
        reaches the step too; a signal handler of the caller does not cut the wait short.
        `watch`: called every WATCH_EVERY s while the step runs."""
        argv = commands.step_argv(command, nodes, gpus_per_node, job_name)
        try:
            step = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        except OSError as e:
            raise SlurmError(f"srun could not be run: {e.strerror}; is this a Slurm batch job?") from None
        while watch is not None:
            try:
                return step.wait(WATCH_EVERY)  # EINTR is retried
            except subprocess.TimeoutExpired:
                watch()
        return step.wait()
