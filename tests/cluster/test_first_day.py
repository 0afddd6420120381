"""A user's and an admin's first day on the live cluster (issue 54, findings 4, 5c and 11):
what the first commands say where they surprised a newcomer, as the commands say it on a
real cluster, as a user who is not root. The unit tests hold the wording's rules; these
prove that the live paths reach them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, LiveCluster
from test_frontdoor import one_error_line, status, user_dir, write

pytestmark = pytest.mark.cluster

USER = "hai-alice"


def test_submit_warns_of_a_script_that_would_run_whole_on_each_node_and_refuses_a_missing_interpreter(
        live: LiveCluster) -> None:
    resumable = REPO / "examples" / "resumable.py"  # a slurm-hai script, but one process
    several = live.run(["hai-submit", "--dry-run", "-n", "2", "-p", "LOW", str(resumable)], user=USER)
    assert "looks single-process" in several.stderr + several.stdout and "each of 2 nodes" in several.stderr + several.stdout
    in_place = live.run(["hai-submit", "--dry-run", "--in-place", "-n", "1:2", "-p", "LOW", str(resumable)], user=USER)
    assert f"warning: {resumable} does not use slurm_hai.runtime.parts" in in_place.stderr + in_place.stdout
    d = user_dir(live, "first-day", USER)
    shell = write(d / "run.sh", "#!/opt/nowhere/bash\necho never\n", USER, mode=0o700)
    refused = live.run(["hai-submit", "-p", "LOW", str(shell)], user=USER, check=False)
    assert "its #! interpreter /opt/nowhere/bash does not exist here; fix its first line" in one_error_line(refused)
    near = live.run(["hai-submit", "-p", "HGIH", str(resumable)], user=USER, check=False)
    assert "did you mean HIGH?" in one_error_line(near)
    plugin = live.run(["sbatch", "--hai-priority=HGIH", "-o", "/dev/null", "--wrap=true"], user=USER, check=False)
    assert plugin.returncode != 0 and "did you mean HIGH?" in plugin.stderr, plugin.stderr
    assert live.run(["squeue", "-h", "-u", USER, "-o", "%i"]).stdout.split() == []


CHECKPOINT = """
    import sys, torch
    from slurm_hai.checkpoint import CheckpointManager
    CheckpointManager(sys.argv[1]).save(7, {"w": torch.arange(1000, dtype=torch.float64)})
"""


def test_a_checkpoint_listing_says_what_it_checked_and_verify_finds_the_corruption(live: LiveCluster) -> None:
    d = user_dir(live, "first-day-ckpt", USER)
    script = write(d / "save.py", CHECKPOINT, USER)
    live.run([sys.executable, str(script), str(d / "ckpt")], user=USER, timeout=120)
    data = max((p for p in (d / "ckpt").rglob("*") if p.is_file() and p.suffix not in (".json",)),
               key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # the same size, other bytes
    data.write_bytes(bytes(raw))
    listing = live.run(["hai", "ckpt", "ls", str(d / "ckpt")], user=USER)
    assert listing.stdout.splitlines()[1].rstrip().endswith("sizes ok"), listing.stdout
    verify = live.run(["hai", "ckpt", "verify", str(d / "ckpt")], user=USER, check=False)
    assert verify.returncode != 0 and "Traceback" not in verify.stderr, (verify.stdout, verify.stderr)


def test_another_users_failed_job_reads_its_exit_code_in_words(live: LiveCluster) -> None:
    job = live.sbatch("-o", "/dev/null", "--qos=low", "--wrap", "exit 1", user="hai-bob")
    live.wait_job(job, lambda j: j.get("JobState") == "FAILED", 60, "bob's job to fail")
    st = status(live, job, user=USER)
    assert st["reason"] == "exit code 1" and "NonZeroExitCode" not in str(st), st


def test_explain_of_a_job_not_in_the_queue_says_so_in_one_line(live: LiveCluster) -> None:
    assert "no such job in the queue: 99999999" in one_error_line(
        live.run(["hai-admin", "explain", "99999999"], check=False))


def test_a_user_without_slurms_configuration_is_sent_to_the_admin(live: LiveCluster) -> None:
    env = {k: v for k, v in live.env.items() if k != "SLURM_CONF"}
    env["SLURM_CONF"] = "/nonexistent/slurm.conf"
    p = subprocess.run(["runuser", "-u", USER, "--", "env", f"HOME=/home/{USER}", "hai", "list"], env=env,
                       text=True, capture_output=True, timeout=60, cwd=f"/home/{USER}")
    said = one_error_line(p)
    assert "ask your cluster's admin where its slurm.conf is" in said and "export SLURM_CONF=" in said, said


SPAWN_FAILS = """
    import slurm_hai as hai

    def main(rank):
        if rank == 1:
            raise ValueError(f"boom in {rank}")

    if __name__ == "__main__":
        hai.spawn(main, nprocs=2)
"""


def test_a_failed_rank_shows_the_users_traceback_first_in_the_jobs_log(live: LiveCluster) -> None:
    d = user_dir(live, "first-day-spawn", USER)
    script = write(d / "train.py", SPAWN_FAILS, USER)
    p = live.run(["hai-submit", "-f", "-p", "LOW", str(script)], user=USER, check=False, timeout=180)
    assert p.returncode == 1, (p.stdout, p.stderr)
    lines = p.stdout.splitlines()
    start = lines.index("Traceback (most recent call last):")
    assert lines[start + 1].startswith(f'  File "{script}", line 6, in main'), lines[start - 2:start + 4]
    assert "ValueError: boom in 1" in p.stdout and "multiprocessing" not in p.stdout.replace("slurm-hai spawn", "")
