"""The suspend protocol of one run, as a pure state machine (issue 55).

A run (one Slurm start of a job: SLURM_RESTART_COUNT) moves through these states, driven by
what the batch driver, the launchers and the client API see; each transition names the
actions that follow it. One component owns each action; the requeue of a run has exactly
one owner, the batch driver, which acts when the run's step has ended:

  running     the user's command runs; no notice yet
  notified    a suspend notice came (the rank-0 node's flag is up), with its cause and the
              size the next run expects; the grace time runs
  committing  the job saves its suspend checkpoint (CheckpointManager.suspend_save)
  suspending  the job called go_suspend(): the run ends by a suspend; the launchers end the
              command and the step (no Slurm call: a container without Slurm suspends alike)
  forced      the grace ran out before go_suspend(): rank 0's launcher ends the command
  requeued    the batch driver asked Slurm to requeue the run (or Slurm requeues it itself)
  ended       the run is over without a requeue of ours: the job succeeded or failed for
              good, was cancelled or requeued by Slurm (a node lost), or a newer run owns it

Every event a component journals in events.jsonl has its name here (EVENTS); `replay`
rebuilds a run's state from the journal (the unit tests check every transition against it;
no component reads a run's state through it yet: each acts on its own signals and the run's
suspend marker, never on a journal a disk-full may have cut short). How a run's step ended
is judged here once, for the batch driver (`step_ended`, `failed_run`) and for a part of a
job in place (`part_left`), and what follows each judgement is its event's actions
(`actions_of`). A part of a job in place has no launcher and no notice of its own (Slurm's
signal ends its step): its task's script journals PART_LEFT with why (`part_left`), requeues
the task for each of PART_LEFT_FOR, and a preempted one where Slurm does not (before 24.05);
its own failure is retried as a run's is (RETRY). The table in docs/design.md, "The suspend
protocol as a state machine", is `table()`'s output.

Pure: no I/O, no clock, no Slurm.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Mapping


class State(str, Enum):
    RUNNING = "running"
    NOTIFIED = "notified"
    COMMITTING = "committing"
    SUSPENDING = "suspending"
    FORCED = "forced"
    REQUEUED = "requeued"
    ENDED = "ended"


class Action(str, Enum):
    RAISE_FLAG = "raise the rank-0 node's flag"  # the launcher on node 0
    MARK_SUSPEND = "mark suspend.<run>"  # whoever ends the run by a suspend: go_suspend, the launcher
    END_COMMAND = "end the user's command"  # the launchers (TERM, KILL after 3 s)
    REQUEUE = "requeue the run"  # the batch driver alone
    SET_FINAL = "write final.json"  # the batch driver
    NOTHING = "nothing"


# The journal's event names (events.jsonl) and what each is in the protocol.
NOTICE = "notice"  # the launcher: a notice came (cause, target_size: as the job's Slurm record says)
NOTICE_CAUSE = "notice_cause"  # the launcher, or the next run's batch script: the daemon's word came later
COMMIT_STARTED = "commit_started"  # the checkpoint manager: a suspend save began after a notice
GO_SUSPEND = "go_suspend"  # the client: go_suspend()
LEFT_FOR_REQUEUE = "left_for_requeue"  # a launcher: it ends its command after a go_suspend()
GRACE_EXPIRED = "forced_suspend"  # the launcher on node 0: the grace ran out
REQUEUE_ASKED = "suspended"  # the batch driver: it asked Slurm to requeue the suspended run
RETRY = "retry"  # the batch driver: a failed run requeued for one of the job's --retries
FINISHED = "finished"  # the batch driver: final.json written (succeeded, failed)
KILLED = "killed"  # the batch driver: Slurm ended the step (cancel, a node lost, its own requeue)
SUPERSEDED = "superseded"  # the batch driver: a newer run started while this node was cut off
PART_LEFT = "left"  # a part's task (a job in place): the part's step ended without success (part_left)

EVENTS = (NOTICE, NOTICE_CAUSE, COMMIT_STARTED, GO_SUSPEND, LEFT_FOR_REQUEUE, GRACE_EXPIRED, REQUEUE_ASKED,
          RETRY, FINISHED, KILLED, SUPERSEDED)
TERMINAL = frozenset({State.REQUEUED, State.ENDED})

# What the batch driver sends the run's step once the run is marked suspended: every node's
# launcher ends its command and exits 0, so that srun's --kill-on-bad-exit never ends the
# step. Its SIG_TERM_KILL keeps a connection to each node's slurmstepd open for KillWait;
# the stepd, its step done, waits up to 3 s for it before it removes the step's cgroup, the
# path of the next run's step, which then cannot start on that node (24.11 and later;
# docs/design.md, "The end of a run's step"). Ignored by default: the user's processes, which
# get it too, go on until their launcher ends them.
LEAVE_SIGNAL = "URG"


@dataclass(frozen=True)
class Transition:
    state: State
    event: str
    to: State
    actions: tuple[Action, ...]
    when: str = ""  # a condition on the event's fields, in words (the table's)


def _t(state: State, event: str, to: State, *actions: Action, when: str = "") -> Transition:
    return Transition(state, event, to, actions or (Action.NOTHING,), when)


_WAITING = (State.NOTIFIED, State.COMMITTING)
_LEAVING = (State.SUSPENDING, State.FORCED)

TRANSITIONS: tuple[Transition, ...] = (
    _t(State.RUNNING, NOTICE, State.NOTIFIED, Action.RAISE_FLAG),
    _t(State.RUNNING, GO_SUSPEND, State.SUSPENDING, Action.MARK_SUSPEND, Action.END_COMMAND,
       when="unasked: the job suspends itself"),
    *(_t(s, NOTICE_CAUSE, s, when="the cause (by_job, target_size) follows a preemption by Slurm")
      for s in (*_WAITING, *_LEAVING)),
    _t(State.NOTIFIED, COMMIT_STARTED, State.COMMITTING),
    *(_t(s, GO_SUSPEND, State.SUSPENDING, Action.MARK_SUSPEND, Action.END_COMMAND) for s in _WAITING),
    *(_t(s, LEFT_FOR_REQUEUE, s, Action.END_COMMAND, when="each node's launcher, as it ends its command")
      for s in _LEAVING),
    *(_t(s, GRACE_EXPIRED, State.FORCED, Action.MARK_SUSPEND, Action.END_COMMAND) for s in _WAITING),
    *(_t(s, REQUEUE_ASKED, State.REQUEUED, Action.REQUEUE, when="after the step ended") for s in _LEAVING),
    *(_t(s, FINISHED, State.ENDED, Action.SET_FINAL, when="the command ended on its own")
      for s in (State.RUNNING, *_WAITING)),
    *(_t(s, RETRY, State.REQUEUED, Action.REQUEUE, when="failed, a retry left") for s in (State.RUNNING, *_WAITING)),
    *(_t(s, KILLED, State.ENDED) for s in (State.RUNNING, *_WAITING, *_LEAVING)),
    *(_t(s, SUPERSEDED, State.ENDED) for s in (State.RUNNING, *_WAITING, *_LEAVING)),
)
_INDEX: Mapping[tuple[State, str], Transition] = {(t.state, t.event): t for t in TRANSITIONS}


class ProtocolError(ValueError):
    """An event that the run's state does not take."""


def step(state: State, event: str) -> Transition:
    """The transition that `event` makes from `state`; ProtocolError when there is none (an
    event of a state the run has left: the caller journals nothing and acts on nothing)."""
    if event not in EVENTS:
        raise ProtocolError(f"{event!r} is not an event of the suspend protocol")
    try:
        return _INDEX[(state, event)]
    except KeyError:
        raise ProtocolError(f"a run that is {state.value} does not take {event!r}") from None


def replay(events: Iterable[Mapping], run: int) -> State:
    """Run `run`'s state, from its journal (every other run's events and every other kind of
    event skipped; an event its state does not take, as a second notice, changes nothing)."""
    state = State.RUNNING
    for e in events:
        if e.get("run") != run or e.get("event") not in EVENTS:
            continue
        try:
            state = step(state, str(e["event"])).to
        except ProtocolError:
            continue
    return state


def actions_of(event: str) -> tuple[Action, ...]:
    """What follows `event`, from whatever state takes it: every event acts alike from every
    state (the unit tests check it), so a component acts without replaying the journal."""
    return next(t.actions for t in TRANSITIONS if t.event == event)


def step_ended(exit_code: int, newer_run: int | None, suspended: str | None) -> str | None:
    """How a run's step ended, as its batch driver judges it once the step is over: the
    event it journals. `newer_run`: a run that started after this one (this node was cut
    off and the job requeued: that run owns the job now); `suspended`: the run's suspend
    marker (go_suspend, forced). None: the command failed, which only Slurm's word on the
    run can judge (`failed_run`)."""
    if newer_run is not None:
        return SUPERSEDED
    if suspended:
        return REQUEUE_ASKED
    return FINISHED if exit_code == 0 else None


def failed_run(ended_by_slurm: bool, retry_left: bool) -> str:
    """A run whose command failed: Slurm ended it (a cancel, a node lost, Slurm's own
    requeue), so the failure is not the user's; else it is retried while the job has
    --retries left, and ends failed for good after the last."""
    if ended_by_slurm:
        return KILLED
    return RETRY if retry_left else FINISHED


# Why a part of a job in place left (its `left` event's flag), each of which its task's script
# requeues (runtime/part_task.py); a part preempted by Slurm is requeued by Slurm on 24.05+.
PART_LEFT_FOR = ("lighthouse_lost", "time_limit", "below_min")


def part_left(lighthouse_lost: bool, time_limit: bool, below_min: bool, preempted: bool) -> str:
    """Why a part's step ended without success: one of PART_LEFT_FOR, 'preempted', or
    'failed' (its own failure: retried while the job has --retries left). The lighthouse
    lost comes first: every part leaves so, whatever its own exit."""
    for why, seen in zip(PART_LEFT_FOR, (lighthouse_lost, time_limit, below_min)):
        if seen:
            return why
    return "preempted" if preempted else "failed"


def table() -> str:
    """The transitions as a Markdown table (docs/design.md)."""
    rows = ["| state | event (events.jsonl) | when | next state | actions |", "|---|---|---|---|---|"]
    for t in TRANSITIONS:
        rows.append(f"| {t.state.value} | `{t.event}` | {t.when} | {t.to.value} | "
                    f"{', '.join(a.value for a in t.actions)} |")
    return "\n".join(rows)
