"""The part task (slurm_hai/runtime/part_task.py), with the service's answers and Slurm faked.
Its watch of the job's lighthouse: a new address ends the part once; a service that does not
answer ends nothing and is asked again only at the watch's pace. A part that leaves below
the job's MIN has its task requeued by the script; a part that fails on its own does not."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from slurm_hai.policy import tags
from slurm_hai.policy.limits import NOTICE_MARGIN
from slurm_hai.policy.model import parse_policy
from slurm_hai.runtime import part_task
from slurm_hai.runtime.parts import (EXIT_BELOW_MIN, EXIT_TIME_LIMIT, LEAVE_AT_ENV, MIN_ENV, SERVICE_ENV, TORCHFT_RUST_LOG,
                                     PartError)

LOCAL_POLICY = Path(__file__).resolve().parents[2] / "contrib" / "localcluster" / "policy.toml"


@pytest.fixture(autouse=True)
def kept_environment():
    """part_task.main exports its part's settings in this process's environment: undone."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


class Slurm:
    def __init__(self, step_rc: int = 0, comment: str = "", state: str = "RUNNING", limit: float = 0) -> None:
        self.state = state
        self.started = time.time()
        self.end = self.started + limit if limit else 0  # its time limit (0: none)
        self.cancels: list[tuple[int, str | None]] = []
        self.requeues: list[int] = []
        self.step_rc = step_rc
        self.comment = comment
        self.comment_tags: dict[str, str] = {}  # more tags of its record (its admin comment's)
        self.steps: list[tuple[list[str], dict[str, str]]] = []
        self.own_comment = "hai-dir=/home/u/.hai/jobs"  # what the task's comment says (its owner's)
        self.updates: list[tuple[str, dict[str, str]]] = []

    def cancel(self, job_id, signal=None):
        self.cancels.append((job_id, signal))

    def run_step(self, cmd, nodes, gpus, name):
        self.steps.append((cmd, {k: os.environ.get(k, "") for k in (SERVICE_ENV, MIN_ENV, LEAVE_AT_ENV, "RUST_LOG")}))
        return self.step_rc

    def job(self, job_id):  # this task's record: its tags and state; never preempted by Slurm
        return SimpleNamespace(tags={**({"hai-parts": self.comment} if self.comment else {}), **self.comment_tags},
                               start_time=self.started, comment=self.own_comment,
                               preempt_time=0, state=self.state, restart_count=0, end_time=self.end)

    def cancel_waiting_tasks(self, job_id):
        self.cancels.append((job_id, "waiting"))

    def requeued_when_batch_ends(self, job_id):
        return True  # 24.05 and later: for Slurm's own preemption only

    def requeue(self, job_id):
        self.requeues.append(job_id)

    def update_job(self, job_id, **fields):
        self.updates.append((job_id, fields))


def watch(monkeypatch, answers, seconds: float = 0.3):
    """Run the watch with the service's `answers` (an address, or an exception) for `seconds`."""
    asked: list[int] = []

    def ask(service, job, min_parts):
        assert min_parts == 2  # the job's MIN: the lighthouse is started with it if this ask is first
        asked.append(job)
        answer = answers[min(len(asked), len(answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(part_task, "ask", ask)
    monkeypatch.setattr(part_task, "LIGHTHOUSE_WATCH_EVERY", 0.05)
    slurm, lost, done = Slurm(), threading.Event(), threading.Event()
    t = threading.Thread(target=part_task._watch_lighthouse, args=("http://svc:1", 7, 2, slurm, "7_1", lost, done))
    t.start()
    t.join(seconds)
    done.set()
    t.join(5)
    return asked, slurm.cancels, lost.is_set()


def step_env(monkeypatch, tmp_path, slurm: Slurm, *argv: str) -> dict[str, str]:
    """The part task of a hai-submit job, with Slurm's record of its task `slurm`: the
    environment its part's step was given (Slurm.run_step's keys; "": unset)."""
    for key, value in {"SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "1", "SLURM_JOB_ID": "71",
                       "SLURM_RESTART_COUNT": "0", "HAI_PARTS_MIN": "2", "HAI_LIGHTHOUSE_SERVICE": "http://svc:1",
                       LEAVE_AT_ENV: "1"}.items():  # the last, a stale value of the submitter's environment
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("HAI_SUBMIT_TOKEN", raising=False)
    monkeypatch.setattr(part_task, "backend", lambda: slurm)
    monkeypatch.setattr(part_task, "ask", away)
    monkeypatch.setattr(part_task, "_output_to_rank_log", lambda jobdir, run, part: None)
    assert part_task.main([f"--job-dir={tmp_path / '7'}", *argv, "--", "python", "train.py"]) == 0
    ((_cmd, env),) = slurm.steps
    return env


def leave_time_given(monkeypatch, tmp_path, slurm: Slurm, *argv: str) -> str:
    """The time to leave at (LEAVE_AT_ENV) that the part's step was given ("": none)."""
    return step_env(monkeypatch, tmp_path, slurm, *argv)[LEAVE_AT_ENV]


@pytest.mark.parametrize("own", [None, "info"])
def test_a_parts_step_keeps_torchfts_info_lines_out_of_its_log_unless_the_job_asks_for_them(monkeypatch, tmp_path,
                                                                                            own):
    """RUST_LOG: read by torchft's Rust core as it is imported, in the part's process."""
    if own is None:
        monkeypatch.delenv("RUST_LOG", raising=False)
    else:
        monkeypatch.setenv("RUST_LOG", own)  # hai-submit -e RUST_LOG=info
    assert step_env(monkeypatch, tmp_path, Slurm())["RUST_LOG"] == (own or TORCHFT_RUST_LOG)


@pytest.mark.parametrize("limit", [600, 0])
def test_a_part_is_given_the_time_to_leave_the_notice_time_before_its_tasks_limit(monkeypatch, tmp_path, limit):
    """Not Slurm's --signal (at preemption it would come too), and no signal of the script's
    (it could come before the part's step, or kill a part still starting): the step's
    environment says when, `lead` s before the limit of Slurm's record of the task; nothing
    without a limit, whatever the submitter's environment held."""
    slurm = Slurm(limit=limit)
    given = leave_time_given(monkeypatch, tmp_path, slurm, "--notice-seconds=35")
    assert given == (str(slurm.end - 35) if limit else "")


@pytest.mark.parametrize("stamped, lead", [("hai-grace=20", 20 + NOTICE_MARGIN), ("", 5 + NOTICE_MARGIN),
                                            ("hai-grace=99999", 5 + NOTICE_MARGIN)])
def test_a_parts_time_to_leave_is_its_jobs_own_grace_before_the_limit(monkeypatch, tmp_path, stamped, lead):
    """Without --notice-seconds (a plain sbatch script): the grace job_submit.lua stamped on the
    task (its --hai-grace), else the policy's (also for a stamp the policy no longer allows),
    and the margin."""
    monkeypatch.setenv("HAI_POLICY", str(LOCAL_POLICY))  # grace_seconds 5, max_grace_seconds 60
    slurm = Slurm(limit=600)
    slurm.comment_tags = dict(t.split("=") for t in stamped.split()) if stamped else {}
    assert leave_time_given(monkeypatch, tmp_path, slurm) == str(slurm.end - lead)


def test_a_new_lighthouse_address_ends_the_part_once(monkeypatch):
    asked, cancels, lost = watch(monkeypatch, ["http://a:1", "http://a:1", "http://b:2"])
    assert lost and cancels == [("7_1", "TERM")] and len(asked) == 3 and set(asked) == {7}


def test_the_same_address_ends_nothing(monkeypatch):
    asked, cancels, lost = watch(monkeypatch, ["http://a:1"])
    assert not lost and not cancels and len(asked) >= 3


@pytest.mark.parametrize("first", [True, False])
def test_a_service_that_does_not_answer_ends_nothing_and_is_not_asked_in_a_loop(monkeypatch, first):
    away = PartError("http://svc:1: no lighthouse service there")
    asked, cancels, lost = watch(monkeypatch, [away] if first else ["http://a:1", away])
    assert not lost and not cancels
    assert 2 <= len(asked) <= 0.3 / 0.05 + 2  # at the watch's pace (a loop would ask thousands of times)


@pytest.mark.parametrize("rc, requeued, why", [(EXIT_BELOW_MIN, True, "below_min"), (EXIT_TIME_LIMIT, True, "time_limit"),
                                               (1, False, None)])
def test_a_part_that_leaves_below_min_or_at_its_time_limit_is_requeued_one_that_fails_is_not(monkeypatch, tmp_path, rc,
                                                                                               requeued, why):
    slurm = Slurm(step_rc=rc)
    monkeypatch.setattr(part_task, "backend", lambda: slurm)
    monkeypatch.setattr(part_task, "wait_to_be_requeued", lambda ending: 0)
    monkeypatch.setattr(part_task, "_output_to_rank_log", lambda jobdir, run, part: None)
    for key, value in {"SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "1", "SLURM_JOB_ID": "71",
                       "SLURM_RESTART_COUNT": "0", "HAI_PARTS_MIN": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HAI_LIGHTHOUSE_SERVICE", "http://svc:1")
    monkeypatch.setattr(part_task, "ask", away)
    monkeypatch.delenv("HAI_SUBMIT_TOKEN", raising=False)
    code = part_task.main([f"--job-dir={tmp_path / '7'}", "--", "python", "train.py"])
    assert slurm.requeues == (["7_1"] if requeued else [])
    assert code == (0 if requeued else rc)
    left = [e for e in map(json.loads, (tmp_path / "7" / "events.jsonl").read_text().splitlines())
            if e.get("event") == "left"]
    assert len(left) == 1 and left[0]["part"] == 1
    assert [k for k in ("below_min", "time_limit") if left[0].get(k) is True] == ([why] if why else [])
    # its task's own record says so (for the daemon's metrics), the task named as ARRAY_PART
    ((task, fields),) = slurm.updates
    said = tags.parse_left(tags.parse(fields["Comment"])[tags.LEFT])
    assert task == "7_1" and fields["Comment"].startswith("hai-dir=/home/u/.hai/jobs hai-left=")
    assert said is not None and (said.run, said.why) == (0, why or "failed") and abs(said.at - time.time()) < 60


def test_a_part_that_fails_on_its_own_is_requeued_while_the_job_has_retries_left(monkeypatch, tmp_path, capsys):
    # --retries 2 for the whole job: two failures of its parts are requeued (events `left` and
    # `retry`), the third ends its task; a part that Slurm ends (a cancel: this script gets
    # SIGTERM too, and Slurm's record is no longer RUNNING) spends none
    monkeypatch.setattr(part_task, "wait_to_be_requeued", lambda ending: 0)
    monkeypatch.setattr(part_task, "_output_to_rank_log", lambda jobdir, run, part: None)
    monkeypatch.setattr(part_task, "ask", away)
    monkeypatch.delenv("HAI_SUBMIT_TOKEN", raising=False)
    monkeypatch.setenv("HAI_LIGHTHOUSE_SERVICE", "http://svc:1")
    codes, requeued = [], []
    pytests = signal.getsignal(signal.SIGTERM)  # the part task sets its own; pytest gets its own back
    try:
        for task, cancelled in ((71, "SIGTERM"), (72, "in Slurm"), (73, ""), (74, ""), (71, "")):
            for key, value in {"SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": str(task - 71),
                               "SLURM_JOB_ID": str(task), "SLURM_RESTART_COUNT": "0", "HAI_PARTS_MIN": "1"}.items():
                monkeypatch.setenv(key, value)
            slurm = Slurm(step_rc=3, state="CANCELLED" if cancelled == "in Slurm" else "RUNNING")
            if cancelled == "SIGTERM":  # Slurm ends the task as its part fails: the script gets SIGTERM too
                slurm.run_step = lambda *a, slurm=slurm: (os.kill(os.getpid(), signal.SIGTERM), 3)[1]
            monkeypatch.setattr(part_task, "backend", lambda slurm=slurm: slurm)
            codes.append(part_task.main([f"--job-dir={tmp_path / '7'}", "--retries=2", "--", "python", "train.py"]))
            requeued.append(slurm.requeues)
    finally:
        signal.signal(signal.SIGTERM, pytests)
    assert codes == [3, 3, 0, 0, 3] and requeued == [[], [], ["7_2"], ["7_3"], []]  # the tasks, not their ids
    events = [json.loads(line) for line in (tmp_path / "7" / "events.jsonl").read_text().splitlines()]
    assert [(e["part"], e["retry"], e["of"]) for e in events if e["event"] == "retry"] == [(2, 1, 2), (3, 2, 2)]
    assert len([e for e in events if e["event"] == "left" and not e["preempted"]]) == 5
    assert (tmp_path / "7" / "retries_used").read_text() == "2"
    said = capsys.readouterr().out  # the part's log: what happened to it, no claim about the others
    assert said.count("no retry left: this part is over") == 1 and "train on" not in said, said


def away(service, job, min_parts):
    raise PartError("the service is away")


def plain_sbatch(monkeypatch, tmp_path, **env: str) -> None:
    """A task of a plain sbatch script: Slurm's variables only (and `env`); the policy names
    the lighthouse service; the user's job root under tmp_path."""
    for key in ("HAI_LIGHTHOUSE_SERVICE", "HAI_PARTS_MIN", "HAI_SUBMIT_TOKEN", "RUST_LOG"):
        monkeypatch.delenv(key, raising=False)
    for key, value in {"SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "1", "SLURM_JOB_ID": "71",
                       "SLURM_RESTART_COUNT": "0", "HAI_HOME": str(tmp_path), **env}.items():
        monkeypatch.setenv(key, value)
    policy = parse_policy({"elastic": {"lighthouse_service": "http://head:29600"}})
    monkeypatch.setattr(part_task, "find_policy", lambda: policy)
    monkeypatch.setattr(part_task, "ask", away)
    monkeypatch.setattr(part_task, "_output_to_rank_log", lambda jobdir, run, part: None)


def test_a_plain_sbatch_part_takes_the_policys_service_its_jobs_min_and_the_users_job_root(monkeypatch, tmp_path):
    plain_sbatch(monkeypatch, tmp_path)
    slurm = Slurm(comment="2:4")
    monkeypatch.setattr(part_task, "backend", lambda: slurm)
    assert part_task.main(["--", "python", "train.py"]) == 0
    # the part's step has what hai-submit's script exports
    assert slurm.steps == [(["python", "train.py"],
                            {SERVICE_ENV: "http://head:29600", MIN_ENV: "2", LEAVE_AT_ENV: "", "RUST_LOG": TORCHFT_RUST_LOG})]
    events = [json.loads(line) for line in (tmp_path / "jobs" / "7" / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e.get("part")) for e in events] == [("start", 1), ("finished", 1)]
    assert slurm.cancels == [(7, "waiting")]


@pytest.mark.parametrize("env, comment, policy_service, said", [
    ({"SLURM_ARRAY_JOB_ID": "", "SLURM_ARRAY_TASK_ID": ""}, "2:4", True, "a part runs as a task of a Slurm job array"),
    ({}, "", True, "job 7 is no elastic job in place: submit it with --comment=hai-parts=MIN:MAX"),
    ({}, "4:2", True, "job 7 is no elastic job in place"),
    ({}, "2:4", False, "no lighthouse service: set HAI_LIGHTHOUSE_SERVICE=http://HOST:PORT, or the policy's"),
    ({"HAI_PARTS_MIN": "0"}, "2:4", True, "HAI_PARTS_MIN='0': the fewest parts that train"),
])
def test_what_a_plain_sbatch_part_lacks_is_one_line_and_runs_nothing(monkeypatch, tmp_path, capsys, env, comment,
                                                                     policy_service, said):
    plain_sbatch(monkeypatch, tmp_path, **env)
    if not policy_service:
        monkeypatch.setattr(part_task, "find_policy", lambda: parse_policy({}))
    slurm = Slurm(comment=comment)
    monkeypatch.setattr(part_task, "backend", lambda: slurm)
    assert part_task.main(["--", "python", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"slurm-hai: {said}") and err.count("\n") == 1, err
    assert not slurm.steps and not (tmp_path / "jobs").exists()


def test_a_plain_sbatch_part_whose_record_slurm_does_not_give_says_so_in_one_line(monkeypatch, tmp_path, capsys):
    plain_sbatch(monkeypatch, tmp_path)
    slurm = Slurm(comment="2:4")
    slurm.job = lambda job_id: None  # slurmctld away, or the record gone
    monkeypatch.setattr(part_task, "backend", lambda: slurm)
    assert part_task.main(["--", "python", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err == ("slurm-hai: Slurm did not say what job 7 is (its `hai-parts` comment): set HAI_PARTS_MIN=MIN, "
                   "or run it again once slurmctld answers\n")
    assert not slurm.steps


def test_a_plain_sbatch_part_moves_aside_an_older_jobs_directory_under_its_reused_id(monkeypatch, tmp_path):
    """Slurm gives ids again after it lost its state: the directory of an older job 7, ended,
    is there when this array's first part starts. job_submit.lua's mark of the submission (its
    record's hai-submission) makes it this submission's directory: the part runs (an older
    final.json would have ended it at once, `rerun_skipped`), the older one is kept aside."""
    from slurm_hai.jobs.jobdir import JobDir

    old = JobDir(tmp_path / "7").create()
    old.set_final("succeeded", 0)
    old.event("start", run=0, part=1)
    slurm = Slurm()
    slurm.comment_tags = {"hai-submission": "1796523085.3.41"}
    step_env(monkeypatch, tmp_path, slurm)  # its step ran
    new = JobDir(tmp_path / "7")
    assert [e["event"] for e in new.events()][:1] == ["start"] and new.final()["state"] == "succeeded"
    assert len(new.events()) == 2  # this run's start and end, none of the older job's
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".stale-7-")]
