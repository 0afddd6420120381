"""The Slurm access layer without a cluster: parsing, backend choice, error messages."""

from __future__ import annotations

import json
import os

import pytest
from squeue_text import fake_squeue

from slurm_hai.slurm import SlurmError, backend
from slurm_hai.slurm import cli as cli_backend
from slurm_hai.slurm import squeue
from slurm_hai.slurm import pyslurm_backend
from slurm_hai.slurm.records import jobs_from_json

SQUEUE = {"jobs": [{
    "job_id": 7, "name": "train", "user_name": "alice", "job_state": "PENDING", "state_reason": "BeginTime",
    "qos": "high", "partition": "gpu", "node_count": 2, "nodes": "", "restart_cnt": 3, "submit_time": 100,
    "start_time": 0, "eligible_time": 110, "priority": 31000000, "exit_code": 15 << 8 | 0,
    "batch_host": "", "comment": "hai-dir=/home/alice/.hai/jobs", "admin_comment": "hai-level=HIGH",
    "account": "hai"}]}


def test_squeue_json_becomes_jobinfo():
    (job,), _ = jobs_from_json(SQUEUE)
    assert (job.job_id, job.user, job.state, job.restart_count, job.num_nodes) == (7, "alice", "PENDING", 3, 2)
    assert job.tags == {"hai-dir": "/home/alice/.hai/jobs", "hai-level": "HIGH"}
    assert job.exit_code == 15
    (killed,), _ = jobs_from_json({"jobs": [{**SQUEUE["jobs"][0], "exit_code": 9}]})
    assert killed.exit_code == 128 + 9  # killed by SIGKILL


def test_pyslurm_is_not_chosen_without_a_matching_pyslurm(monkeypatch):
    monkeypatch.setattr(pyslurm_backend, "why_not", lambda: "pyslurm is not installed")
    monkeypatch.setenv("HAI_SLURM_BACKEND", "auto")
    assert backend().name == "cli"
    monkeypatch.setenv("HAI_SLURM_BACKEND", "pyslurm")
    with pytest.raises(SlurmError, match="pyslurm is not installed; unset it"):
        backend()


def test_missing_slurm_commands_are_one_line_errors(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SlurmError, match=r"^squeue not found: install the Slurm client commands"):
        cli_backend.CliBackend().jobs()


def test_failed_command_message_is_one_line(tmp_path, monkeypatch):
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\necho 'scontrol: error: Invalid job id specified' >&2\necho second line >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SlurmError) as e:
        cli_backend.CliBackend().requeue(5)
    assert "\n" not in str(e.value) and "Invalid job id specified" in str(e.value)


def test_squeue_text_is_read_in_the_fields_and_with_the_separator_asked_for(tmp_path, monkeypatch):
    row = {"JobId": "7", "Name": "a~b,c\nd", "UserName": "alice", "State": "PENDING", "Reason": "BeginTime",
           "QOS": "high", "Partition": "gpu", "NumNodes": "2", "RestartCnt": "3", "SubmitTime": "100",
           "StartTime": "N/A", "EligibleTime": "110", "PriorityLong": "31000000", "exit_code": "15:0",
           "BatchHost": "n/a", "Comment": "hai-dir=/home/alice/.hai/jobs", "admin_comment": "hai-level=HIGH",
           "Account": "hai", "PreemptTime": "N/A", "EndTime": "NONE"}
    fake_squeue(tmp_path, [row, {**row, "JobId": "8", "UserName": "bob", "exit_code": "0:9"}])
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setenv("SQUEUE_USERS", "carol")  # a user's own squeue default: not slurm-hai's
    (job, other) = cli_backend.CliBackend().jobs()
    assert (job.job_id, job.name, job.user, job.state, job.restart_count, job.num_nodes) == (
        7, "a~b,c\nd", "alice", "PENDING", 3, 2)
    assert (job.submit_time, job.start_time, job.eligible_time, job.end_time, job.batch_host) == (100, 0, 110, 0, "")
    assert job.tags == {"hai-dir": "/home/alice/.hai/jobs", "hai-level": "HIGH"}
    assert (job.exit_code, other.exit_code) == (15, 128 + 9)  # 23.02+: CODE:SIGNAL


def test_squeue_asks_for_epoch_times_and_drops_the_users_squeue_defaults(monkeypatch):
    monkeypatch.setenv("SQUEUE_PARTITION", "debug")
    env = squeue.queue_env(os.environ)
    assert env["SLURM_TIME_FORMAT"] == "%s" and not [k for k in env if k.startswith("SQUEUE_")]
    argv = squeue.queue_argv("~x~", [3, 4], "alice")
    assert argv[-2:] == ["--jobs=3,4", "--user=alice"] and "--states=all" in argv
    for bad in ("", "a,b", "%j", "a\nb"):
        with pytest.raises(ValueError):
            squeue.queue_argv(bad)


def test_sbatch_refusal_reads_as_one_clean_line(tmp_path, monkeypatch):
    fake = tmp_path / "sbatch"
    fake.write_text("#!/bin/sh\necho 'sbatch: error: hai: 3 nodes at NORMAL exceed your quota of 2 nodes at that level' >&2\n"
                    "echo 'sbatch: error: Batch job submission failed: Unspecified error' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SlurmError) as e:
        cli_backend.CliBackend().submit("#!/bin/sh\n")
    assert str(e.value) == "sbatch: hai: 3 nodes at NORMAL exceed your quota of 2 nodes at that level"


def test_sacct_without_slurmdbd_reads_as_one_line_that_names_it(tmp_path, monkeypatch):
    fake = tmp_path / "sacct"  # what 22.05's sacct prints when slurmdbd is stopped
    fake.write_text("#!/bin/sh\n"
                    "echo 'sacct: error: slurm_persist_conn_open_without_init: failed to open persistent connection "
                    "to host:127.0.0.1:16901: Connection refused' >&2\n"
                    "echo 'sacct: error: Sending PersistInit msg: Connection refused' >&2\n"
                    "echo 'sacct: error: Problem talking to the database: Connection refused' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SlurmError) as e:
        cli_backend.CliBackend().accounting(5)
    assert str(e.value) == ("sacct: Slurm's accounting (slurmdbd) does not answer (Connection refused); running and "
                            "waiting jobs are not affected: try again once it is back")


def test_a_state_description_in_place_of_the_reason_gives_way_to_the_reasons_name(tmp_path, monkeypatch):
    """squeue prints a job's state description where its reason's name goes: one that starts
    with the name gives it; for one that names none (a job the requeue limit held, on 25.11)
    the job is read again as JSON, that job alone."""
    row = {"JobId": "7", "UserName": "alice", "State": "REQUEUE_HOLD", "NumNodes": "1", "RestartCnt": "5",
           "PriorityLong": "0", "Reason": "launch failure limit exceeded requeued held"}
    fake_squeue(tmp_path, [row, {**row, "JobId": "8", "State": "PENDING", "RestartCnt": "0",
                                 "Reason": "ReqNodeNotAvail, UnavailableNodes:n1"}])
    real = tmp_path / "squeue-text"
    (tmp_path / "squeue").rename(real)
    as_json = {"jobs": [{**SQUEUE["jobs"][0], "job_id": 7, "job_state": ["PENDING", "REQUEUE_HOLD"],
                         "state_reason": "JobHoldMaxRequeue", "restart_cnt": 5, "priority": 0}]}
    (tmp_path / "squeue.json").write_text(json.dumps(as_json))
    (tmp_path / "squeue").write_text(f'#!/bin/sh\ncase "$*" in *--json*) echo "$*" >> {tmp_path}/json-calls; '
                                     f'cat {tmp_path}/squeue.json;; *) exec {real} "$@";; esac\n')
    (tmp_path / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    held, unavailable = cli_backend.CliBackend().jobs()
    assert (held.state, held.reason, held.restart_count) == ("PENDING", "JobHoldMaxRequeue", 5)
    assert (unavailable.state, unavailable.reason) == ("PENDING", "ReqNodeNotAvail")
    assert (tmp_path / "json-calls").read_text().split() == ["--json", "--states=all", "--jobs=7"]
