"""The part task's watch of the job's lighthouse (slurm_hai/runtime/part_task.py), with the
service's answers and Slurm faked: a new address ends the part once; a service that does not
answer ends nothing and is asked again only at the watch's pace."""

from __future__ import annotations

import threading

import pytest

from slurm_hai.runtime import part_task
from slurm_hai.runtime.parts import PartError


class Slurm:
    def __init__(self) -> None:
        self.cancels: list[tuple[int, str | None]] = []

    def cancel(self, job_id, signal=None):
        self.cancels.append((job_id, signal))


def watch(monkeypatch, answers, seconds: float = 0.3):
    """Run the watch with the service's `answers` (an address, or an exception) for `seconds`."""
    asked: list[int] = []

    def ask(service, job):
        asked.append(job)
        answer = answers[min(len(asked), len(answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(part_task, "ask", ask)
    monkeypatch.setattr(part_task, "LIGHTHOUSE_WATCH_EVERY", 0.05)
    slurm, lost, done = Slurm(), threading.Event(), threading.Event()
    t = threading.Thread(target=part_task._watch_lighthouse, args=("http://svc:1", 7, slurm, 71, lost, done))
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
