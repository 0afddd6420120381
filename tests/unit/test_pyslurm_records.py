"""pyslurm's value shapes -> JobInfo (records.PYSLURM, PYSLURM_DB): pure, no pyslurm needed.

The records below have the attribute names and value kinds pyslurm 25.11.2 gives (checked on
a live 25.11 cluster by tests/with_pyslurm/test_pyslurm_backend.py)."""

from __future__ import annotations

import pytest

from slurm_hai.slurm.records import (PYSLURM, PYSLURM_DB, RecordError, attributes, job_from_record, minutes_text,
                                     node_is_idle, pyslurm_exact)

RUNNING = {"id": 7, "name": "train", "user_name": "alice", "state": "RUNNING", "state_reason": "None",
           "qos": "high", "partition": "gpu", "num_nodes": 2, "allocated_nodes": "n[1-2]", "requeue_count": 0,
           "submit_time": 100, "start_time": 110, "eligible_time": 100, "priority": 31000000, "exit_code": 0,
           "exit_code_signal": 0, "batch_host": "n1", "comment": "hai-dir=/x", "admin_comment": "hai-level=HIGH",
           "account": "hai", "preempt_time": None, "end_time": 200}


def test_a_pyslurm_job_becomes_jobinfo():
    job = job_from_record(RUNNING, PYSLURM, "pyslurm")
    assert (job.job_id, job.state, job.num_nodes, job.node_list, job.preempt_time) == (7, "RUNNING", 2, "n[1-2]", 0)
    assert job.tags == {"hai-dir": "/x", "hai-level": "HIGH"} and job.exit_code == 0
    assert pyslurm_exact(job)


def test_pyslurm_unset_and_unlimited_values_read_as_zero_or_empty():
    held = {**RUNNING, "state": "PENDING", "state_reason": "JobHeldUser", "priority": 0, "allocated_nodes": None,
            "batch_host": None, "start_time": None, "num_nodes": None, "end_time": "UNLIMITED", "comment": None}
    job = job_from_record(held, PYSLURM, "pyslurm")
    assert (job.priority, job.node_list, job.batch_host, job.start_time, job.num_nodes, job.end_time,
            job.comment) == (0, "", "", 0, 0, 0, "")


def test_pyslurm_exit_codes_and_signals():
    assert job_from_record({**RUNNING, "exit_code": 3}, PYSLURM).exit_code == 3
    assert job_from_record({**RUNNING, "exit_code": 0, "exit_code_signal": 9}, PYSLURM).exit_code == 128 + 9
    assert job_from_record({**RUNNING, "exit_code": None, "exit_code_signal": None}, PYSLURM).exit_code is None


@pytest.mark.parametrize("state,reason,exact", [
    ("PENDING", "Priority", True), ("COMPLETING", "None", True), ("CONFIGURING", "None", True),
    ("REQUEUED", "None", True), ("PENDING", "ReqNodeNotAvail, UnavailableNodes:n1", False)])
def test_described_reasons_are_not_exact_one_word_states_are(state, reason, exact):
    assert pyslurm_exact(job_from_record({**RUNNING, "state": state, "state_reason": reason}, PYSLURM)) is exact


def test_a_pyslurm_record_of_another_shape_is_one_line():
    with pytest.raises(RecordError, match=r"^pyslurm 25.11.2: job 7 field state is a list, expected a job state"):
        job_from_record({**RUNNING, "state": ["RUNNING"]}, PYSLURM, "pyslurm 25.11.2")
    with pytest.raises(RecordError, match=r"job 7 field exit_code is text, expected a number"):
        job_from_record({**RUNNING, "exit_code": "x"}, PYSLURM, "pyslurm")
    with pytest.raises(RecordError, match="has no field id"):
        job_from_record({k: v for k, v in RUNNING.items() if k != "id"}, PYSLURM, "pyslurm")


def test_accounting_nodes_are_zero_for_a_job_that_never_started():
    rec = {"id": 5, "name": "x", "user_name": "bob", "state": "CANCELLED", "state_reason": "None", "qos": "low",
           "partition": "gpu", "num_nodes": 2, "start_time": None, "nodelist": "None assigned",
           "requeue_count": 0, "submit_time": 1, "eligible_time": 1, "priority": 0, "exit_code": 0,
           "exit_code_signal": 0, "comment": None, "admin_comment": None, "account": "hai", "end_time": 9}
    assert job_from_record(rec, PYSLURM_DB).num_nodes == 0
    assert job_from_record({**rec, "start_time": 5}, PYSLURM_DB).num_nodes == 2


def test_the_attributes_a_backend_reads():
    assert {"id", "allocated_nodes", "requeue_count", "exit_code", "exit_code_signal"} <= set(attributes(PYSLURM))
    assert {"id", "nodelist", "num_nodes", "start_time"} <= set(attributes(PYSLURM_DB))


@pytest.mark.parametrize("state,idle", [("IDLE", True), ("IDLE+CLOUD", True), ("IDLE+DRAIN", False),
                                        ("IDLE+NOT_RESPONDING", False), ("MIXED", False), ("ALLOCATED", False),
                                        ("IDLE+RESERVED", False), (None, False)])
def test_node_idle_as_sinfo_says(state, idle):
    assert node_is_idle(state) is idle


def test_minutes_as_scontrol_prints_them():
    assert [minutes_text(v) for v in (None, "UNLIMITED", 30, 1500)] == ["UNLIMITED", "UNLIMITED", "00:30:00",
                                                                       "1-01:00:00"]


@pytest.mark.parametrize("state,code,signal,exact", [
    ("FAILED", 3, 0, False),  # `exit 3` or `exit 131`: pyslurm cannot tell
    ("FAILED", 0, 0, False),  # `exit 128`
    ("CANCELLED", 0, 15, True), ("CANCELLED", 0, 0, True), ("COMPLETED", 0, 0, True), ("PENDING", 0, 0, True),
    ("FAILED", 0, 9, True), ("PENDING", 2, 0, False)])
def test_exit_codes_pyslurm_cannot_tell_apart_are_not_exact(state, code, signal, exact):
    rec = {**RUNNING, "state": state, "exit_code": code, "exit_code_signal": signal}
    assert pyslurm_exact(job_from_record(rec, PYSLURM)) is exact
