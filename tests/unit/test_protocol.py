"""runtime/protocol.py: the suspend protocol's state machine, every transition of it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from slurm_hai.runtime import protocol as p
from slurm_hai.runtime.protocol import Action, State

PACKAGE = Path(p.__file__).resolve().parents[1]


@pytest.mark.parametrize("t", p.TRANSITIONS, ids=lambda t: f"{t.state.value}-{t.event}")
def test_each_transition_goes_where_the_table_says_with_its_actions(t):
    got = p.step(t.state, t.event)
    assert (got.to, got.actions) == (t.to, t.actions)
    assert p.replay(path_to(t.state) + [{"event": t.event, "run": 0}], 0) == t.to


def path_to(state: State) -> list[dict]:
    """A journal of run 0 that leaves it in `state`."""
    events = {State.RUNNING: [], State.NOTIFIED: [p.NOTICE], State.COMMITTING: [p.NOTICE, p.COMMIT_STARTED],
              State.SUSPENDING: [p.NOTICE, p.GO_SUSPEND], State.FORCED: [p.NOTICE, p.GRACE_EXPIRED],
              State.REQUEUED: [p.NOTICE, p.GO_SUSPEND, p.REQUEUE_ASKED], State.ENDED: [p.FINISHED]}[state]
    journal = [{"event": e, "run": 0} for e in events]
    assert p.replay(journal, 0) == state
    return journal


@pytest.mark.parametrize("state", list(State))
def test_an_event_a_state_does_not_take_is_refused_and_changes_nothing(state):
    taken = {t.event for t in p.TRANSITIONS if t.state == state}
    for event in sorted(set(p.EVENTS) - taken):
        with pytest.raises(p.ProtocolError, match=state.value):
            p.step(state, event)
        assert p.replay(path_to(state) + [{"event": event, "run": 0}], 0) == state


def test_a_run_once_requeued_or_ended_takes_no_event():
    for state in p.TERMINAL:
        assert not [t for t in p.TRANSITIONS if t.state == state]


def test_only_the_batch_drivers_two_events_requeue_a_run():
    requeuing = {t.event for t in p.TRANSITIONS if Action.REQUEUE in t.actions}
    assert requeuing == {p.REQUEUE_ASKED, p.RETRY}


def test_a_second_notice_and_a_late_go_suspend_change_nothing():
    journal = [{"event": "start", "run": 0}, {"event": p.NOTICE, "run": 0}, {"event": p.NOTICE, "run": 0},
               {"event": p.GRACE_EXPIRED, "run": 0}, {"event": p.GO_SUSPEND, "run": 0}]
    assert p.replay(journal, 0) == State.FORCED


def test_each_run_is_replayed_from_its_own_events():
    journal = [{"event": p.NOTICE, "run": 0}, {"event": p.GO_SUSPEND, "run": 0}, {"event": p.REQUEUE_ASKED, "run": 0},
               {"event": "start", "run": 1}, {"event": p.NOTICE, "run": 1}]
    assert [p.replay(journal, run) for run in (0, 1, 2)] == [State.REQUEUED, State.NOTIFIED, State.RUNNING]


def test_an_unknown_event_is_refused():
    with pytest.raises(p.ProtocolError, match="not an event"):
        p.step(State.RUNNING, "resume")


def test_every_event_of_the_protocol_is_journalled_by_the_code():
    """The names are the journal's: each is written somewhere (`.event("NAME"`, or a constant
    of this module that a component names: the batch driver journals what step_ended and
    failed_run judge), but commit_started, which no component journals yet."""
    source = "\n".join(f.read_text() for f in PACKAGE.rglob("*.py") if f.name != "protocol.py")
    written = set(re.findall(r'\.event\("([a-z_]+)"', source))
    written |= {getattr(p, name) for name in re.findall(r"protocol\.([A-Z_]+)\b", source)
                if isinstance(getattr(p, name, None), str)}
    assert set(p.EVENTS) - written == {p.COMMIT_STARTED}


def test_the_table_has_a_row_per_transition():
    rows = p.table().splitlines()[2:]
    assert len(rows) == len(p.TRANSITIONS)
    assert all(row.count("|") == 6 for row in rows)


# Who may ask Slurm for a requeue: the batch driver (a run of a job) and the part's task (a
# task of a job in place), each for its own; the policy daemon for its rules (yield, grow,
# force-requeue, requeue-failed: docs/policy.md); the backends that carry the call out.
REQUEUERS = {"runtime/batch.py", "runtime/part_task.py", "controller/daemon.py", "slurm/cli.py",
             "slurm/pyslurm_backend.py"}


def test_only_the_batch_driver_the_parts_task_and_the_daemon_requeue():
    found = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and n.func.attr.startswith("requeue") and n.func.attr != "requeued_when_batch_ends"]
        words = [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value == "requeue"
                 and path.parts[-2] == "runtime"]
        if calls or words:
            found.add(path.relative_to(PACKAGE).as_posix())
    assert found and found <= REQUEUERS, found - REQUEUERS
    assert {"runtime/batch.py", "runtime/part_task.py"} <= found


def test_the_design_doc_shows_the_table_of_the_code():
    design = (PACKAGE.parent / "docs" / "design.md").read_text()
    assert p.table() in design


def test_a_runs_end_is_judged_once_in_the_order_the_batch_driver_needs():
    assert p.step_ended(0, 3, "go_suspend") == p.SUPERSEDED  # a newer run owns the job, whatever this one did
    assert p.step_ended(1, None, "forced") == p.REQUEUE_ASKED
    assert p.step_ended(0, None, "go_suspend") == p.REQUEUE_ASKED
    assert p.step_ended(0, None, None) == p.FINISHED
    assert p.step_ended(137, None, None) is None  # Slurm's word first
    assert [p.failed_run(True, True), p.failed_run(False, True), p.failed_run(False, False)] == [
        p.KILLED, p.RETRY, p.FINISHED]


def test_what_follows_each_judgement_is_its_events_actions():
    assert Action.REQUEUE in p.actions_of(p.REQUEUE_ASKED) and Action.REQUEUE in p.actions_of(p.RETRY)
    assert p.actions_of(p.FINISHED) == (Action.SET_FINAL,)
    assert p.actions_of(p.KILLED) == p.actions_of(p.SUPERSEDED) == (Action.NOTHING,)


def test_every_event_acts_alike_from_every_state_that_takes_it():
    """What lets a component act on an event without replaying the journal (which a full
    disk may have cut short): the table's actions depend on the event alone."""
    for event in p.EVENTS:
        assert len({t.actions for t in p.TRANSITIONS if t.event == event}) == 1, event


def test_a_part_leaves_for_the_first_reason_that_holds():
    assert p.part_left(True, True, True, True) == "lighthouse_lost"
    assert p.part_left(False, True, True, True) == "time_limit"
    assert p.part_left(False, False, True, True) == "below_min"
    assert p.part_left(False, False, False, True) == "preempted"
    assert p.part_left(False, False, False, False) == "failed"
