"""The record layer against what real Slurm daemons printed (tests/fixtures/slurm/<release>/,
recorded by tests/fixtures/slurm/record.py), and against shapes it must refuse in one line."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from slurm_hai.slurm.records import RecordError, jobs_from_json, jobs_from_text

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm"
RELEASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "expected.json").exists())
COMMANDS = {"squeue.json": "squeue --json", "scontrol.json": "scontrol show job --json", "sacct.json": "sacct --json"}


def recorded(release: str) -> tuple[dict[str, int], dict[str, dict]]:
    """Scenario -> job id, and command file -> {job id: JobInfo} for one release."""
    d = FIXTURES / release
    expected = json.loads((d / "expected.json").read_text())
    parsed = {}
    for name, command in COMMANDS.items():
        if (d / name).exists():
            jobs, problems = jobs_from_json(json.loads((d / name).read_text()), command)
            assert problems == []
            parsed[name] = {j.job_id: j for j in jobs}
    if (d / "squeue.txt").exists():
        jobs, problems = jobs_from_text((d / "squeue.txt").read_text(), expected["squeue_text_sep"])
        assert problems == []
        parsed["squeue.txt"] = {j.job_id: j for j in jobs}
    return expected["jobs"], parsed


def test_fixtures_cover_every_supported_release():
    assert {"22.05.8", "25.11.7", "26.05.3"} <= set(RELEASES)


@pytest.mark.parametrize("release", RELEASES)
def test_every_shape_says_what_slurm_saw(release):
    ids, parsed = recorded(release)
    for name, jobs in parsed.items():
        # slurmdbd of 23.11 had no record of an array's pending rest
        asked = {v for k, v in ids.items() if not (name == "sacct.json" and k == "array")}
        assert asked <= set(jobs), f"{release} {name} lacks some recorded jobs"
        done, failed, running = jobs[ids["completed"]], jobs[ids["failed"]], jobs[ids["running"]]
        if name == "sacct.json" and release.startswith("22.05."):  # see records.ACCOUNTING_V38
            assert (done.state, done.exit_code, failed.state, failed.exit_code) == ("COMPLETED", None, "FAILED", None)
        else:
            assert (done.state, done.exit_code, failed.state, failed.exit_code) == ("COMPLETED", 0, "FAILED", 3), name
        assert jobs[ids["cancelled"]].state == "CANCELLED", name
        assert running.state == "RUNNING" and running.num_nodes == 2 and running.node_list, name
        assert done.tags["hai-dir"] == "/tmp/rec", name  # the job comment (AccountingStoreFlags=job_comment)
        assert running.user == "root" and running.qos == "low" and running.account == "hai", name
        assert running.submit_time > 1_700_000_000 and running.start_time >= running.submit_time, name
        assert done.array_job_id == done.job_id, name  # a job of no array: its own id
        if name != "sacct.json":  # slurmdbd does not know holds and requeues while pending
            held, requeued = jobs[ids["held"]], jobs[ids["requeued"]]
            assert (held.state, held.reason, held.priority) == ("PENDING", "JobHeldUser", 0), name
            assert (requeued.state, requeued.restart_count) == ("PENDING", 1), name
            # a job array's task started with an id of its own; its place in line is the array's
            # (slurmdbd may learn of the task's start later: 23.11's had a pending "allocation")
            task, rest = jobs[ids["array_task"]], jobs[ids["array"]]  # rest: the task still to run
            assert (task.state, task.array_job_id, rest.state, rest.array_job_id) == (
                "RUNNING", ids["array"], "PENDING", ids["array"]) and task.job_id != ids["array"], name
            assert running.priority > 0 and running.batch_host, name
            # slurmdbd learns the comments of a running job only at its end
            assert running.tags["hai-chain"] == "7" and running.tags["hai-dir"] == "/tmp/rec", name


@pytest.mark.parametrize("release", [r for r in RELEASES if (FIXTURES / r / "squeue.txt").exists()])
def test_the_queue_as_text_is_the_queue_as_json(release):
    """What the backend reads (squeue's text) against squeue --json of the same moment: the
    same jobs, field for field, but for the end of a job without a time limit (text: NONE,
    read as 0; JSON: a year on) and the text's one-word state (here a base state)."""
    ids, parsed = recorded(release)
    text, as_json = parsed["squeue.txt"], parsed["squeue.json"]
    assert set(text) == set(ids.values()) <= set(as_json)
    assert (text[ids["odd"]].name, text[ids["odd"]].comment) == ("a b,c|d\"e'f%g", "x y,z\nsecond line")
    for job_id, job in text.items():
        other = as_json[job_id]
        if job.end_time == 0 and other.end_time > other.start_time + 300 * 86400:
            other = replace(other, end_time=0)
        assert job == other, release


def test_a_reread_queue_keeps_the_records_that_did_not_change():
    """The policy daemon's reads (`known`): an unchanged record is the same JobInfo as the
    last read's; a record with one field changed is read anew; a record gone is forgotten."""
    release = next(r for r in RELEASES if (FIXTURES / r / "squeue.txt").exists())
    sep = json.loads((FIXTURES / release / "expected.json").read_text())["squeue_text_sep"]
    text = (FIXTURES / release / "squeue.txt").read_text()
    known: dict = {}
    first, _ = jobs_from_text(text, sep, known=known)
    assert len(known) == len(first) > 2
    again, _ = jobs_from_text(text, sep, known=known)
    assert all(a is b for a, b in zip(first, again))
    records = text.split(sep + "\n")  # each record ends with its last field's separator and a newline
    job_id, _name, rest = records[0].split(sep, 2)
    records[0] = sep.join([job_id, "renamed", rest])  # the first job renamed, the second gone
    third, _ = jobs_from_text((sep + "\n").join(records[:1] + records[2:]), sep, known=known)
    assert third[0] is not first[0] and third[0] == replace(first[0], name="renamed")
    assert all(a is b for a, b in zip(first[2:], third[1:]))
    assert len(known) == len(first) - 1 and first[1] not in known.values()


@pytest.mark.parametrize("release", RELEASES)
def test_squeue_and_scontrol_give_the_same_job(release):
    _, parsed = recorded(release)
    if "scontrol.json" not in parsed:  # 22.05's scontrol has no --json
        assert release.startswith("22.")
        return
    for job_id, job in parsed["squeue.json"].items():
        assert parsed["scontrol.json"][job_id] == job


@pytest.mark.parametrize("release", RELEASES)
def test_accounting_agrees_with_the_queue_on_finished_jobs(release):
    ids, parsed = recorded(release)
    fields = ["job_id", "name", "user", "state", "qos", "partition", "node_list", "submit_time", "start_time",
              "end_time", "comment", "admin_comment", "account"]
    if not release.startswith("22.05."):  # see records.ACCOUNTING_V38
        fields.append("exit_code")
    for scenario in ("completed", "failed", "cancelled"):
        q, a = parsed["squeue.json"][ids[scenario]], parsed["sacct.json"][ids[scenario]]
        # slurmdbd keeps a cancelled job's signal on its batch step, not on the job
        for field in fields if scenario != "cancelled" else [f for f in fields if f != "exit_code"]:
            assert getattr(q, field) == getattr(a, field), (release, scenario, field)


def a_record(release: str) -> dict:
    return json.loads((FIXTURES / release / "squeue.json").read_text())


@pytest.mark.parametrize("release", RELEASES)
def test_an_unknown_shape_is_one_line_naming_version_and_field(release):
    doc = a_record(release)
    doc["jobs"][0]["node_count"] = ["two"]
    jobs, problems = jobs_from_json(doc)
    assert len(jobs) == len(doc["jobs"]) - 1  # the other jobs are still read
    (problem,) = problems
    text = str(problem)
    assert "\n" not in text and f"Slurm {release} squeue --json" in text and "node_count" in text


def test_a_record_without_its_state_is_refused():
    doc = a_record(RELEASES[-1])
    del doc["jobs"][0]["job_state"]
    _, (problem,) = jobs_from_json(doc)
    assert "has no field job_state" in str(problem)


@pytest.mark.parametrize("doc", [[], {"jobs": {}}, {"meta": 3}, "text"])
def test_a_document_without_jobs_is_refused(doc):
    with pytest.raises(RecordError, match="no job list"):
        jobs_from_json(doc)
