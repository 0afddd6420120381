"""A job's events.jsonl as its own commands read it (JobDir.events): whatever its user put
there, `hai status`, `hai list` and the job's own driver get the events or none, at once,
never a traceback, a hang or the whole of a huge file in memory."""

import os
import time

from slurm_hai.jobs.jobdir import JobDir


def test_lines_that_are_no_event_are_passed_over_and_a_fifo_or_a_link_is_none(tmp_path):
    d = JobDir(tmp_path / "1").create()
    d.event("start", run=0)
    with open(d.path / "events.jsonl", "a") as f:
        f.write("[" * 200_000 + "\n5\n" + '{"t": Infinity, "event": "x"}\n{"t": 1, "event": "x", "run": "y"}\n')
    d.event("suspended", run=0)
    assert [(e["event"], e["run"]) for e in d.events()] == [("start", 0), ("suspended", 0)]
    fifo = JobDir(tmp_path / "2").create()
    os.mkfifo(fifo.path / "events.jsonl")
    begun = time.monotonic()
    assert fifo.events() == [] and time.monotonic() - begun < 1
    link = JobDir(tmp_path / "3").create()
    (tmp_path / "elsewhere").write_text('{"t": 1, "event": "start"}\n')
    (link.path / "events.jsonl").symlink_to(tmp_path / "elsewhere")
    assert link.events() == []


def test_of_a_huge_file_its_last_part_is_read_whole_lines_only(tmp_path):
    d = JobDir(tmp_path / "4").create()
    d.event("start", run=0)
    with open(d.path / "events.jsonl", "r+b") as f:
        f.truncate(1 << 40)  # 1 TiB of zeros after the first event (sparse)
        f.seek(1 << 40)
        f.write(b"x" * 100 + b'\n{"t": 3, "event": "start", "run": 7}\n')
    events = d.events()
    assert [(e["event"], e["run"]) for e in events] == [("start", 7)]
