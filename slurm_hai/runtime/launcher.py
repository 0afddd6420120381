"""The per-node launcher: one per node under srun (started by the batch script).

It sets the HAI environment contract, runs the user's command once on this node with its
output appended to logs/rank-<R>.log (a child of the launcher, in the job's step: Slurm
tracks, signals and kills it), and turns Slurm's signals into the HAI protocol:

  --notice-signal (the policy's notice_signal: USR1, USR2 (the default) or TERM)
            the suspend notice (preemption grace with preempt_send_user_signal, the time
            limit approaching via the job's --signal, the policy daemon, or `hai suspend`).
            On the rank-0 node it sets the flag that receive_suspend_command() reads; other
            nodes ignore it. If the job does not go_suspend() within the grace time, rank 0
            suspends it by force: it ends the command and the step, and the batch script
            requeues the job (runtime/protocol.py: the batch script alone requeues a run).
  SIGTERM   the end: Slurm is killing the step (requeue, cancel). The command's process
            group, and any process below it in a session of its own (torchrun's workers),
            gets SIGTERM, then SIGKILL. Where SIGTERM is a notice too (the notice signal is
            TERM, or --term-is-notice on clusters without preempt_send_user_signal, where srun
            would otherwise turn Slurm's preemption SIGTERM into SIGKILL for every task), the
            first SIGTERM of a run not yet noticed or suspended is the notice, later ones the end.

Signal handlers only record the signal; the main loop acts (no work in handlers).

Every run of a job uses the same number of threads per process (OMP_NUM_THREADS and
MKL_NUM_THREADS, which torch reads): fixed by the job's first run and recorded in the job
directory (`threads`), since a bitwise resume needs the same count in every run and a
requeued job may land on nodes with other CPUs.

`python -m slurm_hai.runtime.launcher --job-dir DIR --grace S [--notice-signal NAME] [--term-is-notice] -- CMD...`
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from ..slurm import SlurmError, backend, squeue
from .client import FLAG_LEAVE
from . import protocol
from ..policy.contract import node_contract
from .multiprocessing import default_nprocs
from .proctree import descendants
from ..jobs.jobdir import JobDir, open_request
from ..policy.limits import NOTICE_MARGIN, NOTICE_SIGNALS

TERM_TO_KILL_SECONDS = 3.0
LEAVE = signal.Signals[f"SIG{protocol.LEAVE_SIGNAL}"]
MARKER_EVERY = 0.5  # s between two looks for the run's suspend marker (on a shared file system)
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# How often the launcher looks at its job's record for the policy daemon's word on a
# preemption by Slurm, until the grace is over or the run has ended (a run that leaves first
# gets it from its next run's batch script: runtime/batch.py untold_cause).
CAUSE_POLL = 0.25

# A notice's cause (the notice event's fields), and the call that waits for the policy
# daemon's word when the job's record does not have it yet (_why_notice)
Cause = tuple[dict, Callable[[], dict | None] | None]


def notice_signals(name: str, term_is_notice: bool) -> frozenset[signal.Signals]:
    """The signals that are a job's suspend notice: its notice signal (`name`, as the policy
    and sbatch --signal spell it: USR1), and SIGTERM where Slurm's preemption sends that
    instead (`term_is_notice`: no preempt_send_user_signal)."""
    return frozenset({signal.Signals[f"SIG{name}"], *((signal.SIGTERM,) if term_is_notice else ())})


def flag_path(job_id: str, run: int) -> Path:
    """Node-local flag file, in a new directory private to the job's user. Its name is
    random and created exclusively (mkdtemp, 0700): no path another user makes beforehand
    can stand in for it or keep the run from starting."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")
    return Path(tempfile.mkdtemp(prefix=f"slurm-hai-{job_id}.{run}-", dir=base)) / "suspend"


def node_memory_dir(jobdir: JobDir, job_id: str) -> Path | None:
    """The job's directory in this node's memory (HAI_NODE_MEMORY, for CheckpointManager's
    fast_dir): the same on every run of the job on this node, so that a restart here finds
    the suspend checkpoint it left. Made with mkdtemp (0700, a random name nobody can claim
    first); its path is kept in the job directory, per node. None without /dev/shm."""
    if not os.path.isdir("/dev/shm"):
        return None
    record = jobdir.path / "node-memory" / (os.environ.get("SLURMD_NODENAME") or os.uname().nodename)
    try:
        path = Path(record.read_text().strip())
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077:
            return path
    except (OSError, ValueError):
        pass  # first run on this node, or the node lost its memory (a reboot)
    path = Path(tempfile.mkdtemp(prefix=f"slurm-hai-{job_id}-memory-", dir="/dev/shm"))
    record.parent.mkdir(mode=0o700, exist_ok=True)
    tmp = record.with_name(f".{record.name}.{os.getpid()}")
    tmp.write_text(str(path))
    os.replace(tmp, record)
    return path


def pinned_threads(jobdir: JobDir) -> int:
    """Threads per process for every run of the job. The first run takes OMP_NUM_THREADS
    when the job sets it (hai-submit -e), else this node's CPUs divided by its processes
    (one per GPU, as spawn() and --torchrun start them); the first node to record its number
    wins (link is atomic), and every node of every later run reads it."""
    path = jobdir.path / "threads"
    try:
        return int(path.read_text())
    except FileNotFoundError:
        pass
    given = os.environ.get("OMP_NUM_THREADS", "")
    cpus = len(os.sched_getaffinity(0))
    threads = int(given) if given.isdigit() and int(given) > 0 else max(1, cpus // default_nprocs())
    tmp = path.with_name(f".threads.{os.uname().nodename}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, str(threads).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass  # another node of this run was first
    finally:
        tmp.unlink()
    return int(path.read_text())


class NodeRun:
    """One run of the user's command on one node, and the suspend protocol around it."""

    def __init__(self, cmd: list[str], env: dict[str, str], jobdir: JobDir, run: int, rank: int, grace: float,
                 notices: frozenset[signal.Signals], flag: Path | None,
                 why_notice: Callable[[], Callable[[], Cause]] | None = None,
                 notice_lost: Callable[[], bool] | None = None) -> None:
        self.cmd, self.env, self.jobdir, self.run, self.rank = cmd, env, jobdir, run, rank
        # starts reading the job's record for the notice's cause (preempted, grow, user,
        # time_limit), for target_size() and `hai status`, and gives the call that takes it
        self.why_notice = why_notice
        self.notice_lost = notice_lost  # whether Slurm's time-limit notice may have come before the handlers
        self.grace, self.notices, self.flag = grace, notices, flag
        self.term_is_notice = signal.SIGTERM in notices  # until the first SIGTERM: later ones end the step
        self.noticed_at: float | None = None
        self.forced = False
        self.ending_at: float | None = None
        self.left = False  # go_suspend() was called: the step ends, the batch script requeues
        self.marker_seen_at = -MARKER_EVERY  # when suspend.<run> was last looked for
        self.ending: set[int] = set()  # every process found below the command since the end began
        self.pending: list[int] = []
        self.child: subprocess.Popen | None = None

    def start(self) -> None:
        try:
            threads = pinned_threads(self.jobdir)
        except (OSError, ValueError) as e:
            raise SystemExit(could_not_start(self.jobdir, self.run, self.rank, f"no thread count for the job: {e}")) from None
        self.env.update(dict.fromkeys(THREAD_VARS, str(threads)))
        if self.flag is not None:
            fd = os.open(self.flag, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.write(fd, b"0")
            os.close(fd)
            self.env["HAI_SUSPEND_FLAG"] = str(self.flag)
        else:
            self.env.pop("HAI_SUSPEND_FLAG", None)
        log = self.jobdir.open_run_log(self.run, self.rank)
        try:
            self.child = subprocess.Popen(self.cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          preexec_fn=self._ignore_notice_signals)
        except OSError as e:
            from ..jobs.request import missing_interpreter  # lazy: failure path, +18 ms

            missing = missing_interpreter(self.cmd[0]) if isinstance(e, FileNotFoundError) else ""
            why = f"{self.cmd[0]}: {missing} (on {os.uname().nodename})" if missing else f"cannot start {self.cmd[0]!r}: {e}"
            raise SystemExit(could_not_start(self.jobdir, self.run, self.rank, why)) from None
        finally:
            os.close(log)

    def _ignore_notice_signals(self) -> None:
        """In the child, before exec: Slurm signals every process of the step, not only the
        launcher, so the notice signals must not kill the user's processes (ignored
        dispositions survive exec and are inherited by the processes they spawn)."""
        for sig in self.notices:
            signal.signal(sig, signal.SIG_IGN)

    def _suspend_requested_before_handlers(self) -> bool:
        """Whether `hai suspend` asked for this run before the launcher could hear it: the
        notice signals are ignored from the step's start (batch.launcher_argv), and a job
        Slurm runs may have no step yet, so a notice that came before is lost, but the
        request (of this run, journalled before the signal) is in the job's events."""
        return open_request(self.jobdir.events(), self.run) is not None

    def notice(self, source: str) -> None:
        if self.flag is None or self.noticed_at is not None:
            return
        cause: dict = {}
        answer = later = None
        if self.why_notice is not None:  # asked before the flag, read after it (_why_notice)
            try:
                answer = self.why_notice()
            except Exception as e:  # noqa: BLE001 - the cause is for people; the protocol goes on
                cause = {"cause": "unknown", "cause_error": str(e)}
        with open(self.flag, "r+b", buffering=0) as f:
            f.write(b"1")
        self.noticed_at = time.monotonic()
        at = round(time.time(), 3)
        if answer is not None:
            try:
                cause, later = answer()
            except Exception as e:  # noqa: BLE001 - as above
                cause = {"cause": "unknown", "cause_error": str(e)}
        self.jobdir.event(protocol.NOTICE, run=self.run, source=source, grace=self.grace, **cause, t=at)
        if later is not None:
            threading.Thread(target=self._journal_cause, args=(later,), daemon=True).start()

    def _journal_cause(self, told_later: Callable[[], dict | None]) -> None:
        """The policy daemon's word on a preemption by Slurm, journalled once it comes (the
        notice, journalled at once, named no job and no size: target_size() waits for it)."""
        try:
            told = told_later()
        except Exception as e:  # noqa: BLE001 - the cause is for people; the protocol goes on
            print(f"slurm-hai: run {self.run}: the notice's cause not read: {e}", file=sys.stderr, flush=True)
            return
        if told is not None:
            self.jobdir.event(protocol.NOTICE_CAUSE, run=self.run, **told)

    def end(self) -> None:
        """Slurm is ending the step: stop the command's processes, TERM then KILL."""
        if self.ending_at is None and self.child is not None:
            self.ending_at = time.monotonic()
            # Where SIGTERM is a notice the command ignores it: only SIGKILL ends it.
            self._signal_all(signal.SIGKILL if signal.SIGTERM in self.notices else signal.SIGTERM)

    def _signal_all(self, sig: int) -> None:
        """The command's process group and every process below it, in whatever session."""
        assert self.child is not None  # only once the run has started: end() checks, tick() follows end()
        self.ending |= descendants(self.child.pid)
        for kill, pid in ((os.killpg, self.child.pid), *((os.kill, p) for p in sorted(self.ending))):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(pid, sig)

    def handle(self, sig: int) -> None:
        if sig == LEAVE:
            self.leave()
        elif sig in self.notices and sig != signal.SIGTERM:
            self.notice("signal")
        elif sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            if (self.term_is_notice and self.noticed_at is None and self.jobdir.suspended(self.run) is None
                    and sig == signal.SIGTERM):
                self.term_is_notice = False  # only the first one
                self.notice("sigterm")
            else:
                self.end()

    def leave(self) -> None:
        """The run ends by a suspend (go_suspend(), or forced on rank 0's node): end the
        command, and exit 0 (main). The other nodes' launchers leave on the batch script's
        LEAVE_SIGNAL, or when they see the run's marker; the batch script then requeues the
        job."""
        if not self.left:
            self.left = True
            self.jobdir.event("left_for_requeue", run=self.run, rank=self.rank)
            print(f"slurm-hai: run {self.run}: suspended ({self.jobdir.suspended(self.run) or 'go_suspend'}); ending "
                  "the step, the batch script requeues the job", file=sys.stderr, flush=True)
            self.end()

    def _flag_says_leave(self) -> bool:
        assert self.flag is not None  # only rank 0's node has one (tick checks)
        try:
            with open(self.flag, "rb", buffering=0) as f:
                return f.read(1) == bytes([FLAG_LEAVE])
        except OSError:
            return False

    def _suspended_elsewhere(self, now: float) -> bool:
        """Whether the run was marked as ending by a suspend (suspend.<run>, in the job's
        directory), looked at every MARKER_EVERY s: a node whose own command did not call
        go_suspend() ends its command too, so that the step ends on every node even when
        srun cannot ask slurmctld to end it (a controller away)."""
        if self.ending_at is not None or now < self.marker_seen_at + MARKER_EVERY:
            return False
        self.marker_seen_at = now
        return self.jobdir.suspended(self.run) is not None

    def tick(self) -> None:
        while self.pending:
            self.handle(self.pending.pop(0))
        now = time.monotonic()
        if not self.left and ((self.flag is not None and self._flag_says_leave()) or self._suspended_elsewhere(now)):
            self.leave()
        if (self.noticed_at is not None and not self.forced and now - self.noticed_at >= self.grace
                and self.jobdir.suspended(self.run) is None):
            self.forced = True
            self.jobdir.mark_suspend(self.run, "forced")
            self.jobdir.event("forced_suspend", run=self.run, after=round(now - self.noticed_at, 3))
            self.end()
        if self.ending_at is not None and now - self.ending_at >= TERM_TO_KILL_SECONDS:
            self._signal_all(signal.SIGKILL)

    def wait(self) -> int:
        for sig in (*self.notices, LEAVE, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda s, _f: self.pending.append(s))
        if self.flag is not None and self._suspend_requested_before_handlers():
            self.notice("signal")
        elif self.flag is not None and self.notice_lost is not None and self.notice_lost():
            self.notice("time_limit_at_start")
        assert self.child is not None  # start() came first (it exits if the command cannot start)
        try:
            while True:
                try:
                    rc = self.child.wait(timeout=0.05)
                    break
                except subprocess.TimeoutExpired:
                    self.tick()
        finally:
            if self.flag is not None:
                self.flag.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    self.flag.parent.rmdir()
        return rc if rc >= 0 else 128 - rc


def could_not_start(jobdir: JobDir, run: int, rank: int, why: str) -> int:
    """A run that fails before the user's command starts: the reason goes into the job's
    events (`hai status` shows it in words), the rank's log (`hai logs`) and stderr (the
    batch log). Returns 127."""
    jobdir.event("launch_failed", run=run, rank=rank, error=why)
    line = f"slurm-hai: run {run} rank {rank} could not start: {why}\n"
    with contextlib.suppress(OSError):
        fd = os.open(jobdir.rank_log(rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    sys.stderr.write(line)
    return 127


# Slurm sends a time limit's --signal from a check it makes every SLURM_PERIODIC_S, as soon as
# the job has at most its notice time + SLURM_PERIODIC_S left, to the job's steps alone
# (src/slurmctld/job_mgr.c, send_job_warn_signal). For a job whose limit is that short, the
# check at its start sends it before the step (or the launcher's handlers) is there, and it
# is lost: seen on 26.05 under load, a 60 s job with a 35 s notice killed at its limit.
SLURM_PERIODIC_S = 30
# How long from the job's start to the launcher's handlers, at most (Python's start on a
# loaded node included).
HANDLERS_WITHIN_S = 15


def notice_lost_at_start(job, grace: float) -> bool:
    """Whether Slurm's record `job` (None: none) says the run's time-limit notice was due
    before its launcher could take it: a limit of at most the notice time (grace +
    NOTICE_MARGIN) + SLURM_PERIODIC_S + HANDLERS_WITHIN_S."""
    return (job is not None and job.start_time > 0 and job.end_time > 0
            and job.end_time - job.start_time <= grace + NOTICE_MARGIN + SLURM_PERIODIC_S + HANDLERS_WITHIN_S)


def _notice_lost(slurm, job_id: int, grace: float) -> bool:
    """notice_lost_at_start by Slurm's record of the job (one query; none: not lost)."""
    try:
        return notice_lost_at_start(slurm.job(job_id), grace)
    except SlurmError:
        return False


@contextlib.contextmanager
def _term_blocked() -> Iterator[None]:
    """SIGTERM blocked in this thread (and in the processes it starts meanwhile)."""
    was = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, was)


def _own_record(slurm, job_id: int):
    """Slurm's record of this job, read with SIGTERM blocked (a SIGTERM notice reaches every
    process of the step, a squeue started meanwhile too: seen on 25.11 and 22.05, squeue
    killed with nothing on stderr), and one more try for anything else."""
    with _term_blocked():
        try:
            return slurm.job(job_id)
        except SlurmError:
            time.sleep(0.2)
            return slurm.job(job_id)


def _why_notice(slurm, job_id: int, jobdir: JobDir, run: int, grace: float) -> Callable[[], Cause]:
    """Start reading the job's own record in Slurm (one squeue of this job), before the
    flag is set, and give the call that takes the answer, after it: the record must be the
    job's as it was at the notice, not requeued by a job that suspends within milliseconds
    of its flag (cause 'unknown': CI, 22.05, when go_suspend() still asked for the requeue
    itself). The read starts with SIGTERM blocked (_own_record; a blocked mask survives fork
    and exec, and the launcher's own pending SIGTERM arrives when it is unblocked again).

    The answer is the notice's cause (jobs.status.notice_cause: the policy daemon decided it
    and wrote it into the record), and, for a preemption by Slurm that the daemon has not told
    of yet, the call that waits for its word: the job's record, looked at every CAUSE_POLL s
    for up to the grace. No node reads the queue or the policy."""
    if slurm.name == "cli":  # its job() takes the read started ahead (pyslurm asks when called)
        with _term_blocked():
            squeue.start_ahead([job_id])

    def answer() -> Cause:
        from ..jobs.status import notice_cause, told_cause  # lazy: +10 ms to every node's launcher start

        me = _own_record(slurm, job_id)
        cause = notice_cause(me, jobdir.events(), run, time.time(), grace + NOTICE_MARGIN)
        if me is None or "target_size" in cause:
            return cause, None

        def told_later() -> dict | None:
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                time.sleep(CAUSE_POLL)
                with contextlib.suppress(SlurmError):
                    now = _own_record(slurm, job_id)
                    told = told_cause(now, me.start_time) if now is not None else None
                    if told is not None:
                        return told
            return None

        return cause, told_later

    return answer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m slurm_hai.runtime.launcher")
    ap.add_argument("--job-dir", required=True)
    ap.add_argument("--grace", type=float, default=5.0)
    ap.add_argument("--notice-signal", choices=NOTICE_SIGNALS, default="USR2")  # USR2: scripts older than the option
    ap.add_argument("--term-is-notice", action="store_true")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("no command given after --")
    notices = notice_signals(args.notice_signal, args.term_is_notice)
    slurm = backend()
    env = dict(os.environ)
    env.update(node_contract(env))
    env["HAI_JOB_DIR"] = args.job_dir
    rank, run = int(env["RANK"]), int(env["HAI_RESTART_COUNT"])
    job_id = env.get("SLURM_JOB_ID", "0")
    jobdir = JobDir(args.job_dir)
    try:
        flag = flag_path(job_id, run) if rank == 0 else None
    except OSError as e:
        return could_not_start(jobdir, run, rank, f"no node-local directory for the suspend flag: {e}")
    try:
        memory = node_memory_dir(jobdir, job_id)
    except OSError as e:
        return could_not_start(jobdir, run, rank, f"no directory in node memory: {e}")
    if memory is not None:
        env["HAI_NODE_MEMORY"] = str(memory)
    node = NodeRun(cmd, env, jobdir, run, rank, args.grace, notices, flag=flag,
                   why_notice=lambda: _why_notice(slurm, int(job_id), jobdir, run, args.grace),
                   notice_lost=lambda: _notice_lost(slurm, int(job_id), args.grace))
    node.start()
    rc = node.wait()
    if node.left or node.forced or jobdir.suspended(run) is not None:
        # the run ends by a suspend (go_suspend() asked through the flag on rank 0's node, or
        # another node's command left, or failed as its peers left; or forced): exit 0, every
        # node alike (protocol.LEAVE_SIGNAL)
        if not node.forced:
            node.leave()
        return 0
    if rc == 0 and node.noticed_at is None and memory is not None and not any(memory.glob("parts/*")):
        # The job is done: no restart will read it. A suspend checkpoint there (parts/) may
        # still be on its way to the durable directory: the node's persist agent removes the
        # directory once Slurm says the job ended and nothing of it waits to be persisted.
        shutil.rmtree(memory, ignore_errors=True)
    # The run is over. A notice now has nothing left to suspend, and must not kill the
    # launcher as it leaves: Python's teardown resets handled signals to SIG_DFL, which would
    # turn a finished run into exit 140 (seen on 26.05). Ignored ones stay ignored.
    for sig in notices:
        signal.signal(sig, signal.SIG_IGN)
    return rc


if __name__ == "__main__":
    sys.exit(main())
