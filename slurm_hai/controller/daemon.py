"""The policy daemon's loop (I/O): read the queue, decide (slurm_hai.policy.rules), act, log.

One leader at a time: the daemon holds an exclusive lock (flock) on a lock file for as
long as it runs (a file a user planted at its path is refused: LeaderLock); a second one exits with a message, or waits as a standby (`wait_for_lock`).
The lock lives in Slurm's StateSaveLocation by default, which a site with a backup
slurmctld shares between its controller hosts: daemons on both hosts see one lock.
A Slurm that does not answer (slurmctld restarting) is logged and retried with back-off;
one action that fails is logged and the cycle goes on. The policy file is re-read when it
changes (a broken edit is logged and the previous policy kept). With `metrics`
(controller/metrics.py, `--metrics-port`) each cycle also updates the Prometheus series; with
`why` (controller/why.py, the policy's `[daemon] service`) each read of the queue is what the
daemon answers when a command asks why a job waits.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from ..policy.elastic import IdleHistory
from ..policy.job import Job
from ..policy.model import Policy, PolicyError, load_policy
from ..policy.rules import Action, decide, needs_idle_nodes, restart_look_at, start_now_candidates
from ..slurm import Backend, SlurmError
from ..slurm.records import JobInfo

if TYPE_CHECKING:  # the metrics need prometheus_client, an extra: imported only when asked for
    from .metrics import DaemonMetrics
    from .why import WhyService

log = logging.getLogger("hai-policyd")

LOCK_NAME = "hai-policyd.lock"
# The longest wait between two tries while Slurm does not answer: a daemon that waited a minute
# would leave requeued jobs and forced suspends that long after slurmctld is back (issue 34:
# cut off for 60 s, it looked again 60 s late); one squeue every 10 s costs slurmctld nothing.
MAX_BACKOFF = 10.0
# An action that failed is not tried again for this long (e.g. requeue of a job Slurm purged).
RETRY_AFTER = 30.0
# A cycle longer than this is logged as a warning (squeue waits while slurmctld restarts).
SLOW_CYCLE = 10.0
# The daemon cycles this often while a cycle costs at most MAX_DUTY of the time between two,
# and never less often than its interval: a small queue is looked at twice a second (a
# requeued job waits for the daemon to see it; issue 32), a big one as the interval allows.
# (0.25 s was measured too: on the 2-core test host its load slowed the preempted job's exit.)
FAST_INTERVAL = 0.5
MAX_DUTY = 0.1
# A standby tries the lock this often (a new leader acts this much after the old one is gone).
STANDBY_POLL = 0.1


class LockBusy(Exception):
    """Another daemon holds the lock."""


def shared_array_ids(jobs: Sequence[JobInfo]) -> set[int]:
    """The ids of the job arrays of which the queue has a task with an id of its own: a job
    whose own id is one of them holds its array's id, which names every task to Slurm."""
    return {j.array_job_id for j in jobs if j.array_job_id != j.job_id}


@dataclass
class CycleResult:
    jobs: int
    actions: list[Action]
    failed: int
    seconds: float
    look_at: float | None = None  # when a requeued job's start will need a look (rules.restart_look_at)


class PolicyDaemon:
    def __init__(self, backend: Backend, policy: Policy | None = None, policy_path: str | Path | None = None,
                 interval: float = 2.0, dry_run: bool = False, clock: Callable[[], float] = time.time,
                 metrics: DaemonMetrics | None = None, why: WhyService | None = None) -> None:
        if policy is None and policy_path is None:
            raise ValueError("a policy or a policy file is needed")
        self.backend = backend
        self.policy_path = Path(policy_path) if policy_path else None
        if policy is None:
            assert self.policy_path is not None  # checked above (an empty path is a caller's bug)
            policy = load_policy(self.policy_path)
        self.policy = policy
        self._mtime = self._policy_mtime()
        self.interval = interval
        self.dry_run = dry_run
        self.clock = clock
        self._failed: dict[tuple[int, str, int], float] = {}
        # The first cycle replays what a killed predecessor may have left half done
        # (policy.rules.decide: the notice of a yield in flight).
        self._replay = True
        self.metrics = metrics
        self.why = why
        self.idle_history = IdleHistory()  # which nodes stayed idle how long (elastic jobs grow into them)
        # (job, restart count) -> how that run's predecessor ended, by slurmdbd (rules.may_start_now)
        self._run_ends: dict[tuple[int, int], str] = {}

    # ------------------------------------------------------------ one cycle

    def _policy_mtime(self) -> float | None:
        try:
            return self.policy_path.stat().st_mtime if self.policy_path else None
        except OSError:
            return None

    def reload_if_changed(self) -> None:
        mtime = self._policy_mtime()
        if mtime is None or mtime == self._mtime:
            return
        self._mtime = mtime
        assert self.policy_path is not None  # the mtime is its file's
        try:
            self.policy = load_policy(self.policy_path)
        except PolicyError as e:
            log.error("policy not reloaded, keeping the previous one: %s", e)
            return
        log.info("policy reloaded from %s", self.policy_path)

    def cycle(self) -> CycleResult:
        """Read the queue, decide, act. Raises SlurmError when the queue cannot be read."""
        t0 = time.monotonic()
        self.reload_if_changed()
        # A record the backend cannot read is logged and left out by the backend; output
        # that is not Slurm's JSON at all raises SlurmError (RecordError), as Slurm down does.
        jobs = self.backend.jobs()
        now = self.clock()
        idle = self.backend.idle_nodes() if needs_idle_nodes(jobs, self.policy, now) else None
        steady = None
        if idle is None or self.policy.grow_after_seconds is None:
            self.idle_history.forget()
        else:
            self.idle_history.record(now, idle)
            steady = self.idle_history.steady(now, self.policy.grow_after_seconds)
        actions, run_ends = self._decide(jobs, now, idle, steady)
        if idle is not None and any(a.kind == "signal" and a.rule == "yield" for a in actions):
            # The idle nodes were read after the queue: a job Slurm started in between is
            # waiting in `jobs` and its nodes are busy in `idle`, and a job would give way for
            # nothing (seen on 25.11: a job array's task). A yield is decided on a queue read
            # after the idle nodes.
            jobs, now = self.backend.jobs(), self.clock()
            actions, run_ends = self._decide(jobs, now, idle, steady)
        if self.why is not None:
            self.why.seen(jobs, self.policy, now)
        self._replay = False
        failed = 0
        shared = shared_array_ids(jobs)
        # a failed action waits RETRY_AFTER, for that run of its job: a job requeued since has
        # a run of its own (a start-now that failed as its job started, a race, held up the
        # next requeue's start-now for 30 s)
        runs = {j.job_id: j.restart_count for j in jobs}
        for action in actions:
            key = (action.job_id, action.rule, runs.get(action.job_id, 0))
            if self._failed.get(key, 0) > now:
                continue
            if self.dry_run:
                log.info("would: %s", action.describe())
                continue
            try:
                self.execute(action, self.target(action.job_id, shared))
            except SlurmError as e:
                failed += 1
                self._failed[key] = now + RETRY_AFTER
                log.error("job %s: %s failed [%s]: %s", action.job_id, action.kind, action.rule, e)
            else:
                log.info("%s", action.describe())
        self._failed = {k: t for k, t in self._failed.items() if t > now}
        result = CycleResult(len(jobs), actions, failed, time.monotonic() - t0,
                             restart_look_at(jobs, now, run_ends))
        if self.metrics is not None:  # after the actions, so they never wait for it
            self.metrics.observe_cycle(jobs, result.seconds, failed)
        return result

    def _decide(self, jobs: Sequence[JobInfo], now: float, idle: Mapping[str, int] | None,
                steady: Mapping[str, int] | None) -> tuple[list[Action], dict[int, str]]:
        """The policy's actions on this queue, and how its held-back jobs' last runs ended."""
        run_ends = self.run_ends(jobs, now)
        return decide(jobs, self.policy, now, idle_nodes=idle, steady_idle=steady, replay=self._replay,
                      run_ends=run_ends), run_ends

    def run_ends(self, jobs: Sequence[Job], now: float) -> dict[int, str]:
        """How the last run of each requeued job that Slurm holds back ended (slurmdbd), asked
        once per run: a run not yet recorded as ended, or slurmdbd not answering, is asked
        again next cycle (until then the job waits, as Slurm's delay has it)."""
        held = {j.job_id: j.restart_count for j in start_now_candidates(jobs, now)}
        self._run_ends = {k: v for k, v in self._run_ends.items() if held.get(k[0]) == k[1]}
        ask = [jid for jid, run in held.items() if (jid, run) not in self._run_ends]
        if ask:
            try:
                for jid, state in self.backend.last_run_ends(ask).items():
                    self._run_ends[(jid, held[jid])] = state
            except SlurmError as e:
                log.warning("how the last run of job(s) %s ended is not known (%s); they wait for Slurm's "
                            "requeue delay", ",".join(map(str, ask)), e)
        return {jid: state for (jid, _), state in self._run_ends.items()}

    def target(self, job_id: int, shared: set[int]) -> int | str:
        """How to name job `job_id` to Slurm: by its id, unless it holds the id of a job array
        of which the queue has other tasks (`shared`: the task that started last keeps the
        array's id, as does the array's pending rest): Slurm acts on every task of an array
        named by that id (an update of one part's start went to every part; a requeue would
        take them all), so such a job is named as ARRAY_TASK (or ARRAY_[TASKS]), asked of Slurm."""
        if job_id in shared:
            return self.backend.array_task(job_id) or job_id
        return job_id

    def execute(self, action: Action, target: int | str | None = None) -> None:
        """Do `action` to its job, named to Slurm as `target` (default: its id)."""
        b, jid = self.backend, action.job_id if target is None else target
        if action.kind == "update":
            b.update_job(jid, **action.field_dict())
        elif action.kind == "requeue":
            b.requeue(jid)
        elif action.kind == "release":
            b.release(jid)
        elif action.kind == "hold":
            b.update_job(jid, Priority="0")
        elif action.kind == "signal":
            b.cancel(jid, signal=action.field_dict()["signal"])
        else:  # pragma: no cover - decide() makes no other kind
            raise SlurmError(f"unknown action {action.kind}")

    # ------------------------------------------------------------ the loop

    def run(self, once: bool = False, stop: threading.Event | None = None) -> int:
        """Cycle until `stop` is set (or once). Returns 0, or 1 if a single cycle failed or
        one of its actions did."""
        stop = stop or threading.Event()
        backoff = self.interval
        log.info("policy daemon started: policy %s, interval %.1f s%s", self.policy_path or self.policy.source,
                 self.interval, ", dry run" if self.dry_run else "")
        while True:
            try:
                result = self.cycle()
            except SlurmError as e:
                if self.metrics is not None:
                    self.metrics.cycle_failed()
                if once:
                    log.error("cycle failed: %s", e)
                    return 1
                backoff = min(MAX_BACKOFF, backoff * 2)
                log.warning("Slurm did not answer (%s); retrying in %.0f s", e, backoff)
                if stop.wait(backoff):
                    break
                continue
            if backoff != self.interval:
                log.info("Slurm answers again")
                backoff = self.interval
            log.log(logging.WARNING if result.seconds > SLOW_CYCLE else logging.DEBUG,
                    "cycle: %d jobs, %d actions, %d failed, %.1f s%s", result.jobs, len(result.actions),
                    result.failed, result.seconds,
                    " (slow: slurmctld busy or restarting?)" if result.seconds > SLOW_CYCLE else "")
            if once:
                return 1 if result.failed else 0
            if stop.wait(self.pause(result.seconds, result.look_at)):
                break
        return 0

    def pause(self, cycle_seconds: float, look_at: float | None = None) -> float:
        """Seconds until the next cycle (FAST_INTERVAL, MAX_DUTY), at most the interval; no
        later than `look_at` (the daemon's clock), when a requeued job's start needs a look."""
        pause = min(self.interval, max(FAST_INTERVAL, cycle_seconds * (1 - MAX_DUTY) / MAX_DUTY))
        return pause if look_at is None else max(0.0, min(pause, look_at - self.clock()))


def shared_lock_path(backend: Backend, stop: threading.Event) -> Path:
    """The default lock: `<StateSaveLocation>/hai-policyd.lock`, beside slurmctld's own state.
    A site with a backup slurmctld shares that directory between its controller hosts
    already (Slurm's HA requires it), so daemons beside each controller contend for one
    lock, whatever their local directories. Waits for Slurm to answer (with back-off):
    without it there is nothing to lead."""
    wait = 1.0
    while True:
        try:
            state = backend.config().get("StateSaveLocation", "")
        except SlurmError as e:
            log.warning("Slurm did not answer (%s); asking for StateSaveLocation again in %.0f s", e, wait)
        else:
            if not state:
                raise LockBusy("Slurm names no StateSaveLocation; pass --lock FILE on a file system both "
                               "controller hosts share")
            return Path(state) / LOCK_NAME
        if stop.wait(wait):
            raise LockBusy("stopped while waiting for Slurm")
        wait = min(MAX_BACKOFF, wait * 2)


class LeaderLock:
    """An exclusive flock on the lock file, opened without following a link nor blocking, and
    only when it is this daemon's: a regular file of root's or of the daemon's own user, in a
    directory no group or other user can write (users cannot put anything there; the default,
    Slurm's StateSaveLocation, is the SlurmUser's). Anything else at the path is refused in
    one line (LockBusy) and the daemon does not start: it never acts on a file a user planted."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def _open(self) -> int:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            parent = os.stat(self.path.parent)
        except OSError as e:
            raise LockBusy(f"cannot use the lock {self.path}: {e.strerror}") from None
        if parent.st_mode & 0o022:
            raise LockBusy(f"{self.path.parent} is writable by others than its owner, who could put anything "
                           "at the lock's path: pass --lock FILE in a directory only root or the SlurmUser can write")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise LockBusy(f"{self.path} is not this daemon's lock ({e.strerror}: a link?); remove it, "
                           "or pass --lock FILE elsewhere") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid()) or st.st_nlink != 1:
            os.close(fd)
            raise LockBusy(f"{self.path} is not this daemon's lock (not a regular file of root's or uid "
                           f"{os.geteuid()}'s, or a hard link); remove it, or pass --lock FILE elsewhere")
        return fd

    def try_take(self) -> bool:
        """Take the lock if it is free (LockBusy when the path is not the daemon's)."""
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            taken = os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino
        except OSError:
            taken = False  # held by another daemon; or removed, or replaced, since it was opened
        if not taken:
            os.close(fd)
            return False
        self._fd = fd
        return True

    @property
    def is_locked(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # lets go of the flock
            self._fd = None


def leader_lock(path: str | Path, wait: bool = False, stop: threading.Event | None = None) -> LeaderLock:
    """Take the daemon's lock (the caller releases it). Raises LockBusy when another daemon
    holds it and `wait` is false, or when the path is not the daemon's (LeaderLock); with
    `wait`, stands by until it is free (or `stop`)."""
    path = Path(path)
    lock = LeaderLock(path)
    if lock.try_take():
        return lock
    if not wait:
        raise LockBusy(f"another hai-admin daemon holds {path} (pid in {path}.pid); "
                       "stop it first, or pass --wait-for-lock to stand by")
    log.info("another daemon holds %s; standing by", path)
    stop = stop or threading.Event()
    while not stop.wait(STANDBY_POLL):
        if lock.try_take():
            log.info("took over the lock %s", path)
            return lock
    raise LockBusy(f"stopped while waiting for {path}")


def write_pid(lock_path: str | Path) -> Path:
    """The daemon's pid beside its lock, for an admin; opened as the lock is (no link, no FIFO,
    a regular file of the daemon's own), else left unwritten with one line in the log."""
    pid_file = Path(f"{lock_path}.pid")
    try:
        fd = os.open(pid_file, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        log.warning("pid not written to %s: %s (remove what is there)", pid_file, e.strerror)
        return pid_file
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid in (0, os.geteuid()) and st.st_nlink == 1:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        else:
            log.warning("pid not written to %s: not a regular file of the daemon's (remove it)", pid_file)
    except OSError as e:
        log.warning("pid not written to %s: %s", pid_file, e.strerror)
    finally:
        os.close(fd)
    return pid_file
