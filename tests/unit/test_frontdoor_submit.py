"""hai-submit's front door without Slurm: arguments, refusals, levels (Slurm faked)."""

from __future__ import annotations

import shlex

import pytest
from click.testing import CliRunner

from slurm_hai.cli import submit as submit_cli


class FakeSlurm:
    name = "fake"

    def __init__(self, gres: str = "gpu:8") -> None:
        self.gres = gres
        self.submitted: list[str] = []

    def config(self) -> dict[str, str]:
        return {"SlurmctldParameters": "preempt_send_user_signal"}

    def partitions(self) -> list[dict[str, str]]:
        return [{"PartitionName": "gpu", "Nodes": "n[1-2]", "Default": "YES", "TotalNodes": "2"}]

    def expand_hostlist(self, hostlist: str) -> list[str]:
        return ["n1", "n2"]

    def scontrol(self, args) -> str:
        return "".join(f"NodeName=n{i} Arch=x86_64 CPUTot=2 Gres={self.gres} Partitions=gpu State=IDLE\n"
                       for i in (1, 2))

    def jobs(self, job_ids=(), user=None):
        return []


@pytest.fixture
def fake(monkeypatch, tmp_path):
    slurm = FakeSlurm()
    monkeypatch.setattr(submit_cli, "backend", lambda: slurm)
    monkeypatch.setenv("HAI_HOME", str(tmp_path / "hai"))
    return slurm


def dry_run(*argv: str) -> tuple[int, str]:
    r = CliRunner().invoke(submit_cli.main, ["--dry-run", *argv])
    return r.exit_code, r.output


def exec_line(text: str) -> list[str]:
    line = [ln for ln in text.splitlines() if ln.startswith("exec ")][0]
    return shlex.split(line)


def test_arguments_after_the_script_reach_it_unchanged(fake, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    rc, out = dry_run("-n", "2", "-p", "HIGH", "--time", "4:00:00", str(script), "--lr", "0.1", "-n", "5",
                      "--dry-run", "a b")
    assert rc == 0, out
    argv = exec_line(out)
    assert argv[argv.index(str(script)) + 1:] == ["--lr", "0.1", "-n", "5", "--dry-run", "a b"]
    assert "#SBATCH --nodes=2" in out and "#SBATCH --qos=high" in out


def test_a_double_dash_right_after_the_script_is_dropped(fake, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    rc, out = dry_run(str(script), "--", "--nprocs", "2")
    argv = exec_line(out)
    assert rc == 0 and argv[argv.index(str(script)) + 1:] == ["--nprocs", "2"]
