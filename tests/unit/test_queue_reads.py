"""No command reads the queue as JSON: the commands backend over a fake squeue that answers in
the format it is asked for (what Slurm 22.05.8 printed, tests/fixtures/slurm) and writes down
every argv. `squeue --json` costs squeue and slurmctld 10-20x the text at 10,000 jobs
(docs/results-archive.md); sacct --json stays, for history only."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_hai.cli import admin, common, user
from slurm_hai.controller.daemon import PolicyDaemon
from slurm_hai.policy.model import load_policy
from slurm_hai.slurm.cli import CliBackend
from squeue_text import FIXTURES, fake_squeue, recorded_rows

POLICY = Path(__file__).resolve().parents[2] / "contrib" / "localcluster" / "policy.toml"
IDS = json.loads((FIXTURES / "22.05.8" / "expected.json").read_text())["jobs"]


@pytest.fixture
def squeue_calls(tmp_path, monkeypatch):
    """The argv of every squeue run under the test, in order."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_squeue(bin_dir, recorded_rows("22.05.8"))
    for name, body in {"sinfo": "echo 'gpu idle 0'", "scontrol": "exit 0", "sacct": "exit 1"}.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("HAI_SLURM_BACKEND", "cli")
    monkeypatch.setenv("HAI_POLICY", str(POLICY))
    monkeypatch.setenv("HAI_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(common, "slurm_backend", CliBackend)

    def calls() -> list[list[str]]:
        path = bin_dir / "squeue-calls"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return calls


@pytest.mark.parametrize("main,argv", [
    (user.main, ["list"]), (user.main, ["list", "--all", "--json"]), (user.main, ["status"]),
    (user.main, ["status", str(IDS["held"])]), (user.main, ["status", str(IDS["running"])]),
    (user.main, ["logs", str(IDS["running"])]), (user.main, ["quota"]),
    (admin.main, ["explain"]), (admin.main, ["explain", str(IDS["held"])]),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_no_command_reads_the_queue_as_json(squeue_calls, main, argv):
    r = CliRunner().invoke(main, argv)
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    calls = squeue_calls()
    assert calls, "the command read no queue"
    assert not [c for c in calls if any(a.startswith("--json") for a in c)], calls


def test_the_daemon_cycle_and_the_agents_read_the_queue_as_text(squeue_calls):
    PolicyDaemon(CliBackend(), policy=load_policy(POLICY), dry_run=True).cycle()
    (cycle,) = squeue_calls()
    assert not [a for a in cycle if a.startswith("--json") or a.startswith("--jobs")], cycle
    # a node's agent asks about each job it holds memory for alone: one job, one cheap RPC
    assert admin._jobs_over([IDS["running"], IDS["completed"], 10**7]) == {IDS["completed"], 10**7}
    asked = squeue_calls()[1:]
    assert sorted(a for c in asked for a in c if a.startswith("--jobs=")) == sorted(
        f"--jobs={j}" for j in (IDS["running"], IDS["completed"], 10**7))
    assert not [c for c in asked if "--json" in c]


@pytest.mark.parametrize("argv", [["list"], ["list", "--all"], ["list", "--json"],
                                  ["status", str(IDS["held"])], ["status", str(IDS["running"]), "--json"],
                                  ["logs", str(IDS["running"])]], ids=" ".join)
def test_hai_reads_ahead_the_queue_its_command_asks_first_and_nothing_twice(squeue_calls, monkeypatch, argv):
    """`hai` starts the squeue its command makes first before loading the command; the
    backend takes that read instead of starting its own: the same squeue calls, the same
    output as a run without the read ahead."""
    from slurm_hai.cli import front as hai
    from slurm_hai.slurm import squeue

    plain = CliRunner().invoke(user.main, argv)
    plain_calls = squeue_calls()
    first = hai.first_read(argv)
    assert first is not None
    squeue.start_ahead(*first)
    (started,) = squeue._ahead.values()
    ahead = CliRunner().invoke(user.main, argv)
    assert not squeue._ahead, "the read started ahead was not taken"
    assert started.proc.returncode is not None
    def unsalted(calls):  # each read has its own random field separator
        return [[re.sub(r"~[0-9a-f]{16}~", "~SEP~", a) for a in c] for c in calls]
    assert unsalted(squeue_calls()[len(plain_calls):]) == unsalted(plain_calls), "a read made twice, or another"
    assert (ahead.exit_code, ahead.output) == (plain.exit_code, plain.output)


@pytest.mark.parametrize("argv", [["list", "--since", "1h"], ["status"], ["status", "x"], ["list", "--all", "-h"],
                                  ["quota"], ["logs", "-f", "3"], []], ids=lambda a: " ".join(a) or "(none)")
def test_hai_reads_nothing_ahead_for_a_command_whose_first_read_it_cannot_tell(argv):
    from slurm_hai.cli import front as hai

    assert hai.first_read(argv) is None


def test_a_read_asked_ahead_twice_is_started_once_and_taken_once(squeue_calls):
    from slurm_hai.slurm import squeue

    squeue.start_ahead((), "alice")
    squeue.start_ahead((), "alice")
    squeue.take((), "alice").proc.communicate()
    assert squeue.take((), "alice") is None
    assert len(squeue_calls()) == 1, squeue_calls()
