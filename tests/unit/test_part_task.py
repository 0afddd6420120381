"""The part task (slurm_hai/runtime/part_task.py), with the service's answers and Slurm faked.
Its watch of the job's lighthouse: a new address ends the part once; a service that does not
answer ends nothing and is asked again only at the watch's pace. A part that leaves below
the job's MIN has its task requeued by the script; a part that fails on its own does not."""

from __future__ import annotations

import json
import threading

import pytest

from slurm_hai.runtime import part_task
from slurm_hai.runtime.parts import EXIT_BELOW_MIN, PartError


class Slurm:
    def __init__(self, step_rc: int = 0) -> None:
        self.cancels: list[tuple[int, str | None]] = []
        self.requeues: list[int] = []
        self.step_rc = step_rc

    def cancel(self, job_id, signal=None):
        self.cancels.append((job_id, signal))

    def run_step(self, cmd, nodes, gpus, name):
        return self.step_rc

    def job(self, job_id):
        return None  # not preempted by Slurm

    def requeued_when_batch_ends(self, job_id):
        return True  # 24.05 and later: for Slurm's own preemption only

    def requeue(self, job_id):
        self.requeues.append(job_id)


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
    t = threading.Thread(target=part_task._watch_lighthouse, args=("http://svc:1", 7, 2, slurm, 71, lost, done))
    t.start()
    t.join(seconds)
    done.set()
    t.join(5)
    return asked, slurm.cancels, lost.is_set()


def test_a_new_lighthouse_address_ends_the_part_once(monkeypatch):
    asked, cancels, lost = watch(monkeypatch, ["http://a:1", "http://a:1", "http://b:2"])
    assert lost and cancels == [(71, "TERM")] and len(asked) == 3 and set(asked) == {7}


def test_the_same_address_ends_nothing(monkeypatch):
    asked, cancels, lost = watch(monkeypatch, ["http://a:1"])
    assert not lost and not cancels and len(asked) >= 3


@pytest.mark.parametrize("first", [True, False])
def test_a_service_that_does_not_answer_ends_nothing_and_is_not_asked_in_a_loop(monkeypatch, first):
    away = PartError("http://svc:1: no lighthouse service there")
    asked, cancels, lost = watch(monkeypatch, [away] if first else ["http://a:1", away])
    assert not lost and not cancels
    assert 2 <= len(asked) <= 0.3 / 0.05 + 2  # at the watch's pace (a loop would ask thousands of times)


@pytest.mark.parametrize("rc, requeued", [(EXIT_BELOW_MIN, True), (1, False)])
def test_a_part_that_leaves_below_min_is_requeued_one_that_fails_is_not(monkeypatch, tmp_path, rc, requeued):
    slurm = Slurm(step_rc=rc)
    monkeypatch.setattr(part_task, "backend", lambda: slurm)
    monkeypatch.setattr(part_task, "wait_to_be_requeued", lambda ending: 0)
    monkeypatch.setattr(part_task, "_output_to_rank_log", lambda jobdir, run, part: None)
    for key, value in {"SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "1", "SLURM_JOB_ID": "71",
                       "SLURM_RESTART_COUNT": "0", "HAI_PARTS_MIN": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("HAI_LIGHTHOUSE_SERVICE", raising=False)
    monkeypatch.delenv("HAI_SUBMIT_TOKEN", raising=False)
    code = part_task.main([f"--job-dir={tmp_path / '7'}", "--", "python", "train.py"])
    assert slurm.requeues == ([71] if requeued else [])
    assert code == (0 if requeued else rc)
    left = [e for e in map(json.loads, (tmp_path / "7" / "events.jsonl").read_text().splitlines())
            if e.get("event") == "left"]
    assert len(left) == 1 and left[0]["part"] == 1 and left[0].get("below_min", False) == requeued
