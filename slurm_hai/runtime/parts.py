"""A part of an elastic job in place (issue 31; docs/elastic-in-place.md): one node's worth of
training, a torchft replica group that can leave and rejoin while the other parts train on.

    part = join(state_dict=save, load_state_dict=load,   # the job's lighthouse, this part's Manager
                checkpoint_dir=DIR)                      # the job's durable checkpoints (optional)
    opt = OptimizerWrapper(part.manager, optimizer)
    while part.manager.current_step() < steps:
        opt.zero_grad()                                  # this step's quorum
        share = part.share(batch_size)                   # this part's rows of the global batch
        if share is not None:
            (loss_fn(model(x[share]), y[share]).sum() / batch_size).backward()
        part.sum_gradients(model.parameters())           # over the quorum: the global batch's mean
        opt.step()                                       # commits only if the whole quorum did
        part.save_every(100)                             # one part commits the job's state

The global batch stays the same at every size: at each step the parts in the quorum split
it by their participating rank, so the samples of a step, and their sum, are those of an
uninterrupted run whatever the size (up to the order of a floating-point sum). A part that
is healing this step (it copies a live peer's state) computes nothing and gets the sum.

The parts start from the same state: the job seeds its initialization (or loads one
checkpoint), and the first step checks it (StartedApart). torchft's own start, in which
every part but one copies that one's state in step 0 (`init_sync`), is off: the parts that
copy are counted among the step's participants but compute nothing, so step 0 would sum
part of its batch. A part dies of the notice at once, wherever it is: a step that it
leaves half done is not committed by the others, and they take it again without it.

No part trains below the job's MIN (HAI_PARTS_MIN): a quorum needs MIN parts. The first
parts to start wait for MIN (the job starts as MIN parts together), for as long as the
quorum timeout. Parts that trained and then wait for a quorum ask Slurm how many of the
job's parts it runs; when a higher level took the others' nodes and fewer than MIN run, they
commit the job's state and leave at once (`Part.below_min`, exit EXIT_BELOW_MIN), or after
the quorum timeout when Slurm cannot be asked: their tasks are requeued, and the job waits
in the queue as a job suspended whole does, and resumes from that commit.

A part that joins a live job copies a peer's state and loads nothing. With `checkpoint_dir`,
one part (participating rank 0) commits the job's state there every N committed steps
(`save_every`, slurm_hai.checkpoint: verified, atomic), and a job that comes back with no
live part (its lighthouse was lost, and every part was requeued) resumes from the newest
commit: at the first step of a quorum in which every part is at step 0, each part loads it.

torch and torchft load here, in the job's process; the lighthouse comes from the site's
lighthouse service (`hai-admin lighthouse`, HAI_LIGHTHOUSE_SERVICE) for the job's id.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterable, NoReturn

from ..slurm import SlurmError, backend, munge_socket

SERVICE_ENV = "HAI_LIGHTHOUSE_SERVICE"
MIN_ENV = "HAI_PARTS_MIN"  # the job's MIN: the fewest parts that train (hai-submit -n MIN:MAX)
JOBS_PATH = "/v1/jobs/"  # the lighthouse service's: GET /v1/jobs/<job id>?min=<MIN>
# An ask proves its user with a MUNGE credential, as Slurm does across nodes:
# `Authorization: Munge <credential>`, the credential's payload the request's target
AUTH_SCHEME = "Munge"
MUNGE_SECONDS = 10.0
# a step's collectives; a quorum waits for every part that still heartbeats (torchft's default)
STEP_TIMEOUT = timedelta(seconds=30)
# How long a part waits for a quorum of MIN parts: then it leaves with EXIT_BELOW_MIN
QUORUM_TIMEOUT = timedelta(seconds=60)
# A part that found fewer than MIN parts exits so (EX_TEMPFAIL): its task is requeued
# (runtime/part_task.py), and the job waits in the queue for MIN nodes
EXIT_BELOW_MIN = 75
# A part whose lighthouse cannot be reached exits so (EX_UNAVAILABLE): its task is requeued,
# and the job comes back under a new lighthouse
EXIT_LIGHTHOUSE_LOST = 69
# A part whose task reaches its time limit (hai-submit --time) exits so, after committing the
# job's state: its task is requeued with a whole time limit ahead, and the part rejoins
EXIT_TIME_LIMIT = 76
# When to: its task's script (runtime/part_task.py) sets this in the part's environment, the
# time (seconds since the epoch) the notice time (grace + NOTICE_MARGIN) before its task's
# limit, and the part leaves at its first step after it (Part.share). A time, not a signal:
# a part learns it however late its step starts, and nothing can come before the part is
# ready for it (a notice signal could, and would find no step yet or kill a part still
# starting). Not Slurm's --signal either: with preempt_send_user_signal Slurm sends that at
# preemption too, where a part leaves at once.
LEAVE_AT_ENV = "HAI_PART_LEAVE_AT"
# A part that trained and has waited this long for a quorum looks whether its lighthouse can
# be reached and asks Slurm how many of the job's parts run, and again every WATCH_EVERY s
# while it waits. With MIN parts alive a quorum forms within about a second (the
# lighthouse's heartbeat timeout and tick); a part that is starting runs in Slurm already,
# so the parts wait for it instead of leaving.
WATCH_AFTER = 2.0
WATCH_EVERY = 1.0
# Slurm's states of a task whose part runs or is starting
RUNNING_STATES = frozenset({"RUNNING", "CONFIGURING"})
# torchft's own chatter stays out of a part's log; its warnings and errors stay in. Its Rust
# core writes INFO lines for every quorum and commit to stderr, at the level RUST_LOG names,
# read once as torchft is imported (torchft 0.2.0 takes a level, not a filter: `torchft=warn`
# changes nothing). The part's task gives the part's step this level unless the job's
# environment names one (part_task.py), as the lighthouse service gives its lighthouses
# (controller/lighthouse.py). Its Python side logs through these loggers: join() raises them
# to WARNING.
TORCHFT_RUST_LOG = "warn"
TORCHFT_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")


class PartError(RuntimeError):
    """The part cannot join its job; the message says what is missing."""


class StartedApart(PartError):
    """The parts of step 0 hold different states."""


def _quiet_torchft() -> None:
    """torchft's Python loggers at WARNING, and without its warning that it cannot reset
    NCCL's flight recorder: a part's process group is gloo's, and a CPU build of torch (no
    NCCL) would log it at every new quorum."""
    for name in TORCHFT_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("torchft.manager").addFilter(_not_about_nccl)  # added once, however often called


def _not_about_nccl(record: logging.LogRecord) -> bool:
    return "NCCL flight recorder" not in record.getMessage()


def batch_share(batch_size: int, rank: int, participants: int) -> slice:
    """Rows [start, stop) of a global batch of `batch_size` rows that participating part
    `rank` of `participants` computes: contiguous, sizes differing by at most one, together
    the whole batch in order."""
    if not 0 <= rank < participants:
        raise ValueError(f"rank {rank} is not one of {participants} participants")
    base, extra = divmod(batch_size, participants)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def job_and_part(env: dict[str, str] | os._Environ = os.environ) -> tuple[int, int]:
    """(the job's id, this part's index): the array's id and the task's, as Slurm sets them."""
    try:
        return int(env["SLURM_ARRAY_JOB_ID"]), int(env["SLURM_ARRAY_TASK_ID"])
    except (KeyError, ValueError):
        raise PartError("a part runs as a task of a Slurm job array (SLURM_ARRAY_JOB_ID, SLURM_ARRAY_TASK_ID)") \
            from None


def min_parts(env: dict[str, str] | os._Environ = os.environ) -> int:
    """The job's MIN (HAI_PARTS_MIN, which its batch script sets; 1 if unset)."""
    value = env.get(MIN_ENV, "1")
    if not value.isdigit() or int(value) < 1:
        raise PartError(f"{MIN_ENV}={value!r}: the fewest parts that train, a whole number of at least 1")
    return int(value)


def running_parts(job: int, own: int) -> int | None:
    """How many of `job`'s parts (its array's tasks) Slurm runs, as squeue says; None when
    that cannot be told: Slurm cannot be asked, or its answer does not have the asking part's
    own task (`own`, its SLURM_JOB_ID) running."""
    try:
        tasks = backend().jobs([job])
    except (SlurmError, OSError):
        return None
    running = {t.job_id for t in tasks if t.array_job_id == job and t.state in RUNNING_STATES}
    return len(running) if own in running else None


def reachable(address: str, timeout: float = 1.0) -> bool:
    """Whether a lighthouse at `address` (http://host:port) takes a TCP connection."""
    url = urllib.parse.urlsplit(address)
    try:
        with socket.create_connection((url.hostname, url.port), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def leave_on(signum: int = signal.SIGTERM) -> None:
    """At the notice, leave: die of the signal at once, as Slurm expects of a preempted task
    (a part that exits 0 ends its task COMPLETED, and nothing requeues it), in the middle of
    a collective if it is in one. Undoes a handler that a library installed. (Near its task's
    time limit the part leaves at a step instead, once it has committed the job's state:
    Part.leave_at.)"""
    signal.signal(signum, signal.SIG_DFL)


@dataclass
class Part:
    job: int
    index: int
    manager: Any  # torchft.Manager
    store: Any  # its TCPStore, which lives as long as the Manager
    pg: Any = None  # the Manager's torchft ProcessGroupGloo
    checkpoints: Any = None  # slurm_hai.checkpoint.CheckpointManager of the job's checkpoint_dir
    load_state_dict: Callable[[Any], None] | None = None
    state_dict: Callable[[], Any] | None = None
    resumed_at: int | None = None  # the step this part resumed from a checkpoint at, if it did
    min_parts: int = 1
    quorum_timeout: timedelta = QUORUM_TIMEOUT
    lighthouse: str = ""  # the address of the job's lighthouse (http://host:port)
    # how many of the job's parts Slurm runs (None: it cannot tell); None: never asked
    running: Callable[[], int | None] | None = None
    # leave at the first step from this time on (LEAVE_AT_ENV; infinite: its task has no limit)
    leave_at: float = math.inf
    _first: bool = True
    _saved: int = 0  # the step it committed last
    # Between the main thread, which waits for quorums, and the thread that asks Slurm while
    # it waits: when a wait began (None: not waiting), and whether one of them is leaving.
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _waiting_since: float | None = None
    _leaving: bool = False
    _watcher: threading.Thread | None = None

    def share(self, batch_size: int) -> slice | None:
        """This part's rows of the global batch at the current step; None while it heals. At
        this process's first step, after the quorum: if every part of it is at step 0 (none
        was ahead to heal from) and the job has a checkpoint, it resumes from the newest.
        Fewer than MIN parts: the part leaves (below_min)."""
        rank = self._quorum_rank()
        if time.time() >= self.leave_at:
            self.time_limit(healing=rank is None or not self.manager.is_participating())
        if rank is None or not self.manager.is_participating():
            self._first = False
            return None
        if self._first:
            self._first = False
            self._resume()
        return batch_share(batch_size, rank, self.manager.num_participants())

    def _quorum_rank(self) -> int | None:
        """Wait for this step's quorum; this part's participating rank in it. Once the part
        has been in a quorum, a thread watches while it waits (_watch): its lighthouse gone,
        or fewer than MIN parts running, and it leaves at once. No quorum within the quorum
        timeout: it leaves too."""
        if not self._first:
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name="hai-part-watch", daemon=True)
                self._watcher.start()
            with self._lock:
                self._waiting_since = time.monotonic()
        try:
            return self.manager.participating_rank()
        except TimeoutError:
            if not reachable(self.lighthouse):
                self.lighthouse_lost()
            self.below_min(f"for {self.quorum_timeout.total_seconds():.0f} s")
            raise  # not reached: either leaves the process
        finally:
            with self._lock:
                self._waiting_since = None
                leaving = self._leaving
            if leaving:
                threading.Event().wait()  # the watcher commits and ends the process

    def _watch(self) -> None:
        """While the main thread has waited WATCH_AFTER s for a quorum, look every WATCH_EVERY
        s: the lighthouse cannot be reached (it died; the lighthouse service, which would
        hand out a new one, may be away too), or Slurm runs fewer than MIN of the job's parts:
        leave. The state committed then is the last committed step's: the main thread waits
        in the quorum, after zero_grad, and does not go on while this thread leaves."""
        while True:
            time.sleep(WATCH_EVERY)
            with self._lock:
                since = self._waiting_since
            if since is None or time.monotonic() - since < WATCH_AFTER:
                continue
            if not reachable(self.lighthouse):
                self.lighthouse_lost(while_waiting=True)
                continue
            running = self.running() if self.running is not None else None
            if running is not None and running < self.min_parts:
                self.below_min(f"(Slurm runs {running} of the job's parts)", while_waiting=True)

    def _resume(self) -> None:
        """Every participant of a step-0 quorum takes this path together: none is ahead, so
        none heals, and each loads the same newest commit (nothing commits while all are at
        step 0). The torchft step (the data position) comes back with the job's state."""
        if self.checkpoints is None or self.manager.current_step() != 0:
            return
        state = self.checkpoints.load()  # the newest that verifies; None: the job has none yet
        if state is None:
            return
        assert self.load_state_dict is not None  # join() sets both with the checkpoints
        self.load_state_dict(state["job"])
        self.manager.load_state_dict(state["torchft"])
        self.resumed_at = self.manager.current_step()

    def below_min(self, why: str, while_waiting: bool = False) -> None:
        """Fewer than MIN parts (`why` says how it was found): the job cannot train, and this
        part leaves (_leave) so that the job waits in the queue instead of holding nodes.
        Exits EXIT_BELOW_MIN; its task is requeued."""
        self._leave(EXIT_BELOW_MIN, f"fewer than {self.min_parts} parts {why}",
                    f"the job waits for {self.min_parts} nodes", while_waiting)

    def time_limit(self, healing: bool) -> None:
        """Its task reaches its time limit (past `leave_at`): leave now, at the start of
        a step, committing the job's last committed step (_leave), unless this part is healing
        in this step (its tensors are a peer's, its optimizer's state not yet: it has nothing
        to commit, and the peer lives). Exits EXIT_TIME_LIMIT; its task is requeued, and the
        part rejoins from a live peer, or, when every part left so, from that commit."""
        self._leave(EXIT_TIME_LIMIT, "its task reaches its time limit",
                    "its task is requeued with a whole time limit", False, commit=not healing)

    def lighthouse_lost(self, while_waiting: bool = False) -> None:
        """The job's lighthouse cannot be reached: no quorum can form under it, and this
        part leaves (_leave), as every part of the job does. Exits EXIT_LIGHTHOUSE_LOST; its
        task is requeued, and the job comes back under a new lighthouse, from the last commit."""
        self._leave(EXIT_LIGHTHOUSE_LOST, f"its lighthouse {self.lighthouse} cannot be reached",
                    "the job comes back under a new one", while_waiting)

    def _leave(self, code: int, why: str, then: str, while_waiting: bool, commit: bool = True) -> None:
        """Leave the job: with a checkpoint directory, first commit this part's state, the
        job's last committed step (every part that leaves holds the same one: the store
        keeps the first commit of a step), unless that step is committed already or is step
        0; then exit with `code`. The first of the part's threads to call it leaves (another
        then waits for that); `while_waiting`: only while the main thread still waits for its
        quorum (returns if the quorum came). A commit that fails is said, and it leaves all the
        same (a thread that died of it would leave the main thread waiting for it)."""
        with self._lock:
            if while_waiting and self._waiting_since is None:
                return
            leaving, self._leaving = self._leaving, True
        if leaving:
            threading.Event().wait()
        step = self.manager.current_step()
        saved = ""
        if commit and self.checkpoints is not None and step > 0 and step != self._saved:
            from ..checkpoint import CheckpointError  # lazy: +3 ms to the service

            try:
                if self._commit(step):
                    saved = f"; committed step {step}"
            except CheckpointError as e:  # it leaves all the same: the job resumes from an earlier commit
                saved = f"; step {step} could not be committed ({e})"
        print(f"slurm-hai: part {self.index} of job {self.job}: {why}{saved}; it leaves, and {then}",
              file=sys.stderr, flush=True)
        self.exit(code)  # as at its notice: no clean-up of torchft's threads to wait for

    def exit(self, code: int = 0) -> NoReturn:
        """End this part's process once its training is over and its results are written:
        output flushed, then out at once, without the interpreter's clean-up, in which
        torchft's and gloo's threads may abort the process ("terminate called without an
        active exception", exit 134: seen on 22.05 for one part of four, after its last
        step), and its task would read as a part that failed. Your own clean-up (atexit
        handlers) does not run: do it before."""
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def save_every(self, steps: int) -> bool:
        """After `opt.step()`: when the step committed and the job's committed steps are a
        multiple of `steps`, the part of participating rank 0 commits the job's state (the
        state_dict given to join, and torchft's step) to checkpoint_dir. Whether it saved."""
        step = self.manager.current_step()
        if (self.checkpoints is None or steps < 1 or step == 0 or step % steps or step == self._saved
                or not self.manager.is_participating() or self.manager.participating_rank() != 0):
            return False
        self._commit(step)
        return True

    def _commit(self, step: int) -> bool:
        """Commit the job's state (the state_dict given to join, and torchft's step: the data
        position) as `step`; False if that step was committed already (by another part)."""
        assert self.checkpoints is not None and self.state_dict is not None  # join() sets both
        handle = self.checkpoints.save(step, {"job": self.state_dict(), "torchft": self.manager.state_dict()})
        self._saved = step
        return not handle.skipped

    def sum_gradients(self, params: Iterable[Any]) -> None:
        """Sum the parameters' gradients over the quorum, in one allreduce of a flat buffer (a
        parameter without a gradient adds zeros). torchft's DistributedDataParallel hook
        crashed the parts that stayed when others left in the middle of an allreduce
        (docs/results-archive.md); an allreduce that fails here makes the step uncommitted."""
        import torch  # lazy: torch, an optional extra
        from torch.distributed import ReduceOp  # lazy: torch, an optional extra

        params = [p for p in params if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.manager.current_step() == 0:
            self._check_same_start(params)
        flat = torch.cat([p.grad.flatten() for p in params])
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored() is not None and self.pg is not None:
            # A peer left in the middle of the allreduce. This part's connections close now:
            # in gloo's ring a part that still waits on this one (not on the one that left)
            # would otherwise wait out the step timeout (30 s, seen on the cluster), and the
            # next quorum, which needs it, with it. The next quorum makes a new group.
            self.pg.abort()
        for p, summed in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(summed.view_as(p.grad))

    def _check_same_start(self, params: list[Any]) -> None:
        """Step 0: raise StartedApart unless every participant's parameters have the same
        fingerprint f, a weighted sum of them. One allreduce of three float64 numbers: the
        sums over the parts of f, of f squared and of 1, whose spread is 0 only if every f
        is the same (up to rounding: 1e-12 of f squared)."""
        import torch  # lazy: torch, an optional extra
        from torch.distributed import ReduceOp  # lazy: torch, an optional extra

        flat = torch.cat([p.detach().flatten().to(torch.float64) for p in params])
        f = float(flat @ torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64))
        sums = torch.tensor([f, f * f, 1.0], dtype=torch.float64)
        self.manager.allreduce(sums, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored() is not None or not self.manager.is_participating():
            return  # the step is not committed (or this part heals): checked when it is taken again
        s1, s2, n = sums.tolist()
        if n > 1 and abs(s2 * n - s1 * s1) > 1e-12 * max(s1 * s1, 1e-300):
            raise StartedApart(f"job {self.job}: the parts started from different weights; seed the model's "
                               "initialization (torch.manual_seed) or load one checkpoint in every part")


def munge_credential(payload: str) -> str:
    """A MUNGE credential of this process's user, carrying `payload` (`munge`, on Slurm's
    socket); PartError, one line, when MUNGE cannot make one."""
    sock = munge_socket()
    argv = ["munge", *(["--socket", sock] if sock else [])]
    try:
        p = subprocess.run(argv, input=payload, capture_output=True, text=True, timeout=MUNGE_SECONDS)
    except FileNotFoundError:
        raise PartError("the lighthouse service needs a MUNGE credential, and this node has no `munge`: "
                        "install munge (apt install munge), as Slurm's auth/munge has it") from None
    except subprocess.TimeoutExpired:
        raise PartError(f"munge made no credential in {MUNGE_SECONDS:g} s: is munged running on this node?") from None
    if p.returncode != 0:
        why = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1].removeprefix("munge: Error: ")
        raise PartError(f"munge: {why}")
    return p.stdout.strip()


def ask(service_url: str, job: int, min_parts: int = 1, timeout: float = 10.0) -> str:
    """A part's ask: the address of `job`'s lighthouse from the service at `service_url`
    (http://host:port), as this process's user, proven by a MUNGE credential. The first ask
    starts it: a quorum there needs `min_parts` parts. PartError, one line, when there is no
    answer (a service that refuses says why: not the job's owner, a replayed credential)."""
    target = f"{JOBS_PATH}{job}?min={min_parts}"
    url = f"{service_url.rstrip('/')}{target}"
    request = urllib.request.Request(url, headers={"Authorization": f"{AUTH_SCHEME} {munge_credential(target)}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return json.load(reply)["address"]
    except urllib.error.HTTPError as e:
        try:
            why = json.load(e).get("error", e.reason)
        except ValueError:
            why = e.reason
        raise PartError(f"{url}: {why}") from None
    except (urllib.error.URLError, OSError) as e:
        raise PartError(f"{url}: no lighthouse service there ({getattr(e, 'reason', e)})") from None


def leave_time(env: dict[str, str] | os._Environ = os.environ) -> float:
    """When the part leaves for its task's time limit (LEAVE_AT_ENV); infinite without one."""
    text = env.get(LEAVE_AT_ENV, "")
    try:
        return float(text) if text else math.inf
    except ValueError:
        raise PartError(f"{LEAVE_AT_ENV}={text!r}: expected seconds since the epoch") from None


def join(state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None], *,
         checkpoint_dir: str | os.PathLike[str] | None = None, service: str | None = None,
         quorum_timeout: timedelta = QUORUM_TIMEOUT, env: dict[str, str] | os._Environ = os.environ) -> Part:
    """This part's torchft Manager under its job's lighthouse (asked of the lighthouse
    service at `service`, default $HAI_LIGHTHOUSE_SERVICE), with a store of its own on this
    host. One process per part. `checkpoint_dir`: the job's durable checkpoints, on a file
    system every node sees (Part.save_every, and the resume in Part.share). A quorum needs
    the job's MIN parts (HAI_PARTS_MIN): the first parts of a job wait for MIN, a part that
    waits longer than `quorum_timeout` leaves, and so does one that trained when Slurm runs
    fewer than MIN of the job's parts (Part.below_min). A part that joins a live job heals
    from a peer over its process group, into its own tensors (runtime/heal.py): the state
    must hold tensors and plain values only (HealError, in one line, here)."""
    from torch.distributed import TCPStore  # lazy: torch, an optional extra
    from torchft import Manager, ProcessGroupGloo  # lazy: torchft, an optional extra (elastic)

    from .heal import PeerHeal, check_state  # lazy: torch, an optional extra

    job, index = job_and_part(env)
    least = min_parts(env)
    leave_at = leave_time(env)
    service = service or env.get(SERVICE_ENV)
    if not service:
        raise PartError(f"no lighthouse service: set {SERVICE_ENV}=http://HOST:PORT (hai-admin lighthouse)")
    check_state(state_dict())  # what a heal cannot carry stops the part here, in one line
    _quiet_torchft()
    lighthouse = ask(service, job, least)
    host = socket.gethostname()
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=STEP_TIMEOUT)
    # a heal copies a live peer's state over this group, into this part's own tensors
    heal = PeerHeal(pg, lambda: {"user": {"default": state_dict()}, "torchft": manager.state_dict()})
    manager = Manager(pg=pg, load_state_dict=load_state_dict,
                      state_dict=state_dict, min_replica_size=least, init_sync=False,
                      replica_id=f"{job}_{index}", checkpoint_transport=heal,
                      lighthouse_addr=lighthouse, store_addr=host, store_port=store.port, rank=0, world_size=1,
                      hostname=host, timeout=STEP_TIMEOUT, quorum_timeout=quorum_timeout)
    checkpoints = None
    if checkpoint_dir is not None:
        from ..checkpoint import CheckpointManager  # lazy: torch, an optional extra

        checkpoints = CheckpointManager(checkpoint_dir, keep_last=2)
    own = int(env.get("SLURM_JOB_ID") or 0)
    return Part(job, index, manager, store, pg, checkpoints, load_state_dict, state_dict, min_parts=least,
                quorum_timeout=quorum_timeout, lighthouse=lighthouse, running=lambda: running_parts(job, own),
                leave_at=leave_at)
