"""Local simulation of the suspend protocol (no Slurm): `hai run-local`.

Runs the command as a one-node job (RANK 0, WORLD_SIZE 1) through the same NodeRun as the
real launcher; after `suspend_after` seconds the notice arrives; go_suspend() (or the forced
suspend after the grace) ends the run and the command starts again with the next restart
count, `restarts` times. Then the last run goes on to its end.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time

from .jobdir import JobDir
from .launcher import NodeRun, flag_path


def simulate(cmd: list[str], suspend_after: float, restarts: int, grace: float, job_dir: str | None = None) -> int:
    jobdir = JobDir(job_dir or tempfile.mkdtemp(prefix="hai-local-")).create()
    sim_id = f"local{os.getpid()}"
    print(f"slurm-hai local run: state in {jobdir.path}", flush=True)
    run = 0
    while True:
        env = dict(os.environ, HAI_SIMULATE="1", HAI_JOB_DIR=str(jobdir.path), RANK="0", NODE_RANK="0",
                   WORLD_SIZE="1", MASTER_IP="127.0.0.1", MASTER_ADDR="127.0.0.1", MASTER_PORT="2222",
                   HAI_RESTART_COUNT=str(run), SLURM_RESTART_COUNT=str(run), HAI_CONTRACT="local")
        env.pop("SLURM_JOB_ID", None)
        node = NodeRun(cmd, env, jobdir, run, 0, grace, False, force_suspend=lambda: None,
                       flag=flag_path(sim_id, run))
        node.start()
        jobdir.event("start", run=run, host="local")
        started = time.monotonic()
        notice_due = run < restarts
        for sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda s, _f: node.pending.append(s))
        while node.child.poll() is None:
            if notice_due and time.monotonic() - started >= suspend_after:
                node.notice("simulated")
                notice_due = False
            node.tick()
            if jobdir.suspended(run):
                node.end()
            time.sleep(0.02)
        if node.flag is not None:
            node.flag.unlink(missing_ok=True)
        how = jobdir.suspended(run)
        rc = node.child.returncode
        if how and run < restarts:
            print(f"slurm-hai local run: run {run} suspended ({how}); restarting", flush=True)
            jobdir.event("suspended", run=run, how=how)
            run += 1
            continue
        print(f"slurm-hai local run: finished with exit code {rc} after {run} restart(s); logs in "
              f"{jobdir.rank_log(0)}", flush=True)
        return rc if rc >= 0 else 128 - rc
