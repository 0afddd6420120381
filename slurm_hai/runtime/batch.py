"""The batch-script side of a job: runs once per run on the job's first node.

It decides what a run's end means, which Slurm alone cannot:
  * a run that was suspended (go_suspend, or forced after the grace) is requeued, by this
    script alone once the run's step has ended (a preempted job on Slurm 24.05+ by Slurm
    itself, once this script ends);
  * success, a failure without --retries left, and `hai stop` are final: final.json is
    written and a later rerun (Slurm requeues a job that ends during a grace period)
    exits at once without running anything;
  * a failure with retries left is requeued, counting the retry (never in a loop).

It also picks the run's size: an elastic job (`--nodes MIN:MAX:STEP`) that Slurm gave a
count its STEP does not allow runs on the largest allowed one, and gives the other nodes
back at once (Slurm keeps the first ones).

`python -m slurm_hai.runtime.batch --job-dir DIR [--nodes RANGE] --grace S --retries N [--gpus G]
[--notice-signal NAME] [--term-is-notice] -- CMD...` (the last two as runtime/launcher.py takes them).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import socket
import sys
import time
from typing import MutableMapping

from ..policy.contract import master_node, restart_count
from .launcher import notice_signals
from ..jobs.jobdir import JobDir, run_sizes, untold_notice
from ..policy.limits import NOTICE_SIGNALS
from ..policy.sizes import NodeRange
from ..policy.tags import SUSPEND, Suspended, is_word, suspend_value, with_tags
from ..slurm import SlurmError, backend
from ..slurm.commands import KILLED_STEP_CLEANUP_S
from . import protocol

LEAVE_AGAIN_S = 1.0  # StepWatch: between two tries of the leave signal Slurm did not take
# How long a suspended run's requeue is asked again while slurmctld does not answer (as long
# as go_suspend() asked before this script became the requeue's one owner); after that the
# run ends failed, and the policy daemon requeues it (requeue-failed).
REQUEUE_TRIES_S = 600.0


def ipv4(addr: str) -> str:
    """A node's address as IPv4 (NodeAddr may be a host name: one DNS lookup)."""
    try:
        return str(ipaddress.IPv4Address(addr))
    except ValueError:
        return socket.gethostbyname(addr)

def launcher_argv(args: argparse.Namespace, cmd: list[str]) -> list[str]:
    """The per-node launcher, which the job step starts once on every node. The notice
    signals are ignored from the step's first instant (a disposition that exec keeps):
    one that came while Python starts would otherwise kill the launcher, and the job with
    it, for good. The launcher takes them over once its handlers are in place."""
    notices = sorted(sig.name.removeprefix("SIG") for sig in notice_signals(args.notice_signal, args.term_is_notice))
    argv = ["/bin/sh", "-c", f"trap '' {' '.join(notices)}; exec \"$@\"", "sh",
            sys.executable, "-m", "slurm_hai.runtime.launcher", f"--job-dir={args.job_dir}", f"--grace={args.grace}",
            f"--notice-signal={args.notice_signal}"]
    if args.term_is_notice:
        argv.append("--term-is-notice")
    return [*argv, "--", *cmd]


def run_size(slurm, job_id: int, sizes: NodeRange | None, env: MutableMapping[str, str]) -> int:
    """The nodes this run uses: all it was given, unless the job's STEP does not allow that
    count; then the largest allowed one, the rest given back to Slurm, and `env` told the
    new allocation as Slurm's resize script would (SLURM_NTASKS etc. no longer hold)."""
    given = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    size = sizes.largest_at_most(given) if sizes else None
    if size is None or size == given:
        return given
    slurm.shrink_allocation(job_id, size)
    job = slurm.job(job_id)
    nodelist = job.node_list if job is not None else ",".join(slurm.expand_hostlist(env["SLURM_JOB_NODELIST"])[:size])
    env.update(SLURM_NODELIST=nodelist, SLURM_JOB_NODELIST=nodelist, SLURM_NNODES=str(size),
               SLURM_JOB_NUM_NODES=str(size))
    for stale in ("SLURM_NPROCS", "SLURM_NTASKS", "SLURM_TASKS_PER_NODE", "SLURM_JOB_CPUS_PER_NODE"):
        env.pop(stale, None)
    return size


def size_change(events: list[dict], size: int) -> tuple[str, dict] | None:
    """("shrink" | "grow", {"from": N, "to": M}) when this run's size differs from the last
    run's (its `start` event), else None."""
    last = run_sizes(events)
    if not last or last[-1] == size:
        return None
    return ("shrink" if size < last[-1] else "grow"), {"from": last[-1], "to": size}


def unrecorded_suspend(jobdir: JobDir, events: list[dict], run: int) -> str | None:
    """How the run before `run` was suspended, when its script never said so: a requeue that
    slurmctld acknowledged and lost (stopped before it saved it; a backup took over) left
    that run to be killed and requeued by the policy daemon (requeue-failed)."""
    how = jobdir.suspended(run - 1) if run > 0 else None
    if how and not any(e.get("event") == "suspended" and e.get("run") == run - 1 for e in events):
        return how
    return None


def untold_cause(slurm, job_id: int, events: list[dict], run: int) -> dict | None:
    """The policy daemon's word on the notice of the run before `run`, when that run left
    before its launcher heard it: the daemon keeps it in the job's record until the job has
    run again a while (jobs.status.kept_cause). The record is read only for such a run."""
    if not untold_notice(events, run - 1):
        return None
    from ..jobs.status import kept_cause  # lazy: +10 ms to every run's start, for this rare run

    return kept_cause(slurm_record(slurm, job_id), events, run - 1)


def requeue_suspended(slurm, job_id: int, said: Suspended, ending: list[int]) -> int:
    """The requeue of a suspended run, which this script alone asks for (runtime/protocol.py),
    once the run's step has ended; the job's comment says so first (`said`: tag_suspended). A Slurm
    that does not take them (slurmctld restarting) is asked again until it does or shows the
    run over; a preempted job on 24.05+ is requeued by Slurm itself once this script ends."""
    run, wait, deadline = said.run, 0.5, time.monotonic() + REQUEUE_TRIES_S
    tagged = False
    while not ending:
        try:
            if slurm.requeued_when_batch_ends(job_id):
                return 0
            tagged = tagged or tag_suspended(slurm, job_id, said)
            slurm.requeue(job_id)
            break
        except SlurmError as e:
            if requeued_by_slurm(slurm, job_id, run):
                break  # already requeued or ended (a cancel, Slurm's own preemption)
            if time.monotonic() >= deadline:
                print(f"slurm-hai: run {run}: Slurm never took the requeue ({e}); the run ends failed, for the "
                      "policy daemon to requeue it (requeue-failed)", flush=True)
                return 1
            print(f"slurm-hai: run {run}: requeue: {e} (trying again)", flush=True)
        time.sleep(wait)
        wait = min(wait * 2, 10.0)
    return wait_to_be_requeued(ending)


def tag_suspended(slurm, job_id: int, said: Suspended) -> bool:
    """Say in the job's own Slurm record how its run ended by a suspend (its comment's
    hai-suspend): a requeue that slurmctld acknowledged and lost (a backup took over from its
    saved state) leaves the job FAILED, and the policy daemon requeues it by that record
    alone, reading no user's directory (requeue-failed); its metrics count the suspend by it.
    True once said."""
    job = slurm.job(job_id)
    if job is not None:
        slurm.update_job(job_id, Comment=with_tags(job.comment, {SUSPEND: suspend_value(said)}))
    return True


def how_suspended(events: list[dict], run: int, how: str) -> Suspended:
    """Run `run`'s suspend `how` from its journal: its first notice (cause and time; none: the
    job called go_suspend() unasked) and the moment it was marked (go_suspend, or forced)."""
    notice = next((e for e in events if e.get("event") == protocol.NOTICE and e.get("run") == run), None)
    marked = protocol.GO_SUSPEND if how == "go_suspend" else protocol.GRACE_EXPIRED
    at = next((e.get("t") for e in events if e.get("event") == marked and e.get("run") == run), None)
    if notice is None:
        return Suspended(run, how, "none", 0.0, _journal_time(at))
    cause = str(notice.get("cause")) if is_word(notice.get("cause")) else "unknown"
    return Suspended(run, how, cause, _journal_time(notice.get("t")), _journal_time(at))


def _journal_time(t: object) -> float:
    """A journalled time as the tags take it (now for one that is missing or not a time)."""
    return float(t) if isinstance(t, (int, float)) and 0 < t < 1e11 else time.time()


def wait_to_be_requeued(ending: list[int]) -> int:
    """After a requeue Slurm ends this script with SIGTERM: die at once then (releasing the
    node sooner), or leave after a while if that never comes. If that SIGTERM already came
    while the step was still ending (go_suspend's requeue), leave now: waiting would hold
    the nodes until Slurm's SIGKILL, KillWait seconds later."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # first, so no SIGTERM falls between the two
    if ending:
        return 0
    time.sleep(120)
    return 0


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(prog="python -m slurm_hai.runtime.batch")
    ap.add_argument("--job-dir", required=True)
    ap.add_argument("--nodes", type=NodeRange.parse, default=None)
    ap.add_argument("--grace", type=float, default=5.0)
    ap.add_argument("--retries", type=int, default=0)
    ap.add_argument("--gpus", type=int, default=0)
    ap.add_argument("--notice-signal", choices=NOTICE_SIGNALS, default="USR2")  # USR2: scripts older than the option
    ap.add_argument("--term-is-notice", action="store_true")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    return args, args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd


def main(argv: list[str] | None = None) -> int:
    args, cmd = parse(argv)
    job_id = int(os.environ["SLURM_JOB_ID"])
    run = restart_count(os.environ)
    token = os.environ.get("HAI_SUBMIT_TOKEN")  # set by hai-submit; absent for older scripts
    jobdir = JobDir(args.job_dir).claim(token) if token else JobDir(args.job_dir).create()

    final = jobdir.final()
    if final:
        print(f"slurm-hai: job {job_id} already ended ({final['state']}); not running it again", flush=True)
        jobdir.event("rerun_skipped", run=run, final=final["state"])
        return 0
    slurm = backend()
    nodes = start_run(slurm, jobdir, job_id, run, args.nodes)
    ending: list[int] = []
    signal.signal(signal.SIGTERM, lambda s, f: ending.append(s))  # Slurm ends the job: the step gets it too
    rc = slurm.run_step(launcher_argv(args, cmd), nodes, args.gpus, os.environ.get("SLURM_JOB_NAME", "hai"),
                        watch=StepWatch(slurm, jobdir, job_id, run))
    return end_run(slurm, jobdir, job_id, run, nodes, rc, args.retries, ending)


class StepWatch:
    """While the run's step runs: once the run is marked suspended (suspend.<run>, written
    on this node by go_suspend() or the forced suspend of rank 0), send the step
    protocol.LEAVE_SIGNAL, so that every node's launcher leaves at once and exits 0. Sent
    again at most every LEAVE_AGAIN_S while Slurm does not take it; each launcher also
    finds the marker on its own (launcher.MARKER_EVERY), with no controller."""

    def __init__(self, slurm, jobdir: JobDir, job_id: int, run: int) -> None:
        self.slurm, self.jobdir, self.job_id, self.run = slurm, jobdir, job_id, run
        self.tried_at = -LEAVE_AGAIN_S
        self.sent = False

    def __call__(self) -> None:
        now = time.monotonic()
        if self.sent or now < self.tried_at + LEAVE_AGAIN_S or self.jobdir.suspended(self.run) is None:
            return
        self.tried_at = now
        try:
            self.slurm.cancel(self.job_id, signal=protocol.LEAVE_SIGNAL)  # its steps, not this script
            self.sent = True
        except SlurmError as e:
            print(f"slurm-hai: run {self.run}: the step's leave signal: {e} (trying again)", flush=True)


def start_run(slurm, jobdir: JobDir, job_id: int, run: int, sizes: NodeRange | None) -> int:
    """Journal the run's start (and what the run before it left unsaid, and a size change),
    set the master's address, and return the run's node count."""
    nodes = run_size(slurm, job_id, sizes, os.environ)
    events = jobdir.events()
    unrecorded = unrecorded_suspend(jobdir, events, run)
    if unrecorded:
        jobdir.event(protocol.REQUEUE_ASKED, run=run - 1, how=unrecorded)
    told = untold_cause(slurm, job_id, events, run)
    if told:
        jobdir.event(protocol.NOTICE_CAUSE, run=run - 1, **told)
    change = size_change(events, nodes)
    if change:
        jobdir.event(change[0], run=run, **change[1])
    jobdir.event("start", run=run, nodes=os.environ.get("SLURM_JOB_NODELIST", ""), size=nodes,
                 host=os.uname().nodename)
    print(f"slurm-hai: job {job_id} run {run} on {os.environ.get('SLURM_JOB_NODELIST', '?')}", flush=True)
    # The master's address, looked up once for all nodes (the SPANK plugin does the same).
    if not os.environ.get("HAI_MASTER_IP"):
        os.environ["HAI_MASTER_IP"] = ipv4(slurm.node_addr(master_node(os.environ)))
    return nodes


def end_run(slurm, jobdir: JobDir, job_id: int, run: int, nodes: int, rc: int, retries: int,
            ending: list[int]) -> int:
    """The run's step has ended with `rc`: judge how (runtime/protocol.py), journal it, and
    act on it; this script's exit status."""
    step_over = time.monotonic()
    newer = superseded_by(jobdir.events(), run)
    how = jobdir.suspended(run)
    event = protocol.step_ended(rc, newer, how)
    retry = None
    if event is None:
        killed = ended_by_slurm(slurm, jobdir, job_id, run, nodes, ending)
        retry = None if killed else jobdir.take_retry(retries)
        event = protocol.failed_run(killed, retry is not None)
    if event == protocol.SUPERSEDED:
        # This node was cut off from Slurm and the job requeued: run `newer` owns the job
        # now. Judging this run (final state, a retry, a requeue) would be judging that one.
        jobdir.event(event, run=run, by=newer, exit_code=rc)
        print(f"slurm-hai: run {run} was superseded by run {newer} (the job was requeued while this node "
              "was cut off); leaving the job to it", flush=True)
        return rc
    if event == protocol.REQUEUE_ASKED:
        jobdir.event(event, run=run, how=how)
        print(f"slurm-hai: run {run} suspended ({how}); requeued", flush=True)
    elif event == protocol.RETRY:
        jobdir.event(event, run=run, exit_code=rc, retry=retry, of=retries)
        print(f"slurm-hai: run {run} failed (exit {rc}); retry {retry} of {retries}", flush=True)
    elif event == protocol.KILLED:
        jobdir.event(event, run=run, exit_code=rc)
    else:
        state = "succeeded" if rc == 0 else "failed"
        jobdir.set_final(state, rc, reason=failure_reason(jobdir, run, rc) if rc else "")
        jobdir.event(event, run=run, state=state, exit_code=rc)
        if rc:
            print(f"slurm-hai: run {run} failed (exit {rc}); not requeued (no retries left)", flush=True)
    if protocol.Action.REQUEUE not in protocol.actions_of(event):
        return rc
    if event == protocol.REQUEUE_ASKED:
        assert how is not None  # step_ended: only a marked run is asked to be requeued
        return requeue_suspended(slurm, job_id, how_suspended(jobdir.events(), run, how), ending)
    if nodes > 1:  # a retry: srun's --kill-on-bad-exit may have ended the step (KILLED_STEP_CLEANUP_S)
        time.sleep(max(0.0, step_over + KILLED_STEP_CLEANUP_S - time.monotonic()))
    slurm.requeue(job_id)
    return wait_to_be_requeued(ending)


def ended_by_slurm(slurm, jobdir: JobDir, job_id: int, run: int, nodes: int, ending: list[int]) -> bool:
    """Whether Slurm ended the failed run (a cancel, a forced requeue, a node lost): that is
    not a failure of the user's code. Waits a moment for Slurm's SIGTERM to this script
    (`ending`) before judging: 25.11 may send it only KillWait later after a node failure,
    but has then already counted the requeue (restart count past this run) or left RUNNING.
    A step that could not start on every node (srun: "Task launch ... failed on node": a
    node cut off) waits longer: Slurm marks such a node DOWN within SlurmdTimeout and
    requeues the job (NODE_FAIL), and judged now the run would count as the user's failure."""
    deadline = time.monotonic() + 2
    if len(jobdir.launched(run, nodes)) < nodes:
        deadline += slurmd_timeout(slurm) + 15
        print(f"slurm-hai: run {run} did not start on every node; waiting for Slurm to judge the nodes", flush=True)
    while not ending and time.monotonic() < deadline and not requeued_by_slurm(slurm, job_id, run):
        time.sleep(0.5)
    if not ending and requeued_by_slurm(slurm, job_id, run):
        ending.append(signal.SIGTERM)
    return bool(ending)


def failure_reason(jobdir: JobDir, run: int, rc: int) -> str:
    """Why run `run` failed, in words: the launcher's reason when the user's command never
    started, else its exit code."""
    why = next((e.get("error") for e in jobdir.events() if e.get("event") == "launch_failed" and e.get("run") == run),
               None)
    return f"could not start: {why}" if why else f"exit code {rc}"


def superseded_by(events: list[dict], run: int) -> int | None:
    """The newest run of the job that started after run `run` (its `start` event), if any."""
    newer = [e["run"] for e in events if e.get("event") == "start" and isinstance(e.get("run"), int) and e["run"] > run]
    return max(newer) if newer else None


def slurmd_timeout(slurm) -> float:
    """Slurm's SlurmdTimeout in seconds ("300 sec" in `scontrol show config`); its default,
    300, when Slurm does not say."""
    try:
        return float(slurm.config().get("SlurmdTimeout", "300").split()[0])
    except (SlurmError, ValueError, IndexError):
        return 300.0


def requeued_by_slurm(slurm, job_id: int, run: int) -> bool:
    """Whether Slurm has already decided to end or requeue this run (it is no longer the
    running run `run`); a Slurm that does not answer counts as no."""
    return run_over(slurm_record(slurm, job_id), run)


def slurm_record(slurm, job_id: int):
    """Slurm's record of the job; None when Slurm has none or does not answer."""
    try:
        return slurm.job(job_id)
    except SlurmError:
        return None


def run_over(job, run: int) -> bool:
    """Whether Slurm's record `job` (None: none) says that run `run` no longer runs."""
    return job is not None and (job.restart_count > run or job.state != "RUNNING")


if __name__ == "__main__":
    sys.exit(main())
