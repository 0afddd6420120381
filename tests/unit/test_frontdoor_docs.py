"""The README shows what exists: its job example is the file under examples/, verbatim."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, flags=re.S)


def test_the_readme_job_example_is_examples_resumable_py_verbatim():
    readme = (REPO / "README.md").read_text()
    assert (REPO / "examples" / "resumable.py").read_text() in python_blocks(readme)


def test_the_readme_job_example_runs_and_resumes_after_a_suspend(tmp_path):
    hai = Path(sys.executable).parent / "hai"
    p = subprocess.run([str(hai), "run-local", str(REPO / "examples" / "resumable.py"), "--suspend-after", "1",
                        "--grace", "120",
                        "--job-dir", str(tmp_path / "job")], text=True, capture_output=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    log = (tmp_path / "job" / "logs" / "rank-0.log").read_text()
    suspended = re.search(r"suspending at step (\d+)", log)
    assert "run 0 starts at step 0" in log and suspended and "done at step 300" in log
    assert f"run 1 starts at step {suspended.group(1)}" in log  # resumed from the suspend's checkpoint
    assert int(suspended.group(1)) > 0  # the notice came in the loop, not while torch was imported


def test_the_user_guides_plain_sbatch_job_in_place_is_examples_parts_sbatch_verbatim():
    guide = (REPO / "docs" / "user-guide.md").read_text()
    assert (REPO / "examples" / "parts.sbatch").read_text() in re.findall(r"```bash\n(.*?)```", guide, flags=re.S)
