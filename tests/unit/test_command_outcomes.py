"""Every `hai` and `hai-admin` command says only what happened (issue 34, item 3): no
"stopped" for a job that had ended, no exit 0 where nothing was done, a Slurm refusal
reported as one, not as a success. Each test is a row of docs/commands-audit.md.

A fake Backend (test_frontdoor_calls.RecordingBackend) over a small queue with job
directories; a cancel may change the world first, as a job ending on its own between the
command's read and Slurm's answer does on a real cluster.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

import slurm_hai.controller.apply
from slurm_hai.cli import admin, common, user
from slurm_hai.controller.apply import apply_changes
from slurm_hai.jobs.jobdir import JobDir
from slurm_hai.policy.ladder import Change
from slurm_hai.slurm import SlurmError
from test_frontdoor_calls import POLICY, RecordingBackend, slurm_job


class Cluster(RecordingBackend):
    """A cancel that first runs `before_cancel` (the world moving on), then may fail."""

    def __init__(self, queue) -> None:
        super().__init__(queue)
        self.before_cancel = lambda job_id, signal: None
        self.cancel_error: str | None = None

    def cancel(self, job_id, signal=None):
        super().cancel(job_id, signal)
        self.before_cancel(job_id, signal)
        if self.cancel_error:
            raise SlurmError(self.cancel_error)

    def set_state(self, job_id: int, state: str, **fields) -> None:
        self.queue = [dataclasses.replace(j, state=state, **fields) if j.job_id == job_id else j for j in self.queue]

    def cancels(self) -> list[tuple]:
        return [c[2:] for c in self.calls if c[1] == "cancel"]


@pytest.fixture
def world(monkeypatch, tmp_path):
    """My jobs 21 running, 22 waiting, 23 suspended (requeued), 25 ended (Slurm still has it),
    27 ended and forgotten by Slurm, 28 forgotten with no recorded end, 29 running without a
    directory (plain sbatch); 24 running, someone else's."""
    me = common.current_user()
    monkeypatch.setenv("HAI_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SLURM_CONF", raising=False)
    monkeypatch.setenv("HAI_POLICY", POLICY)
    for job_id in (21, 22, 23, 25, 27, 28):
        JobDir.for_job(job_id).create().event("submit", level="LOW", nodes=1)
    JobDir.for_job(21).event("start", run=0)
    JobDir.for_job(23).event("suspended", run=0, how="go_suspend")
    for job_id in (25, 27):
        JobDir.for_job(job_id).set_final("succeeded", 0)
    slurm = Cluster([slurm_job(21, me, "RUNNING"), slurm_job(22, me, "PENDING", reason="Priority"),
                     slurm_job(23, me, "PENDING", reason="Priority", restarts=1),
                     slurm_job(24, "someone-else", "RUNNING", root=str(tmp_path / "theirs")),
                     slurm_job(25, me, "COMPLETED"), slurm_job(29, me, "RUNNING")])
    monkeypatch.setattr(common, "slurm_backend", lambda: slurm)
    monkeypatch.setattr(user, "may_read", lambda j: j is None or j.user == me)  # as a non-root user
    return slurm


def hai(*argv: str):
    return CliRunner().invoke(user.main, list(argv))


def events(job_id: int) -> list[str]:
    return [e["event"] for e in JobDir.for_job(job_id).events()]


def final(job_id: int) -> str | None:
    end = JobDir.for_job(job_id).final()
    return end["state"] if end else None


def error_line(r) -> str:
    """The one `Error: ...` line of a refused command, after checking it is one, exit 1."""
    assert r.exit_code == 1, (r.exit_code, r.stdout, r.stderr)
    assert r.stdout == "" and r.stderr.count("\n") == 1 and r.stderr.startswith("Error: "), r.stderr
    return r.stderr


# ---------------------------------------------------------------- hai stop


@pytest.mark.parametrize("job_id", [21, 22, 23, 29], ids=["running", "waiting", "suspended", "no-directory"])
def test_stop_of_a_live_job_cancels_it_and_says_stopped(world, job_id):
    r = hai("stop", str(job_id))
    assert r.exit_code == 0 and r.stdout == f"job {job_id} stopped\n", r.stderr
    assert world.cancels() == [(job_id, None)]
    if job_id != 29:
        assert final(job_id) == "stopped" and events(job_id)[-1] == "stop"


@pytest.mark.parametrize("job_id, said", [
    (25, "job 25 has already ended (finished-succeeded): nothing to stop"),
    (27, "job 27 has already ended (finished-succeeded): nothing to stop"),
    (28, "Slurm no longer knows job 28: nothing to stop"),
], ids=["ended", "ended-and-forgotten", "forgotten"])
def test_stop_of_a_job_that_has_ended_cancels_nothing_and_exits_1(world, job_id, said):
    before = final(job_id)
    r = hai("stop", "--json", str(job_id))
    assert said in error_line(r)
    assert world.cancels() == [] and final(job_id) == before and "stop" not in events(job_id)


def test_a_second_stop_says_the_job_was_stopped_already(world):
    assert hai("stop", "22").exit_code == 0
    world.set_state(22, "CANCELLED")
    assert "job 22 has already ended (finished-stopped): nothing to stop" in error_line(hai("stop", "22"))
    assert world.cancels() == [(22, None)]


def test_stop_of_a_job_that_ends_on_its_own_before_the_cancel_keeps_its_end(world):
    def job_ends(job_id, signal):  # its batch script records the end, Slurm takes the cancel without a word
        JobDir.for_job(job_id).set_final("succeeded", 0)
        world.set_state(job_id, "COMPLETED")

    world.before_cancel = job_ends
    said = error_line(hai("stop", "21"))
    assert "job 21 ended on its own (finished-succeeded) before the stop reached it: nothing stopped" in said
    assert final(21) == "succeeded" and "stop" not in events(21)


def test_stop_of_a_job_without_a_directory_that_ends_first_is_told_from_slurm(world):
    world.before_cancel = lambda job_id, signal: world.set_state(job_id, "FAILED")
    assert "job 29 ended on its own (finished-failed)" in error_line(hai("stop", "29"))


def test_stop_of_a_job_slurm_forgets_at_once_was_not_stopped_by_it(world):
    world.before_cancel = lambda job_id, signal: setattr(world, "queue", [j for j in world.queue if j.job_id != 29])
    assert "job 29 ended on its own (Slurm no longer knows it)" in error_line(hai("stop", "29"))


def test_stop_taken_by_slurm_is_stopped_even_if_slurm_does_not_answer_the_read_after(world, monkeypatch):
    def down(job_id):
        raise SlurmError("squeue: Socket timed out on send/recv operation")

    world.before_cancel = lambda job_id, signal: monkeypatch.setattr(world, "job", down)
    r = hai("stop", "29")
    assert r.exit_code == 0 and r.stdout == "job 29 stopped\n", r.stderr


def test_stop_that_slurm_refuses_is_slurms_line_and_records_nothing(world):
    world.cancel_error = "scancel: Unable to contact slurm controller (connect failure)"
    assert "Unable to contact slurm controller" in error_line(hai("stop", "21"))
    assert final(21) is None and "stop" not in events(21)


def test_stop_refused_because_the_job_just_ended_says_so(world):
    world.cancel_error = "Job/step already completing or completed"  # pyslurm's cancel of an ended job
    world.before_cancel = lambda job_id, signal: world.set_state(job_id, "COMPLETED")
    assert "job 21 ended before the stop reached it: nothing stopped" in error_line(hai("stop", "21"))
    assert final(21) is None


def test_stop_of_another_users_job_reaches_no_slurm_write(world, monkeypatch):
    monkeypatch.setattr(os, "getuid", lambda: pwd.getpwnam("nobody").pw_uid)  # not root
    assert "job 24 belongs to someone-else" in error_line(hai("stop", "24"))
    assert world.cancels() == []


# ---------------------------------------------------------------- hai suspend


def test_suspend_of_a_running_job_sends_the_notice_and_records_the_request(world):
    r = hai("suspend", "--json", "21")
    assert r.exit_code == 0 and json.loads(r.stdout) == {"job_id": 21, "notice_sent": True}, r.stderr
    assert world.cancels() == [(21, "USR2")] and events(21)[-1] == "suspend_requested"


def test_a_second_suspend_of_a_run_that_has_its_notice_sends_nothing_and_exits_1(world):
    assert hai("suspend", "21").exit_code == 0
    said = error_line(hai("suspend", "21"))
    assert "job 21 has had its suspend notice since" in said and "no second notice sent" in said
    assert world.cancels() == [(21, "USR2")]
    JobDir.for_job(21).event("suspend_request_failed", by=0, run=0)  # the first did not reach it: another may
    assert hai("suspend", "21").exit_code == 0 and len(world.cancels()) == 2
    JobDir.for_job(21).event("notice", run=0, cause="preempted")  # the launcher heard one (the daemon's)
    assert "no second notice sent" in error_line(hai("suspend", "21"))
    world.set_state(21, "RUNNING", restart_count=1)  # the next run has had none
    assert hai("suspend", "21").exit_code == 0 and len(world.cancels()) == 3


@pytest.mark.parametrize("job_id, state", [(22, "waiting"), (23, "suspended"), (25, "finished-succeeded"),
                                           (27, "finished-succeeded"), (28, "unknown")])
def test_suspend_of_a_job_that_does_not_run_sends_nothing(world, job_id, state):
    said = error_line(hai("suspend", str(job_id)))
    assert f"job {job_id} is {state}, not running; only a running job can be suspended" in said
    assert world.cancels() == [] and "suspend_requested" not in events(job_id)


def test_suspend_of_a_job_whose_end_is_recorded_while_slurm_still_runs_it_sends_nothing(world):
    JobDir.for_job(21).set_final("succeeded", 0)  # its batch script is on its way out
    assert "job 21 is finished-succeeded, not running" in error_line(hai("suspend", "21"))
    assert world.cancels() == []


def test_suspend_of_a_job_still_starting_sends_nothing(world):
    world.set_state(21, "CONFIGURING")
    assert "job 21 is starting (its nodes are being set up), not running" in error_line(hai("suspend", "21"))
    assert world.cancels() == []


def test_suspend_of_a_job_that_ends_before_the_notice_says_no_notice_was_sent(world):
    world.cancel_error = "scancel: Kill job error on job id 21: Job/step already completing or completed"
    world.before_cancel = lambda job_id, signal: (JobDir.for_job(job_id).set_final("succeeded", 0),
                                                  world.set_state(job_id, "COMPLETED"))
    said = error_line(hai("suspend", "21"))
    assert "job 21 is finished-succeeded now, not running: no suspend notice sent" in said
    assert events(21)[-2:] == ["suspend_requested", "suspend_request_failed"]


def test_suspend_of_a_job_requeued_before_the_notice_says_it_is_suspended(world):
    world.cancel_error = "scancel: Kill job error on job id 21: Job is pending execution"
    world.before_cancel = lambda job_id, signal: world.set_state(job_id, "PENDING", restart_count=1)
    assert "job 21 is suspended now, not running: no suspend notice sent" in error_line(hai("suspend", "21"))


def test_suspend_that_slurm_refuses_while_the_job_runs_is_slurms_line(world):
    world.cancel_error = "scancel: Access/permission denied"
    said = error_line(hai("suspend", "21"))
    assert "Access/permission denied" in said and "not running" not in said
    assert events(21)[-1] == "suspend_request_failed"


def test_suspend_of_another_users_job_reaches_no_slurm_write(world, monkeypatch):
    monkeypatch.setattr(os, "getuid", lambda: pwd.getpwnam("nobody").pw_uid)  # not root
    assert "job 24 belongs to someone-else" in error_line(hai("suspend", "24"))
    assert world.cancels() == []


# ---------------------------------------------------------------- hai: reads


def test_a_read_command_over_a_slurm_that_does_not_answer_is_one_line_exit_1(world, monkeypatch):
    def down(*args, **kwargs):
        raise SlurmError("squeue: Unable to contact slurm controller (connect failure)")

    monkeypatch.setattr(world, "jobs", down)
    monkeypatch.setattr(world, "job", down)
    for argv in (["status", "21"], ["list"], ["logs", "21"], ["quota"]):
        assert "Unable to contact slurm controller" in error_line(hai(*argv)), argv


def test_logs_of_a_job_with_no_output_yet_says_so_and_exits_1(world):
    assert "no output yet for job 22 rank 0" in error_line(hai("logs", "22"))
    r = hai("logs", "--json", "22")  # for scripts: an empty list of runs, which is what there is
    assert r.exit_code == 0 and json.loads(r.stdout)["runs"] == []


def test_a_job_that_ended_before_its_ranks_started_is_told_by_its_batch_scripts_last_line(world):
    """An interpreter the nodes cannot see: the batch script's exec fails (exit 127) before
    the batch driver can record anything; status and logs quote what the script said."""
    world.set_state(22, "FAILED", exit_code=127, reason="NonZeroExitCode")
    said = "/var/spool/slurmd/job00022/slurm_script: line 40: /home/me/venv/bin/python3: No such file or directory"
    (JobDir.for_job(22).path.parent / "batch-22.log").write_text(f"{said}\n")
    st = json.loads(hai("status", "--json", "22").stdout)
    assert st["state"] == "finished-failed"
    assert st["reason"] == f"exit code 127; before it started, its batch script said: {said}"
    line = error_line(hai("logs", "22"))
    assert f"job 22 ended before it started on rank 0; its batch script said: {said}" in line
    assert "batch-22.log" in line
    JobDir.for_job(22).event("start", run=0)  # a job that started: its ranks' logs say the rest
    assert "no output yet for job 22 rank 0" in error_line(hai("logs", "22"))
    assert "batch script said" not in json.loads(hai("status", "--json", "22").stdout)["reason"]


def test_status_of_a_parts_task_id_is_the_status_of_its_job_in_place(world):
    parts = dict(comment=f"hai-dir={JobDir.for_job(0).path.parent};hai-parts=1:2", array_job_id=40)
    me = common.current_user()
    world.queue += [dataclasses.replace(slurm_job(40, me, "RUNNING"), **parts),
                    dataclasses.replace(slurm_job(41, me, "RUNNING"), **parts)]  # task 1 started: an id of its own
    JobDir.for_job(40).create().event("submit", level="LOW", nodes=1, node_range="1:2")
    r = CliRunner().invoke(user.main, ["status", "--json", "41"])
    assert r.exit_code == 0 and json.loads(r.stdout)["job_id"] == 40, (r.stdout, r.stderr)
    assert r.stderr == "job 41 is a part of job 40, an elastic job in place: its status\n"
    assert hai("status", "--json", "40").exit_code == 0


def test_logs_of_a_parts_task_id_are_the_logs_of_its_job_in_place(world):
    parts = dict(comment=f"hai-dir={JobDir.for_job(0).path.parent};hai-parts=1:2", array_job_id=40)
    me = common.current_user()
    world.queue += [dataclasses.replace(slurm_job(40, me, "RUNNING"), **parts),
                    dataclasses.replace(slurm_job(41, me, "RUNNING"), **parts)]
    JobDir.for_job(40).create().event("submit", level="LOW", nodes=1, node_range="1:2")
    (JobDir.for_job(40).path / "job.json").write_text(json.dumps({"parts": 2}))
    JobDir.for_job(40).rank_log(1).write_text("==== slurm-hai run 0\npart 1 says hello\n")
    r = CliRunner().invoke(user.main, ["logs", "41", "--rank", "1"])
    assert r.exit_code == 0 and r.stdout.endswith("part 1 says hello\n"), (r.stdout, r.stderr)
    assert r.stderr == "job 41 is a part of job 40, an elastic job in place: its logs (--rank P: part P's)\n"


@pytest.mark.parametrize("action", ["stop", "suspend"])
def test_stop_or_suspend_of_a_parts_task_id_names_the_job_in_place_and_sends_nothing(world, action):
    parts = dict(comment=f"hai-dir={JobDir.for_job(0).path.parent};hai-parts=1:2", array_job_id=40)
    me = common.current_user()
    world.queue += [dataclasses.replace(slurm_job(40, me, "RUNNING"), **parts),
                    dataclasses.replace(slurm_job(41, me, "RUNNING"), **parts)]
    JobDir.for_job(40).create().event("submit", level="LOW", nodes=1, node_range="1:2")
    said = error_line(hai(action, "41"))
    assert f"job 41 is a part of job 40, an elastic job in place: `hai {action} 40` {action}s it, all its parts" \
        in said, said
    assert world.cancels() == []


def test_status_of_a_job_nobody_knows_exits_1(world):
    assert "no job 99: Slurm does not know it" in error_line(hai("status", "99"))


def test_status_of_a_job_slurm_forgot_without_a_recorded_end_says_unknown_not_finished(world):
    r = hai("status", "--json", "28")
    st = json.loads(r.stdout)
    assert r.exit_code == 0 and (st["state"], st["reason"]) == ("unknown", "Slurm no longer knows this job")


def test_list_with_no_jobs_prints_the_header_alone(world):
    world.queue = []
    r = hai("list")
    assert r.exit_code == 0 and r.stdout.split() == ["JOB", "NAME", "USER", "STATE", "LEVEL", "NODES", "RESTARTS",
                                                     "SUBMITTED", "STARTED", "ENDED", "REASON"]


# ---------------------------------------------------------------- hai-admin


def test_apply_reports_each_change_once_it_is_made_so_a_failure_is_not_shown_as_done():
    made, reported = [], []
    changes = [Change("modify", "qos", where={"name": n}, settings={"Priority": "1"}, why=n) for n in "abc"]

    class Slurm:
        def apply(self, change):
            if change.why == "b":
                raise SlurmError("sacctmgr: Unknown QOS b")
            made.append(change.why)

    with pytest.raises(SlurmError):
        apply_changes(Slurm(), changes, lambda c: reported.append(c.why))
    assert made == reported == ["a"]


def _admin(*argv: str):
    return CliRunner().invoke(admin.main, list(argv))


def test_apply_that_fails_midway_says_how_many_changes_were_made(monkeypatch):
    changes = [Change("modify", "qos", where={"name": n}, settings={"Priority": "1"}, why=f"{n}: Priority")
               for n in ("low", "high")]

    def apply_policy(policy, backend, partitions, report, record, adopt):
        report(changes[0])
        raise SlurmError("sacctmgr: Unknown QOS high")

    monkeypatch.setattr(admin, "_plan", lambda policy, partitions: ([], None))
    monkeypatch.setattr(admin, "backend", lambda **_: None)
    monkeypatch.setattr(slurm_hai.controller.apply, "apply_policy", apply_policy)
    r = _admin("apply", "--policy", POLICY)
    assert r.exit_code == 1 and r.stdout.count("\n") == 1 and "name=low" in r.stdout and "high" not in r.stdout
    assert r.stderr == ("Error: sacctmgr: Unknown QOS high; 1 change(s) were made before it (above): "
                        "`hai-admin plan` shows what is left\n")
    assert "change(s) applied" not in r.stdout


@pytest.mark.parametrize("command", ["plan", "apply"])
def test_remove_without_an_install_record_says_there_is_none_not_that_nothing_is_left(monkeypatch, tmp_path,
                                                                                     command):
    monkeypatch.setattr(slurm_hai.controller.apply, "remove_policy", lambda *a, **kw: [])
    monkeypatch.setattr(admin, "backend", lambda **_: None)
    record = tmp_path / "hai-install.json"
    r = _admin(command, "--remove", "--record", str(record))
    assert r.exit_code == 0 and r.stdout == (f"no change: there is no install record at {record}, so nothing of "
                                             "slurm-hai is known to take out (--record FILE names another)\n")
    record.write_text("{}")
    r = _admin(command, "--remove", "--record", str(record))
    assert r.exit_code == 0 and r.stdout == "no change: nothing of slurm-hai is left to take out\n"


def test_daemon_once_exits_1_when_an_action_failed(tmp_path, monkeypatch):
    from slurm_hai.controller import daemon

    class Result:
        jobs, actions, failed, seconds, look_at = 1, ["release"], 1, 0.0, None

    monkeypatch.setattr(daemon.PolicyDaemon, "cycle", lambda self: Result())
    monkeypatch.setattr(admin, "backend", lambda **_: None)
    r = _admin("daemon", "--policy", POLICY, "--once", "--lock", str(tmp_path / "l.lock"))
    assert r.exit_code == 1, (r.stdout, r.stderr)
    Result.failed = 0
    assert _admin("daemon", "--policy", POLICY, "--once", "--lock", str(tmp_path / "l.lock")).exit_code == 0


def test_explain_of_a_job_not_in_the_queue_exits_1(world, monkeypatch):
    monkeypatch.setattr(admin, "backend", lambda **_: world)
    assert "no such job in the queue: 99" in error_line(_admin("explain", "--policy", POLICY, "21", "99"))
    r = _admin("explain", "--policy", POLICY, "21")
    assert r.exit_code == 0 and r.stdout.split()[:2] == ["21", common.current_user()]
    world.queue = []  # an empty queue: said, not a blank answer
    r = _admin("explain", "--policy", POLICY)
    assert r.exit_code == 0 and r.stdout == "no job is waiting or running: nothing to explain\n"


def test_an_unreadable_policy_is_one_line_exit_1(tmp_path):
    bad = tmp_path / "policy.toml"
    bad.write_text("[levels]\nHIGH = 'x'\n")
    assert str(bad) in error_line(_admin("check", "--policy", str(bad)))


def test_the_docs_table_names_only_tests_that_exist():
    table = (Path(__file__).resolve().parents[2] / "docs" / "commands-audit.md").read_text()
    here = Path(__file__).resolve().parent
    for name in sorted(set(re.findall(r"`(test_\w+)`", table))):
        found = [p for p in (*here.glob("test_*.py"), *here.parent.glob("cluster/test_*.py"))
                 if f"def {name}(" in p.read_text()]
        assert found, f"docs/commands-audit.md names {name}, which no test defines"
