"""`hai ckpt ls|verify`: readable output, --json, exit codes, no torch needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from slurm_hai.checkpoint import CheckpointManager
from slurm_hai.checkpoint.manifest import step_dir_name
from slurm_hai.cli.ckpt import ckpt

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def checkpoints(tmp_path: Path) -> Path:
    mgr = CheckpointManager(tmp_path, keep_last=5)
    for step in (10, 20):
        mgr.save(step, {"w": torch.full((256,), float(step)), "step": step})
    return tmp_path


def corrupt(root: Path, step: int) -> None:
    path = root / step_dir_name(step) / "state.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


def invoke(*args: str):
    return CliRunner().invoke(ckpt, list(args))


def test_ls_lists_checkpoints_newest_first(checkpoints):
    result = invoke("ls", str(checkpoints))
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split()[:2] == ["STEP", "SIZE"]
    assert [line.split()[0] for line in lines[1:3]] == ["20", "10"]
    assert all(line.rstrip().endswith("sizes ok") for line in lines[1:3])
    corrupt(checkpoints, 20)  # a flipped byte: the sizes hold, only verify's checksums see it
    assert invoke("ls", str(checkpoints)).output.splitlines()[1].rstrip().endswith("  sizes ok")


def test_ls_json_is_machine_readable(checkpoints):
    (checkpoints / ".staging-000000000030-host-1-abcd").mkdir()
    result = invoke("ls", str(checkpoints), "--json")
    assert result.exit_code == 0
    listing = json.loads(result.output)
    assert [c["step"] for c in listing["checkpoints"]] == [20, 10]
    assert listing["checkpoints"][0]["layout"] == "single" and listing["checkpoints"][0]["status"] == "sizes_ok"
    assert listing["in_progress"] == [".staging-000000000030-host-1-abcd"]


def test_verify_passes_on_good_checkpoints(checkpoints):
    result = invoke("verify", str(checkpoints))
    assert result.exit_code == 0
    assert "step-000000000020: ok" in result.output


def test_verify_exits_1_naming_the_bad_file_and_why(checkpoints):
    corrupt(checkpoints, 20)
    result = invoke("verify", str(checkpoints))
    assert result.exit_code == 1
    assert "step-000000000020: BAD state.safetensors: checksum mismatch" in result.output
    assert invoke("verify", str(checkpoints), "--step", "10").exit_code == 0
    as_json = json.loads(invoke("verify", str(checkpoints), "--json").output)
    assert as_json["ok"] is False
    assert as_json["checkpoints"][0]["problems"][0]["file"] == "state.safetensors"


def test_verify_accepts_a_single_step_directory(checkpoints):
    assert invoke("verify", str(checkpoints / step_dir_name(10))).exit_code == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [(["verify", "/nonexistent/ckpt"], "no such directory"), (["ls", "/nonexistent/ckpt"], "no such directory"),
     (["verify", "{root}", "--step", "99"], "no checkpoint for step 99")],
)
def test_errors_are_one_line_without_a_traceback(checkpoints, args, message):
    result = invoke(*[a.format(root=checkpoints) for a in args])
    assert result.exit_code == 1
    assert message in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_cli_imports_and_verifies_without_torch(checkpoints):
    corrupt(checkpoints, 20)
    script = (
        "import sys; sys.modules['torch'] = None\n"  # any torch import now fails
        "from slurm_hai.cli.ckpt import ckpt\n"
        f"ckpt(['verify', {str(checkpoints)!r}])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert "BAD state.safetensors: checksum mismatch" in result.stdout
    assert "step-000000000010: ok" in result.stdout
