"""The queue as slurm-hai reads it (squeue's text, a few fields) against `squeue --json` of
the same moment, on the live cluster of each Slurm version: the same jobs, field for field."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING

import pytest

from slurm_hai.slurm.cli import CliBackend
from slurm_hai.slurm.records import jobs_from_json
from waiting import wait_for

if TYPE_CHECKING:  # the fixtures come from tests/conftest.py
    from conftest import LiveCluster

pytestmark = pytest.mark.cluster

USER = "hai-alice"
# what a job name and comment may hold, the separators of other formats among it
ODD_NAME = "a b,c|d\"e'f%g~h\tz"
ODD_COMMENT = "x y,z\nsecond ~line~ (null)"


def test_the_queue_read_as_text_is_the_queue_as_json_field_for_field(live: LiveCluster, monkeypatch):
    for name in ("SLURM_CONF", "PATH"):  # the backend runs this cluster's commands
        monkeypatch.setenv(name, live.env[name])
    script = "#!/bin/sh\nsleep 300\n"
    jobs = {
        "odd": live.sbatch("--hold", f"--job-name={ODD_NAME}", f"--comment={ODD_COMMENT}", "-o", "/dev/null",
                           user=USER, script=script),
        "running": live.sbatch("-N", "2", "-o", "/dev/null", user=USER, script=script),
        "failed": live.sbatch("-o", "/dev/null", user=USER, script="#!/bin/sh\nexit 3\n"),
        "cancelled": live.sbatch("-o", "/dev/null", user=USER, script=script),
    }
    state = {name: lambda j=job: live.job(j).get("JobState") for name, job in jobs.items()}
    wait_for(lambda: state["running"]() == "RUNNING" and state["failed"]() == "FAILED"
             and state["cancelled"]() == "RUNNING", 60, "the jobs to start or end")
    live.run(["scancel", str(jobs["cancelled"])])
    wait_for(lambda: state["cancelled"]() == "CANCELLED", 30, "the cancel")

    text = {j.job_id: j for j in CliBackend().jobs() if j.job_id in jobs.values()}
    doc = json.loads(live.run(["squeue", "--json", "--states=all"]).stdout)
    as_json, problems = jobs_from_json(doc)
    assert problems == []
    by_id = {j.job_id: j for j in as_json}
    assert set(text) == set(jobs.values())
    for job_id, job in text.items():
        other = by_id[job_id]
        if job.end_time == 0 and other.end_time > other.start_time + 300 * 86400:  # no time limit: NONE
            other = replace(other, end_time=0)
        assert job == other
    odd, failed = text[jobs["odd"]], text[jobs["failed"]]
    assert (odd.name, odd.comment, odd.state, odd.reason) == (ODD_NAME, ODD_COMMENT, "PENDING", "JobHeldUser")
    assert (failed.state, failed.exit_code, text[jobs["running"]].num_nodes) == ("FAILED", 3, 2)
    # one job by id, and a user's jobs, as the commands ask for them
    assert CliBackend().job(jobs["odd"]) == odd
    assert {j.job_id for j in CliBackend().jobs(user=USER)} >= set(jobs.values())
    assert CliBackend().job(10**7) is None
