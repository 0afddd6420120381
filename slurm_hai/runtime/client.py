"""The in-job HAI client API: the suspend protocol and the whole-life state.

    receive_suspend_command() -> bool   poll every step; True once a suspend notice arrived
                                        (only in processes on the rank-0 node)
    target_size() -> int | None         after a notice: the node count of the next run
    go_suspend()                        commit done: end this run (the batch script requeues
                                        the job); never returns
    get_whole_life_state() -> int       one integer kept across restarts
    set_whole_life_state(int)
    restart_count() -> int              0 on the first run, then 1, 2, ...

Imports only the standard library (no torch, click or jinja2): training code imports it.
The launcher on the rank-0 node owns a one-byte flag file (HAI_SUSPEND_FLAG, node-local,
private to the job's user); it writes b"1" when the notice arrives. The client maps it
once and then reads one byte per call, well under a microsecond.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import sys
import time
from typing import Literal

from ..policy import contract

__all__ = ["receive_suspend_command", "target_size", "go_suspend", "get_whole_life_state", "set_whole_life_state",
           "restart_count"]

_flag: mmap.mmap | Literal[False] | None = None  # None: not opened yet; False: no flag on this node
# The flag's byte: b"1" once the notice came; b"2" once go_suspend() asked the launcher to end
# the step (the batch script then requeues the job).
FLAG_NOTICE, FLAG_LEAVE = 49, 50
# runtime/protocol.py's NOTICE and NOTICE_CAUSE, the events that carry a notice's target size
# (named, not imported: its enum and dataclasses cost the client's import 15 ms)
NOTICE_EVENTS = ("notice", "notice_cause")


def polled_marker(flag: str) -> str:
    """Under `hai run-local`: the file the job's first receive_suspend_command() creates."""
    return flag + ".polled"


def _open_flag() -> mmap.mmap | Literal[False]:
    path = os.environ.get("HAI_SUSPEND_FLAG")
    if not path:
        return False
    if os.environ.get("HAI_SIMULATE"):
        # `hai run-local` counts --suspend-after from here, where the job runs its loop:
        # counted from its start, the notice would come while it still imports torch.
        with contextlib.suppress(OSError):
            os.close(os.open(polled_marker(path), os.O_WRONLY | os.O_CREAT, 0o600))
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        return mmap.mmap(fd, 1, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return False
    finally:
        os.close(fd)


def receive_suspend_command() -> bool:
    global _flag
    if _flag is None:
        _flag = _open_flag()
    return _flag is not False and _flag[0] in (FLAG_NOTICE, FLAG_LEAVE)


def target_size(timeout: float = 2.0) -> int | None:
    """After a suspend notice, the node count the job's next run expects: smaller than now
    when an elastic job shrinks (it gives a higher job the nodes it needs and runs again
    beside it), larger when it grows into idle nodes, 0 when it is suspended whole and waits.
    None without a notice. The launcher journals the notice with what the job's Slurm record
    says; of a preemption by Slurm, the policy daemon's word (the job it gives way to, the
    size) may come a moment later. This waits up to `timeout` seconds for the size: 0 when
    the notice came and no size by then (no policy daemon: the job is suspended whole), None
    when no notice was journalled by then."""
    if not receive_suspend_command():
        return None
    jobdir, run = _job_dir(), restart_count()
    deadline = time.monotonic() + timeout
    while True:
        told = [e for e in jobdir.events() if e.get("event") in NOTICE_EVENTS and e.get("run") == run]
        sized = [e for e in told if "target_size" in e]
        if sized:
            return int(sized[-1]["target_size"])
        if time.monotonic() >= deadline:
            return 0 if told else None
        time.sleep(0.05)


def _job_dir():
    from ..jobs.jobdir import JobDir  # lazy: +6 ms to a training script's import of the client

    path = os.environ.get("HAI_JOB_DIR")
    if not path:
        raise RuntimeError("HAI_JOB_DIR is not set: run the script with hai-submit or `hai run-local`")
    return JobDir(path)


def restart_count() -> int:
    return contract.restart_count(os.environ)


def get_whole_life_state() -> int:
    return _job_dir().whole_life_state()


def set_whole_life_state(value: int) -> None:
    _job_dir().set_whole_life_state(int(value))


def go_suspend() -> None:
    """Tell the scheduler this job may be interrupted now: the job's step ends and the batch
    script requeues the job; this call does not return. Any rank on any node may call it.

    It asks Slurm nothing: the batch script alone requeues a run (runtime/protocol.py), so a
    job whose training runs where no Slurm command is (pyxis/enroot, Apptainer) suspends as
    any other. On rank 0's node it asks the launcher to end the step (the suspend flag) and
    waits to be ended; elsewhere it leaves, exit 0, and its launcher ends the step."""
    jobdir = _job_dir()
    run = restart_count()
    if jobdir.suspended(run) is None:
        # journalled before the marker: a launcher that sees the marker ends this process at once
        jobdir.event("go_suspend", run=run, host=os.uname().nodename, pid=os.getpid())
        jobdir.mark_suspend(run, "go_suspend")
    sys.stdout.flush()
    sys.stderr.flush()
    if not _ask_the_launcher_to_end_the_step():
        os._exit(0)
    # The launcher ends this process (SIGTERM, then SIGKILL 3 s later); under `hai run-local`
    # the simulator. A handler of the job's own (Lightning's) must not hold SIGTERM off.
    with contextlib.suppress(ValueError):  # not the main thread: the SIGKILL ends it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(600)
    os._exit(0)


def _ask_the_launcher_to_end_the_step() -> bool:
    """b"2" into the suspend flag, which only rank 0's node has: False where there is none."""
    path = os.environ.get("HAI_SUSPEND_FLAG")
    try:
        fd = os.open(path, os.O_WRONLY) if path else None
    except OSError:
        fd = None
    if fd is None:
        return False
    try:
        os.pwrite(fd, bytes([FLAG_LEAVE]), 0)
    finally:
        os.close(fd)
    return True
