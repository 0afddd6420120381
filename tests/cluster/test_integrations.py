"""The Hugging Face Trainer and Lightning integrations on the live local cluster.

A LOW job trains a tiny model through the framework's own loop with slurm-hai's
SuspendCallback (tests/fixtures/hf_tiny_gpt2.py, lightning_tiny.py); a NORMAL job that
needs every node preempts it; the callback commits the framework's save and calls
go_suspend(); the job is requeued, resumes from that committed checkpoint, and its final
weights equal those of an uninterrupted run bit for bit. The policy daemon runs beside
(it restarts a requeued job at once).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_acceptance import daemon, named, same_weights, submit, wait_final, wait_for  # noqa: F401 (fixture)

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
STEPS = 200
STEP_SLEEP = "0.05"  # 10 s of training in all: the notices land mid-run


def start_reference(script: Path, out: Path) -> subprocess.Popen:
    """The uninterrupted run, beside the cluster job (it depends on no timing)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HAI_", "SLURM_"))}
    return subprocess.Popen([sys.executable, str(script), "--steps", str(STEPS), "--out", str(out),
                             "--ckpt-dir", str(out.parent / "ckpt")], cwd=out.parent, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish_reference(proc: subprocess.Popen) -> None:
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output


def log_text(job_dir: Path) -> str:
    path = job_dir / "logs" / "rank-0.log"
    return path.read_text(errors="replace") if path.exists() else ""


def steps(job_dir: Path, tag: str) -> list[int]:
    return [int(s) for s in re.findall(rf"^\[{tag}\] step (\d+)$", log_text(job_dir), re.M)]


def resumed_from(job_dir: Path, tag: str) -> list[int]:
    return [int(s) for s in re.findall(rf"^\[{tag}\] resumed from .*step-(\d+)", log_text(job_dir), re.M)]


def committed_on_notice(job_dir: Path) -> list[int]:
    return [int(s) for s in re.findall(r"^slurm-hai: suspend notice: step (\d+) committed", log_text(job_dir), re.M)]


def preempt(live, job_dir: Path, tag: str, k: int) -> None:
    """Let the job's run k-1 train 15 steps, then take every node for a NORMAL job."""
    start = resumed_from(job_dir, tag)[-1] if k > 1 else 0
    wait_for(f"run {k - 1} to train", lambda: max(steps(job_dir, tag) or [0]) >= start + 15, 120, 0.2)
    live.sbatch("-o", "/dev/null", "-N4", "--qos=normal", "--wrap", "sleep 1")
    suspended = wait_for(f"suspend {k}", lambda: len(named(job_dir, "suspended")) >= k and
                         named(job_dir, "suspended"), 60)
    assert suspended[-1]["how"] == "go_suspend"  # the callback suspended, in time
    assert named(job_dir, "notice")[-1]["cause"] == "preempted"
    wait_for(f"run {k} to resume", lambda: len(resumed_from(job_dir, tag)) >= k, 120)


def run_preempted(live, tmp_path: Path, script: Path, tag: str, preemptions: int) -> None:
    reference = start_reference(script, tmp_path / "reference.safetensors")
    out = live.shared_dir(f"integration-{tag}") / "final.safetensors"
    _, job_dir = submit(live, script, "-n", "1", "-p", "LOW",
                        args=["--steps", str(STEPS), "--step-sleep", STEP_SLEEP, "--out", str(out)])
    for k in range(1, preemptions + 1):
        preempt(live, job_dir, tag, k)
    final = wait_final(job_dir, 180)
    assert final["state"] == "succeeded", log_text(job_dir)
    assert resumed_from(job_dir, tag) == committed_on_notice(job_dir)  # each run resumed where the last stopped
    assert len(committed_on_notice(job_dir)) == preemptions
    assert f"[{tag}] done at step {STEPS}" in log_text(job_dir)
    verify = live.run(["hai", "ckpt", "verify", str(job_dir / "checkpoints")])
    assert "step-" in verify.stdout and "corrupt" not in verify.stdout
    finish_reference(reference)
    assert same_weights(out, tmp_path / "reference.safetensors"), "resumed weights differ"


@pytest.fixture
def story(live, daemon):  # noqa: F811
    return live


def test_hf_trainer_preempted_twice_ends_with_the_weights_of_an_uninterrupted_run(story, tmp_path):
    run_preempted(story, tmp_path, FIXTURES / "hf_tiny_gpt2.py", "hf", preemptions=2)


def test_lightning_preempted_and_resumed_ends_with_the_weights_of_an_uninterrupted_run(story, tmp_path):
    run_preempted(story, tmp_path, FIXTURES / "lightning_tiny.py", "pl", preemptions=1)
