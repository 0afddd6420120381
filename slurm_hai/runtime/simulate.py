"""Local simulation of the suspend protocol (no Slurm): `hai run-local`.

Runs the command as a one-node job (RANK 0, WORLD_SIZE 1) through the same NodeRun as the
real launcher; `suspend_after` seconds after the command first calls receive_suspend_command()
(its loop runs by then: its imports do not count) the notice arrives; go_suspend() (or the
forced suspend after the grace) ends the run and the command starts again with the next
restart count, `restarts` times. Then the last run goes on to its end. A command that never
calls receive_suspend_command() gets no notice, and the output says so.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time
from pathlib import Path

from ..jobs.jobdir import JobDir
from .client import polled_marker
from ..policy.contract import master_port
from .launcher import NodeRun, flag_path, notice_signals


TAIL_LINES = 25


def _last_run_tail(log, lines: int) -> str:
    """The last `lines` lines of the newest run in a rank log."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    last = text.rsplit("==== slurm-hai run ", 1)[-1].split("\n", 1)[-1] if "==== slurm-hai run " in text else text
    return "\n".join(last.splitlines()[-lines:]) + "\n"


def simulate(cmd: list[str], suspend_after: float, restarts: int, grace: float, job_dir: str | None = None) -> int:
    jobdir = JobDir(job_dir or tempfile.mkdtemp(prefix="hai-local-")).create()
    sim_id = f"local{os.getpid()}"
    print(f"slurm-hai local run: state in {jobdir.path}", flush=True)
    run = 0
    while True:
        env = dict(os.environ, HAI_SIMULATE="1", HAI_JOB_DIR=str(jobdir.path), RANK="0", NODE_RANK="0",
                   WORLD_SIZE="1", MASTER_IP="127.0.0.1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port({})),
                   HAI_RESTART_COUNT=str(run), SLURM_RESTART_COUNT=str(run), HAI_CONTRACT="local")
        env.pop("SLURM_JOB_ID", None)
        flag = flag_path(sim_id, run)
        node = NodeRun(cmd, env, jobdir, run, 0, grace, notice_signals("USR2", False), flag=flag)
        node.start()
        assert node.child is not None  # start() exits when the command cannot start
        jobdir.event("start", run=run, host="local")
        notice_due = run < restarts
        print(f"slurm-hai local run: run {run} started" + (f"; suspend notice {suspend_after:g} s after its first "
                                                           "receive_suspend_command()" if notice_due else ""),
              flush=True)
        polled = Path(polled_marker(str(flag)))
        polling_since = None
        for sig in (*node.notices, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda s, _f: node.pending.append(s))
        while node.child.poll() is None:
            if notice_due and polling_since is None and polled.exists():
                polling_since = time.monotonic()
            if notice_due and polling_since is not None and time.monotonic() - polling_since >= suspend_after:
                node.notice("simulated")
                notice_due = False
                print(f"slurm-hai local run: run {run}: suspend notice sent (grace {grace:g} s)", flush=True)
            node.tick()
            time.sleep(0.02)
        flag.unlink(missing_ok=True)
        polled.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            flag.parent.rmdir()
        if notice_due and polling_since is None:
            print(f"slurm-hai local run: run {run} never called receive_suspend_command(); no notice was sent",
                  flush=True)
        how = jobdir.suspended(run)
        rc = node.child.returncode
        if how and run < restarts:
            print(f"slurm-hai local run: run {run} suspended ({how}); restarting", flush=True)
            jobdir.event("suspended", run=run, how=how)
            run += 1
            continue
        if rc != 0:  # show the end of the output: the traceback is there
            tail = _last_run_tail(jobdir.rank_log(0), TAIL_LINES)
            print(f"slurm-hai local run: run {run} failed; the last lines of its output:", flush=True)
            print(tail, end="" if tail.endswith("\n") else "\n", flush=True)
        print(f"slurm-hai local run: finished with exit code {rc} after {run} restart(s); logs in "
              f"{jobdir.rank_log(0)}", flush=True)
        return rc if rc >= 0 else 128 - rc
