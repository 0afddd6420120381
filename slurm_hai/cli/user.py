"""hai: follow and control your HAI jobs (status, list, logs, stop, suspend, quota, ckpt, run-local)."""

from __future__ import annotations

import bisect
import dataclasses
import datetime as dt
import functools
import os
import re
import sys
import time
from operator import attrgetter
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import click

from .. import __version__
from ..controller.why import ask as ask_daemon
from ..controller.why import everyone as ask_everyone
from ..controller.why import why_question, words
from ..jobs.jobdir import JobDir, default_root
from ..jobs.status import (LIVE, HaiStatus, as_one_job, as_others_see, back_estimate, clock, hai_state, kept_cause,
                           marker)
from ..jobs.status import status as hai_status
from ..policy.job import in_place
from ..policy.explain import Explainer
from ..policy.levels import level_of_qos
from ..policy.model import find_policy
from ..policy.rules import is_held
from ..slurm import SlurmError
from ..slurm.records import JobInfo
from .ckpt import ckpt
from .front import daemon_service
from .common import (Group, Refused, backend, check_owner, column_texts, current_user, did_you_mean, emit_json,
                     job_dir_of, job_id_arg, lookup, one_line_errors, table, table_of_texts, timeline_options)

RUN_MARK = re.compile(r"^==== slurm-hai run (\d+) ")
TERMINAL = ("finished-succeeded", "finished-failed", "finished-stopped")
STATES = ("waiting", "running", "suspended", "finished", *TERMINAL)
FOLLOW_TICK = 0.5  # how often `hai logs -f` reads the job's own files
# At most this often `hai logs -f` asks Slurm about its job (that job alone), and only while the
# log is quiet.
FOLLOW_SLURM_EVERY = 5.0
MARKER_SETTLE = 1.0  # marker lines wait this long, so events written late still print in order


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "--version", prog_name="hai", message="%(prog)s (slurm-hai) %(version)s")
def main():
    """Follow and control HAI jobs submitted with hai-submit.

    \b
    States: waiting (not started yet), running, suspended (requeued, will run again),
    finished-succeeded, finished-failed, finished-stopped.

    \b
    Examples:
      hai status 6          the state of job 6, and why, in words
      hai list --all        everyone's jobs
      hai logs -f 6         follow rank 0's output across suspensions
      hai quota             your quota and usage per level
      hai timeline          your jobs on the nodes in the last hour, as an HTML page
    Shell completion (bash): eval "$(_HAI_COMPLETE=bash_source hai)"
    """


# ------------------------------------------------------------------ one job's status


def may_read(job: JobInfo | None) -> bool:
    """Whether this user may read the job's private directory: their own job, or root.
    Another user's job is told from what Slurm shows only."""
    return job is None or os.getuid() == 0 or job.user == current_user()


def job_status(job_id: int, job: JobInfo | None, jobdir: JobDir | None,
               find: Callable[[int], JobInfo | None] | None = None,
               why: Callable[[JobInfo], str] | None = None) -> HaiStatus:
    """The HAI status of one job, from what the command has read already. With `find` (a
    job's record by its id) a suspended job is told when it may run again; with `why` (the
    policy's words) a waiting or running job is explained; without them the reason is
    Slurm's. jobdir None: a job whose files this user may not read."""
    if jobdir is None and job is not None:
        return as_others_see(job, why)
    readable = jobdir is not None and may_read(job)
    events, final, request, owner_uid = [], None, {}, None
    if jobdir is not None and readable:
        try:
            owner_uid = jobdir.path.stat().st_uid
            events, final, request = jobdir.events(), jobdir.final(), jobdir.request()
        except FileNotFoundError:  # no directory (a job not from hai-submit): nothing to read
            pass
        except PermissionError:  # e.g. root's HAI_HOME seen by root over a root-squashed share
            readable = False
    runs = sum(1 for e in events if e.get("event") == "suspended")
    last_run = max((int(e.get("run", 0)) for e in events if e.get("event") == "start"), default=0)
    kept = kept_cause(job, events, last_run)  # the daemon's word that came after the run had left
    if kept is not None:
        events = [*events, {"event": "notice_cause", "run": last_run, **kept}]
    explained = None
    if job is not None and job.state in LIVE and why is not None:
        explained = why(job)
    st = hai_status(job_id, job, final, request, runs, explained, last_run, events=events,
                    private=not readable, owner_uid=owner_uid)
    if st.state == "finished-failed" and final is None and readable and not any(e["event"] == "start" for e in events):
        said = jobdir.batch_said() if jobdir is not None else ""
        if said:  # it ended before its launcher could record anything: its batch script says why
            told = f"before it started, its batch script said: {said}"
            st = dataclasses.replace(st, reason=f"{st.reason}; {told}" if st.reason else told)
    if st.state == "suspended" and events and find is not None:
        estimate = back_estimate(events, find)
        if estimate:
            st = dataclasses.replace(st, reason=f"{st.reason}; {estimate}" if st.reason else estimate)
    return st


def _has_ended(job_id: int) -> bool:
    """Whether your own directory of the job says it ended for good (final.json)."""
    try:
        return JobDir.for_job(job_id, default_root()).final() is not None
    except OSError:
        return False


def _part_of(job_id: int, job: JobInfo | None) -> int | None:
    """The job in place whose part `job_id` is, when it is a part's own task id (a task of an
    elastic job in place gets one when it starts): `hai list` shows the job in place, under
    its array's id, never the task. None: `job_id` is no part's."""
    return job.array_job_id if job is not None and in_place(job) and job.array_job_id != job_id else None


def _refuse_a_part(job_id: int, job: JobInfo | None, action: str) -> None:
    """A part is not a job of its own to stop or suspend: the job in place is."""
    whole = _part_of(job_id, job)
    if whole is not None:
        raise click.ClickException(f"job {job_id} is a part of job {whole}, an elastic job in place: "
                                   f"`hai {action} {whole}` {action}s it, all its parts")


def _status_of(job_id: int) -> tuple[HaiStatus, JobInfo | None, JobDir]:
    """`hai status JOB`: the job's own record first (squeue of one job: one small RPC). A
    waiting job's words need the whole queue (its place in line, its user's nodes in use):
    the policy daemon's, where it answers (controller/why.py), else the command's own read of
    the queue. A running job is explained from its own record; one whose directory says it
    has ended, not at all."""
    service = daemon_service()  # asked first: it answers while Slurm is asked for the job
    question = why_question(service, [job_id]) if service else None
    try:
        job, jobdir = lookup(job_id)
        whole = _part_of(job_id, job)
        if whole is not None:
            click.echo(f"job {job_id} is a part of job {whole}, an elastic job in place: its status", err=True)
            job_id = whole
            job, jobdir = lookup(job_id)
        if job is not None and in_place(job):  # a job in place: its parts, as one job
            job = next(iter(as_one_job(backend().jobs([job_id]))), job)
        if job is None or job.state not in LIVE or _has_ended(job_id):
            return job_status(job_id, job, jobdir), job, jobdir
        policy = find_policy()
        if job.state == "RUNNING":
            return job_status(job_id, job, jobdir, None, Explainer([job], policy)), job, jobdir
        said = words(question, [job])
    finally:
        if question is not None:
            question.close()
    if job_id in said:
        return job_status(job_id, job, jobdir, backend().job, lambda j: said[j.job_id]), job, jobdir
    queue = backend().jobs()
    job = next((j for j in as_one_job(queue) if j.job_id == job_id), job)
    return job_status(job_id, job, jobdir, {j.job_id: j for j in queue}.get, Explainer(queue, policy)), job, jobdir


def _when(t: int) -> str:
    return clock(t) if t else "-"


@main.command()
@click.argument("job", callback=lambda c, p, v: job_id_arg(v) if v else None, required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@one_line_errors
def status(job, as_json):
    """Show the HAI state of JOB (or of all your jobs), with the reason in words."""
    if job is None:
        return _list(all_users=False, as_json=as_json)
    st, info, jobdir = _status_of(job)
    if as_json:
        emit_json(st.as_dict() | {"job_dir": None if st.private else str(jobdir.path)})
        return
    rows = {
        "job id": st.job_id, "name": st.name, "user": st.user, "state": st.state, "reason": st.reason,
        "level": st.level, "grace": f"{st.grace} s" if st.grace is not None else None,
        "nodes": _nodes_line(st), "node list": st.node_list, "restarts": st.restarts,
        "suspends": f"{st.suspends} ({st.forced_suspends} forced)" if st.suspends else 0,
        "retries": st.retries, "submitted": _when(st.submitted), "started": _when(st.started),
        "ended": _when(st.ended), "exit code": st.exit_code,
    }
    for key, value in rows.items():
        click.echo(f"{key:<10} {'-' if value in (None, '') else value}")
    if st.private:
        click.echo(f"{'note':<10} job of {st.user}: its logs and files are private to them; "
                   "this is what Slurm shows")


# ------------------------------------------------------------------ many jobs


def parse_since(text: str, now: float | None = None) -> float:
    """`--since`: 30m, 2h, 1d (ago), HH:MM (today) or YYYY-MM-DD[THH:MM] -> epoch seconds."""
    now = time.time() if now is None else now
    m = re.fullmatch(r"(\d+)\s*([smhd])", text.strip())
    if m:
        return now - int(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    for fmt in ("%H:%M", "%H:%M:%S"):
        try:
            t = dt.datetime.strptime(text, fmt).time()
            return dt.datetime.combine(dt.date.fromtimestamp(now), t).timestamp()
        except ValueError:
            pass
    try:
        return dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise Refused(f"--since {text!r}: use 30m, 2h, 1d, HH:MM or YYYY-MM-DD[THH:MM]") from None


def _own_ended_jobs(known: set[int]) -> list[tuple[int, JobDir]]:
    """Your job directories that Slurm no longer lists (it forgets ended jobs after minutes)."""
    root = default_root()
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return [(int(n), JobDir.for_job(n, root)) for n in names if n.isdigit() and int(n) not in known]


LIST_HEADERS = ("JOB", "NAME", "USER", "STATE", "LEVEL", "NODES", "RESTARTS", "SUBMITTED", "STARTED", "ENDED", "REASON")


def _list(all_users: bool, as_json: bool, since: float | None = None, state: str | None = None) -> None:
    me = current_user()
    policy = find_policy()
    when = functools.lru_cache(maxsize=None)(_when)  # many jobs share a second
    # everyone else's jobs (--all) as the policy daemon last read them, where it answers
    # (controller/why.py): one whole-queue read of slurmctld per daemon cycle, not per command
    theirs = ask_everyone(policy.daemon_service) if all_users and policy.daemon_service else None
    their_texts = None
    if theirs is not None:
        theirs = _shown([r for r in theirs if r.user != me], since, state)
        if not as_json:  # their part of the table, made while Slurm reads your own jobs
            their_texts = _list_texts(theirs, when)
    yours = not all_users or theirs is not None
    queue = backend().jobs(user=me if yours else None)  # yours alone: one small RPC
    said: dict[int, str] = {}
    if yours:
        # a waiting job's place in line, and who holds its nodes: the daemon's words, else the whole queue
        waiting = [j for j in as_one_job(queue) if j.state == "PENDING" and (not is_held(j) or j.restart_count)]
        said = ask_daemon(policy.daemon_service, waiting) if waiting and policy.daemon_service else {}
        if len(said) < len(waiting):
            queue, said, theirs, their_texts = backend().jobs(), {}, None, None
    explainer = Explainer(queue, policy)  # one policy read, one snapshot of the queue
    by_id = {j.job_id: j for j in queue}

    def why(j: JobInfo) -> str:
        return said.get(j.job_id) or explainer(j)

    def find(job_id: int) -> JobInfo | None:  # the job that preempted one of yours
        return by_id.get(job_id) if job_id in by_id or not said else backend().job(job_id)

    root = default_root()
    # your jobs with what their directories say; other users' (--all) as Slurm shows them, for
    # root too: 10,000 directories on a shared file system are seconds (`hai status JOB` reads one)
    rows = [job_status(j.job_id, j, job_dir_of(j.job_id, j, root) if j.user == me else None, find, why)
            for j in as_one_job(queue) if (all_users and theirs is None) or j.user == me]
    if since is not None or state is not None:  # ended jobs too, from your own job directories
        rows += [job_status(jid, None, d, find, why) for jid, d in _own_ended_jobs({j.job_id for j in queue})]
    rows = _shown(sorted(rows, key=lambda r: r.job_id), since, state)
    if as_json:
        emit_json([r.as_dict() for r in sorted([*rows, *(theirs or ())], key=lambda r: r.job_id)])
        return
    texts = _list_texts(rows, when)
    if theirs is not None and their_texts is not None:
        texts = _merged([r.job_id for r in theirs], their_texts, [r.job_id for r in rows], texts)
    click.echo(table_of_texts(LIST_HEADERS, texts))


def _shown(rows: list[HaiStatus], since: float | None, state: str | None) -> list[HaiStatus]:
    """The rows `hai list --since/--state` shows."""
    if since is not None:
        rows = [r for r in rows if (r.submitted or r.started or r.ended) >= since]
    if state is not None:
        rows = [r for r in rows if r.state == state or (state == "finished" and r.state in TERMINAL)]
    return rows


def _list_texts(rows: Sequence[HaiStatus], when: Callable[[int], str]) -> list[list[str]]:
    """The LIST_HEADERS columns of `rows`, as text."""
    def of(name: str) -> Iterable[Any]:
        return map(attrgetter(name), rows)

    return column_texts([of("job_id"), of("name"), of("user"), of("state"), of("level"), of("nodes_text"),
                         of("restarts"), map(when, of("submitted")), map(when, of("started")),
                         map(when, of("ended")), of("reason")])


def _merged(ids: list[int], texts: list[list[str]], more_ids: list[int], more: list[list[str]]) -> list[list[str]]:
    """Two tables' columns, each in job id order, as one in job id order; `more` is a few rows
    (yours), each put in its place in `texts` (everyone else's)."""
    places = [bisect.bisect(ids, job_id) for job_id in more_ids]
    for k in reversed(range(len(more_ids))):  # the last first: the earlier places stay right
        for column, extra in zip(texts, more):
            column.insert(places[k], extra[k])
    return texts


def _nodes_line(st) -> str:
    """`hai status`'s nodes: 2, or for an elastic job 2 of 2:4, with the size of each run."""
    if not st.node_range:
        return str(st.nodes)
    runs = f"; runs on {', '.join(map(str, st.sizes))}" if len(set(st.sizes)) > 1 else ""
    return f"{st.nodes} of {st.node_range}{runs}"


def _state_choice(ctx, param, value):
    if value is None or value in STATES:
        return value
    raise click.BadParameter(f"{value!r}: {did_you_mean(value, STATES)}use one of {', '.join(STATES)}")


@main.command(name="list")
@click.option("--all", "all_users", is_flag=True, help="Jobs of every user, not only yours (theirs as Slurm shows "
              "them, for root too).")
@click.option("--since", metavar="WHEN", help="Only jobs submitted since WHEN (30m, 2h, 1d, HH:MM, YYYY-MM-DD); "
                                                "includes your ended jobs that Slurm has forgotten.")
@click.option("--state", callback=_state_choice, metavar="STATE",
              help="Only jobs in STATE: waiting, running, suspended, finished, finished-succeeded, "
                   "finished-failed, finished-stopped.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@one_line_errors
def list_jobs(all_users, since, state, as_json):
    """List your jobs that Slurm still knows (running, waiting, suspended, recently ended),
    with when each was submitted, started and ended. Other users' jobs (--all) are shown
    from what Slurm shows; their files stay private."""
    _list(all_users, as_json, parse_since(since) if since else None, state)


# ------------------------------------------------------------------ timeline


def timeline_window(since: str, until: str | None) -> tuple[float, float]:
    start, end = parse_since(since), parse_since(until) if until else time.time()
    if start >= end:
        raise Refused(f"--since {since} is not before --until {until or 'now'}")
    return start, end


def write_timeline(tl, out: str, title: str, as_json: bool) -> None:
    """Write the timeline page to `out` (or print its model as JSON) and say what it shows."""
    from ..jobs.timeline import page  # lazy: +5 ms to every hai command

    if as_json:
        emit_json(tl.as_dict())
        return
    Path(out).write_text(page(tl, title))
    click.echo(f"wrote {out}: {len(tl.job_ids)} job(s) on {len(tl.nodes)} node(s), {len(tl.marks)} mark(s), "
               f"{clock(tl.since, tl.until)} to {clock(tl.until)}; open it in a browser (it needs no network)")


@main.command()
@timeline_options
@one_line_errors
def timeline(since, until, out, as_json):
    """Draw your jobs on the nodes over time, as one HTML page that opens offline: which of
    your jobs held each node, coloured by level, with a mark where a run was suspended
    (go_suspend() or by force), restarted, shrunk or grown; hover for the details.
    Read from Slurm's accounting (every run of a requeued job) and your jobs' events."""
    from ..jobs.timeline import collect  # lazy: +5 ms to every hai command

    start, end = timeline_window(since, until)
    tl = collect(backend(), start, end, current_user(), find_policy().ladder, only_mine=True)
    write_timeline(tl, out, f"HAI jobs of {current_user()}", as_json)


# ------------------------------------------------------------------ quota


def my_accounts(slurm, me: str, jobs: Sequence[JobInfo]) -> tuple[list[str], str]:
    """Your Slurm accounts (your default account first) and the default one ("" when unknown):
    from Slurm's accounting, and the accounts your jobs run in (all there is without slurmdbd)."""
    try:
        default = next((u["DefaultAccount"] for u in slurm.users() if u.get("User") == me), "")
        known = {a["Account"] for a in slurm.associations() if a.get("User") == me and a.get("Account")}
    except SlurmError:  # no accounting here, or slurmdbd down: the queue still tells some
        default, known = "", set()
    known |= {j.account for j in jobs if j.account}
    return sorted(known, key=lambda a: (a != default, a)), default


@main.command()
@click.option("--json", "as_json", is_flag=True,
              help="Print JSON: per level, your nodes in use, the quota in your default account (`account`) and "
                   "in each of your accounts.")
@one_line_errors
def quota(as_json):
    """Show your node quota per level and how many nodes you use of it.

    Counts your running jobs' nodes at each level against the policy's per-user quota
    (`hai-admin check` shows everyone's); a job beyond it waits, a job larger than it is
    refused at submit. A quota may be set for an account: when your accounts' quotas
    differ, each account has its own column, your default account (the one your jobs run
    in unless you name another) first."""
    policy = find_policy()
    me = current_user()
    slurm = backend()
    jobs = slurm.jobs(user=me)
    accounts, default = my_accounts(slurm, me, jobs)
    used: dict[str, int] = {}
    for j in jobs:
        lvl = level_of_qos(j.qos, policy.ladder)
        if lvl is not None and j.state in ("RUNNING", "CONFIGURING", "COMPLETING"):
            used[lvl.name] = used.get(lvl.name, 0) + j.num_nodes
    first = accounts[0] if accounts else ""  # none known: your own quota, else the default one
    rows = [{"level": lvl.name, "value": lvl.value, "in_use": used.get(lvl.name, 0), "account": first or None,
             "quota": policy.quota_for(lvl.name, me, first),
             "accounts": {a: policy.quota_for(lvl.name, me, a) for a in accounts}}
            for lvl in policy.levels_high_to_low]
    if as_json:
        emit_json(rows)
        return
    differ = len({tuple(r["accounts"][a] for r in rows) for a in accounts}) > 1
    heads = [f"QUOTA {a}" + (" (default)" if a == default else "") for a in accounts] if differ else ["QUOTA"]
    click.echo(table(["LEVEL", "VALUE", "IN USE", *heads],
                     [[r["level"], r["value"], r["in_use"],
                       *("no limit" if q is None else q for q in (r["accounts"].values() if differ else [r["quota"]]))]
                      for r in rows]))
    if accounts and not differ:
        names = ", ".join(f"{a} (default)" if a == default and len(accounts) > 1 else a for a in accounts)
        click.echo(f"quota in your account{'s' if len(accounts) > 1 else ''} {names}")
    elif not accounts and policy.account_quota:
        click.echo("your accounts are unknown (Slurm's accounting did not say): an account's own quota may differ")


# ------------------------------------------------------------------ logs


def split_runs(text: str) -> list[tuple[int, str]]:
    """Cut a rank log into (run, text) pieces at the run marker lines."""
    runs: list[tuple[int, list[str]]] = []
    for line in text.splitlines(keepends=True):
        m = RUN_MARK.match(line)
        if m:
            runs.append((int(m.group(1)), [line]))
        elif runs:
            runs[-1][1].append(line)
        else:
            runs.append((0, [line]))
    return [(k, "".join(lines)) for k, lines in runs]


def _check_logs_readable(job_id: int, job: JobInfo | None) -> None:
    if job is not None and not may_read(job):  # None: may read
        raise click.ClickException(f"job {job_id} belongs to {job.user}; its logs are private to them")


def _logs_of(job_id: int) -> tuple[int, JobInfo | None, JobDir]:
    """The job whose logs `hai logs JOB` shows, its record and directory: a part's own task id
    stands for its job in place, whose directory holds every part's log."""
    job, jobdir = lookup(job_id)
    whole = _part_of(job_id, job)
    if whole is not None:
        click.echo(f"job {job_id} is a part of job {whole}, an elastic job in place: its logs (--rank P: part P's)",
                   err=True)
        job_id = whole
        job, jobdir = lookup(job_id)
    _check_logs_readable(job_id, job)
    return job_id, job, jobdir


def _check_rank(job_id: int, job: JobInfo | None, jobdir: JobDir, rank: int) -> None:
    """A node rank of the job; for an elastic job in place, a part (one per node, each part's
    output in the rank log of its number, runtime/part_task.py), running or not."""
    request = jobdir.request()
    parts = int(request.get("parts") or 0)
    if parts and not 0 <= rank < parts:
        raise click.ClickException(f"job {job_id} has no part {rank}: it runs as {parts} parts, 0 to {parts - 1} "
                                   "(--rank P shows part P)")
    nodes = parts or (job.num_nodes if job else int(request.get("nodes", 0) or 0))
    if nodes and not 0 <= rank < nodes:
        raise click.ClickException(f"job {job_id} has no rank {rank}: it runs on {nodes} node(s), "
                                   f"ranks 0 to {nodes - 1}")


def _show_markers(events: list[dict], owner_uid: int | None, restart: int | None,
                  settled: float | None) -> list[dict]:
    """Print the marker lines of the events older than `settled` (all if None), in time
    order; return the rest. Events come from several processes (the launcher writes the
    notice once it has asked Slurm why), so one second's wait puts them in order."""
    ready = sorted((e for e in events if settled is None or float(e.get("t", 0)) <= settled),
                   key=lambda e: float(e.get("t", 0)))
    for e in ready:
        line = marker(e, owner_uid)
        if line and (restart is None or int(e.get("run", 0) or 0) == restart):
            click.echo(line, err=True)
    return [e for e in events if not (settled is None or float(e.get("t", 0)) <= settled)]


def follow_logs(job_id: int, rank: int, restart: int | None) -> None:
    """Print the rank's log and keep printing as it grows, across suspensions, until the end
    (exit 1 unless the job succeeded); a marker line on stderr at each notice, suspend, retry
    and restart. Reads the job's own
    files every FOLLOW_TICK s. Asks Slurm about this one job (never the queue) at most every
    FOLLOW_SLURM_EVERY s, and only while the log is quiet: new output says the job runs, and
    final.json says it has ended; Slurm is needed only for an end the job could not write."""
    slurm = backend()
    job_id, job, jobdir = _logs_of(job_id)
    _check_rank(job_id, job, jobdir, rank)
    path = jobdir.rank_log(rank)
    owner_uid = jobdir.path.stat().st_uid if jobdir.path.exists() else None
    offset, seen_events, asked_at = 0, len(jobdir.events()), time.monotonic()
    unshown: list[dict] = []
    try:
        while True:
            printing = False
            if path.exists():
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                printing = bool(chunk)
                if printing:
                    offset += len(chunk)
                    text = chunk.decode(errors="replace")
                    if restart is not None:
                        text = "".join(t for k, t in split_runs(text) if k == restart)
                    sys.stdout.write(text)
                    sys.stdout.flush()
            events = jobdir.events()
            unshown += events[seen_events:]
            seen_events = len(events)
            final = jobdir.final()
            if not final and not printing and time.monotonic() - asked_at >= FOLLOW_SLURM_EVERY:
                job, asked_at = slurm.job(job_id), time.monotonic()
            state = hai_state(job, final, 0)
            ended = state in TERMINAL or state == "unknown"
            unshown = _show_markers(unshown, owner_uid, restart, settled=None if ended else time.time() - MARKER_SETTLE)
            if ended:  # exit 0 only for a job that succeeded, as a shell's `cmd; echo $?` would
                click.echo(f"---- job {job_id} {state}", err=True)
                if state != "finished-succeeded":
                    raise click.exceptions.Exit(1)
                return
            time.sleep(FOLLOW_TICK)
    except KeyboardInterrupt:
        click.echo(f"\nstopped following; job {job_id} goes on (`hai logs -f {job_id}` to follow again, "
                   f"`hai stop {job_id}` to end it)", err=True)
        sys.exit(130)


@main.command()
@click.argument("job", callback=lambda c, p, v: job_id_arg(v))
@click.option("-f", "--follow", is_flag=True,
              help="Keep printing new output, across suspensions, until the job ends (exit 1 unless it succeeded).")
@click.option("--rank", type=int, default=0, show_default=True, help="Node rank whose output to show.")
@click.option("--restart", type=int, help="Only this run (0 = the first, 1 = after the first restart, ...).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON: the runs of the rank, each with its text.")
@one_line_errors
def logs(job, follow, rank, restart, as_json):
    """Print the output of JOB on node RANK: every run, in order, each opened by a
    '==== slurm-hai run K' line. With -f, marker lines on stderr tell each suspend notice
    (and why), forced suspend, retry and restart as they happen."""
    if follow:
        if as_json:
            raise Refused("--json and --follow do not go together")
        return follow_logs(job, rank, restart)
    job, info, jobdir = _logs_of(job)
    _check_rank(job, info, jobdir, rank)
    path = jobdir.rank_log(rank)
    if not path.exists():
        if as_json:
            emit_json({"job_id": job, "rank": rank, "runs": []})
            return
        said = jobdir.batch_said() if not any(e["event"] == "start" for e in jobdir.events()) else ""
        if said and (info is None or info.state not in LIVE):
            raise click.ClickException(f"job {job} ended before it started on rank {rank}; its batch script said: "
                                       f"{said} (all of it: {jobdir.path.parent / f'batch-{job}.log'})")
        raise click.ClickException(f"no output yet for job {job} rank {rank} (the job has not started there; "
                                   f"`hai status {job}` says why)")
    runs = split_runs(path.read_text(errors="replace"))
    if restart is not None:
        runs = [r for r in runs if r[0] == restart]
        if not runs:
            raise click.ClickException(f"job {job} has no run {restart} on rank {rank}")
    if as_json:
        emit_json({"job_id": job, "rank": rank, "runs": [{"run": k, "text": t} for k, t in runs]})
        return
    sys.stdout.write("".join(text for _, text in runs))


# ------------------------------------------------------------------ control


@main.command()
@click.argument("job", callback=lambda c, p, v: job_id_arg(v))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@one_line_errors
def stop(job, as_json):
    """Stop JOB for good: it is cancelled and never restarted. A job that has ended
    (or ends on its own before Slurm cancels it) is left as it ended: exit 1."""
    from ..jobs import control  # lazy: +1.5 ms to every hai command

    info, jobdir = lookup(job)
    check_owner(info, "stop")
    _refuse_a_part(job, info, "stop")
    control.stop(backend(), job, info, jobdir, writable=jobdir.path.is_dir() and may_read(info))
    if as_json:
        emit_json({"job_id": job, "state": "finished-stopped"})
    else:
        click.echo(f"job {job} stopped")


@main.command()
@click.argument("job", callback=lambda c, p, v: job_id_arg(v))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@one_line_errors
def suspend(job, as_json):
    """Suspend JOB gracefully: rank 0 gets the suspend notice, the job commits, calls
    go_suspend() (or is suspended by force after its grace time) and is requeued.
    Only a running job gets the notice; any other: exit 1."""
    from ..jobs import control  # lazy: +1.5 ms to every hai command

    info, jobdir = lookup(job)
    check_owner(info, "suspend")
    _refuse_a_part(job, info, "suspend")
    writable = jobdir.path.is_dir() and may_read(info)
    control.check_running(job, info, jobdir, writable)
    if writable:
        control.check_no_notice_yet(job, info.restart_count, jobdir.events())
    control.request_suspend(backend(), job, info.restart_count, jobdir, writable,
                            notice_signal=find_policy().notice_signal)
    if as_json:
        emit_json({"job_id": job, "notice_sent": True})
    else:
        click.echo(f"suspend notice sent to job {job}; `hai status {job}` follows it")


main.add_command(ckpt)


@main.command(name="run-local", context_settings={"ignore_unknown_options": True})
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--suspend-after", type=float, default=10, show_default=True,
              help="Seconds from the run's first receive_suspend_command() call (its loop, not its imports) "
                   "to the suspend notice.")
@click.option("--restarts", type=int, default=1, show_default=True, help="How many times to suspend and restart.")
@click.option("--grace", type=float, show_default="the policy's grace_seconds",
              help="Seconds before a forced suspend.")
@click.option("--python", "python", default=sys.executable, show_default="this interpreter")
@click.option("--job-dir", type=click.Path(file_okay=False), help="State directory (default: a new temporary one).")
@one_line_errors
def run_local(script, args, suspend_after, restarts, grace, python, job_dir):
    """Run SCRIPT here, without Slurm, as a one-node job that gets the suspend notice
    --suspend-after seconds after it first calls receive_suspend_command() and is
    restarted, to test resume logic locally.
    Arguments after `--` go to the script."""
    from ..runtime.simulate import simulate  # lazy: +9 ms to every hai command

    grace = find_policy().grace_seconds if grace is None else grace
    cmd = [python, script, *args] if script.endswith(".py") else [script, *args]
    rc = simulate(cmd, suspend_after=suspend_after, restarts=restarts, grace=grace, job_dir=job_dir)
    sys.exit(rc)
