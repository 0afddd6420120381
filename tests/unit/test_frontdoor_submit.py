"""hai-submit's front door without Slurm: arguments, refusals, levels (Slurm faked)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_hai.cli import submit as submit_cli
from slurm_hai.slurm.base import NodeInfo
from slurm_hai.slurm.commands import nodes_from_text


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

    def nodes(self) -> list[NodeInfo]:
        return nodes_from_text("".join(f"NodeName=n{i} Arch=x86_64 CPUTot=2 Gres={self.gres} Partitions=gpu "
                                       "State=IDLE\n" for i in (1, 2)))

    def jobs(self, job_ids=(), user=None):
        return []


@pytest.fixture
def fake(monkeypatch, tmp_path):
    slurm = FakeSlurm()
    monkeypatch.setattr(submit_cli, "backend", lambda: slurm)
    monkeypatch.setenv("HAI_HOME", str(tmp_path / "hai"))
    (tmp_path / "policy.toml").write_text("")  # HAI's default policy (min_gpus = 8), whatever this host has
    monkeypatch.setenv("HAI_POLICY", str(tmp_path / "policy.toml"))
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


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("make,needle", [
    (lambda d: d / "missing.py", "no such file"),
    (lambda d: d, "is a directory"),
    (lambda d: (d / "README.md", (d / "README.md").write_text("# hello\n"))[0], "nor a program"),
    (lambda d: (d / "run.sh", (d / "run.sh").write_text("#!/bin/bash\necho hi\n"))[0], "chmod u+x"),
    (lambda d: executable(d / "run.sh", "#!/opt/nowhere/bash\necho hi\n"),
     "script {}: its #! interpreter /opt/nowhere/bash does not exist here; fix its first line"),
    (lambda d: executable(d / "run.sh", "#!/usr/bin/env no-such-python3\nprint(1)\n"),
     "its #! line runs `env no-such-python3`, and there is no no-such-python3 on PATH here"),
])
def test_a_script_that_can_only_fail_later_is_refused_at_submit(fake, tmp_path, make, needle):
    script = make(tmp_path)
    rc, out = dry_run(str(script))
    assert rc == 2 and needle.format(script) in out and "#SBATCH" not in out, out
    assert len(out.strip().splitlines()) == 1 and out.startswith("Error: ")


def test_a_workdir_that_is_missing_or_a_file_is_refused(fake, tmp_path):
    script = tmp_path / "t.py"
    script.write_text("print(1)\n")
    rc, out = dry_run("--workdir", str(tmp_path / "nope"), str(script))
    assert rc == 2 and "no such directory" in out
    rc, out = dry_run("--workdir", str(script), str(script))
    assert rc == 2 and "is not a directory" in out


def test_an_executable_shell_script_is_accepted(fake, tmp_path):
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/bash\necho hi\n")
    script.chmod(0o700)
    rc, out = dry_run(str(script), "x")
    assert rc == 0 and exec_line(out)[-2:] == [str(script), "x"]


def test_a_mistyped_level_gets_a_suggestion(fake, tmp_path):
    script = tmp_path / "t.py"
    script.write_text("print(1)\n")
    rc, out = dry_run("-p", "HIHG", str(script))
    assert rc == 2 and "did you mean HIGH?" in out
    rc, out = dry_run("-p", "zzz", str(script))
    assert rc == 2 and "did you mean" not in out and "LOW(0)" in out


def test_a_rejected_name_says_pass_name_only_when_it_was_not_passed(fake, tmp_path):
    script = tmp_path / "bad name.py"
    script.write_text("print(1)\n")
    assert "name it with --name" in dry_run(str(script))[1]
    rc, out = dry_run("--name", "a;b", str(script))
    assert rc == 2 and "choose another --name" in out and "name it with" not in out


def test_gpus_default_to_what_the_groups_nodes_have(fake, tmp_path):
    script = tmp_path / "t.py"
    script.write_text("print(1)\n")
    rc, out = dry_run(str(script))
    assert rc == 0 and "#SBATCH --gres=gpu:8" in out and "--gpus=8" in out
    fake.gres = "(null)"  # CPU-only nodes: no GPU request at all
    rc, out = dry_run(str(script))
    assert rc == 2 and "node group gpu takes jobs of at least 8 GPUs per node" in out  # HAI's 8-GPU rule
    (tmp_path / "policy.toml").write_text("min_gpus = 0\n")  # e.g. a test partition
    rc, out = dry_run(str(script))
    assert rc == 0 and "--gres" not in out and "--gpus=0" in out
    fake.gres = "gpu:a100:4(S:0-1),gpu:v100:2"
    assert "#SBATCH --gres=gpu:6" in dry_run(str(script))[1]


@pytest.mark.parametrize("argv,needle", [
    (["--gpus-per-node", "9"], "at most 8 per node"),
    (["-n", "3"], "has 2 node(s); ask for at most -n 2"),
    (["-g", "gpus"], "no such node group; did you mean gpu?"),
])
def test_a_request_the_group_can_never_satisfy_is_refused_in_our_words(fake, tmp_path, argv, needle):
    script = tmp_path / "t.py"
    script.write_text("print(1)\n")
    rc, out = dry_run(*argv, str(script))
    assert rc == 2 and needle in out and len(out.strip().splitlines()) == 1


def test_gpus_on_a_cpu_only_group_say_use_0(fake, tmp_path):
    fake.gres = "(null)"
    script = tmp_path / "t.py"
    script.write_text("print(1)\n")
    rc, out = dry_run("--gpus-per-node", "1", str(script))
    assert rc == 2 and "have no GPUs; use 0" in out


def test_a_single_process_script_on_several_nodes_gets_a_warning(fake, tmp_path):
    single = tmp_path / "one.py"
    single.write_text("import torch\nprint(1)\n")
    multi = tmp_path / "many.py"
    multi.write_text("from slurm_hai import spawn\n")
    resumable = tmp_path / "resumable.py"  # a slurm-hai script, but one process: examples/resumable.py's kind
    resumable.write_text("import slurm_hai as hai\nif hai.receive_suspend_command(): hai.go_suspend()\n")
    for script in (single, resumable):
        r = CliRunner().invoke(submit_cli.main, ["--dry-run", "-n", "2", str(script)])
        assert r.exit_code == 0 and "looks single-process" in r.output and "each of 2 nodes" in r.output
    for argv in (["-n", "2", str(multi)], ["-n", "1", str(single)]):
        assert "single-process" not in CliRunner().invoke(submit_cli.main, ["--dry-run", *argv]).output


def test_a_json_dry_run_prints_one_json_object(fake, tmp_path):
    script = tmp_path / "one.py"
    script.write_text("import torch\nprint(1)\n")
    r = CliRunner().invoke(submit_cli.main, ["--dry-run", "--json", "-n", "1:2", "-p", "HIGH", "--grace", "3",
                                             str(script), "--lr", "0.1"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)  # the warnings go to stderr too, for whoever watches
    assert report["dry_run"] is True and report["script"].startswith("#!")
    assert "#SBATCH --qos=high" in report["script"]
    assert (report["level"], report["qos"], report["nodes"], report["node_range"], report["grace"], report["gpus"]) == \
        ("HIGH", "high", 1, "1:2", 3, 8)
    assert report["command"][-3:] == [str(script), "--lr", "0.1"] and report["slurm_unreachable"] is None
    assert any("looks single-process" in w for w in report["warnings"])


def test_in_place_is_a_job_array_of_one_node_parts_under_the_sites_lighthouse_service(fake, tmp_path):
    script = tmp_path / "parts.py"
    script.write_text("from slurm_hai.runtime.parts import join\n")
    rc, out = dry_run("--in-place", "-n", "2:2", str(script))
    assert rc == 2 and "--in-place: this cluster runs no lighthouse service (the policy's [elastic] lighthouse_service)" \
        in out, out
    (tmp_path / "policy.toml").write_text('[elastic]\nlighthouse_service = "http://ctl:29510"\n')
    rc, out = dry_run("--in-place", "-n", "1:2", "--retries", "3", str(script), "--lr", "0.1")
    assert rc == 0, out
    lines = out.splitlines()
    for line in ("#SBATCH --array=0-1", "#SBATCH --nodes=1", "#SBATCH --requeue",
                 "#SBATCH --comment=hai-dir=" + str(tmp_path / "hai" / "jobs") + ";hai-grace=5;hai-parts=1:2",
                 "export HAI_LIGHTHOUSE_SERVICE=http://ctl:29510", "export HAI_PARTS_MIN=1"):
        assert line in lines, line
    assert not [ln for ln in lines if ln.startswith("#SBATCH --signal") or "hai-nodes" in ln]  # the notice: SIGTERM
    argv = exec_line(out)
    assert argv[2:5] == ["-m", "slurm_hai.runtime.part_task", f"--job-dir={tmp_path / 'hai' / 'jobs'}/$SLURM_ARRAY_JOB_ID"]
    assert "--retries=3" in argv[:argv.index(str(script))]  # the job's retries, which its parts share
    assert argv[argv.index(str(script)) + 1:] == ["--lr", "0.1"]
    assert "--notice-seconds=35" in argv[:argv.index(str(script))]  # the grace (5) + NOTICE_MARGIN
    assert not [ln for ln in lines if ln.startswith("#SBATCH --time")]
    # with --time, each run of a part's task has that limit; its script tells the part before it
    rc, out = dry_run("--in-place", "-n", "1:2", "--time", "10", str(script))
    assert rc == 0 and "#SBATCH --time=10" in out.splitlines(), out
    for argv, needle in ((["-n", "2"], "--in-place needs a node range MIN:MAX (one part per node), got -n 2"),
                         (["-n", "1:2", "--torchrun"], "--in-place runs a Python script of parts")):
        rc, out = dry_run("--in-place", *argv, str(script))
        assert rc == 2 and needle in out and "Traceback" not in out, (argv, out)
    whole = tmp_path / "whole.py"  # a script not written for parts: four copies would each run it whole
    whole.write_text("import slurm_hai as hai\nprint(hai.restart_count())\n")
    rc, out = dry_run("--in-place", "-n", "1:2", str(whole))
    assert rc == 0 and f"warning: {whole} does not use slurm_hai.runtime.parts (join, leave_on): with --in-place each " \
        "of its 2 parts runs it whole" in out, out
    assert "does not use slurm_hai.runtime.parts" not in dry_run("--in-place", "-n", "1:2", str(script))[1]
