"""hai.spawn: one process per GPU, started fresh ("spawn") or as copies of the caller ("fork")."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
import types

import pytest

from slurm_hai.runtime import multiprocessing as hai_mp

RANKS = """
    import os, sys
    from pathlib import Path
    from slurm_hai import spawn

    def main(local_rank, out):
        env = {k: os.environ[k] for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "HAI_GLOBAL_RANK", "HAI_GLOBAL_WORLD_SIZE")}
        Path(out, f"rank{local_rank}").write_text(repr((env, os.getppid(), "preloaded" in sys.modules)))

    if __name__ == "__main__":
        import preloaded  # noqa: F401  (a module the script imported before spawn)
        spawn(main, args=(sys.argv[1],), nprocs=3, start_method=sys.argv[2])
        print(os.getpid())
"""


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_every_rank_gets_its_ranks_and_fork_keeps_the_imports(tmp_path, method):
    (tmp_path / "preloaded.py").write_text("")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(RANKS))
    out = tmp_path / "out"
    out.mkdir()
    p = subprocess.run([sys.executable, str(script), str(out), method], capture_output=True, text=True,
                       cwd=tmp_path, env={"RANK": "1", "WORLD_SIZE": "2", "PATH": "/usr/bin:/bin",
                                          "PYTHONPATH": ":".join(sys.path)}, timeout=120)
    assert p.returncode == 0, p.stderr
    parent = int(p.stdout)
    for r in range(3):
        env, ppid, imported = ast.literal_eval((out / f"rank{r}").read_text())
        assert env == {"LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "3", "HAI_GLOBAL_RANK": str(3 + r),
                       "HAI_GLOBAL_WORLD_SIZE": "6"}
        assert ppid == parent
        assert imported == (method == "fork")  # a fresh interpreter imports only what the script does at its top


def test_an_unknown_start_method_is_refused_in_one_line():
    with pytest.raises(ValueError, match="start_method 'forkserver': use one of spawn, fork"):
        hai_mp.spawn(print, start_method="forkserver")


def test_fork_after_cuda_is_refused(monkeypatch):
    cuda_used = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", cuda_used)
    with pytest.raises(RuntimeError, match="use start_method='spawn'"):
        hai_mp.spawn(print, start_method="fork")


FAILS = """
    from slurm_hai import spawn

    def main(local_rank):
        raise ValueError(f"boom in {local_rank}")

    if __name__ == "__main__":
        spawn(main, nprocs=1)
"""


def test_a_rank_that_raises_shows_the_users_traceback_from_the_users_function_on(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(FAILS))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}, timeout=120)
    assert p.returncode != 0
    lines = p.stderr.splitlines()
    start = lines.index("Traceback (most recent call last):")
    assert lines[start - 1] == "local rank 0:" and lines[start + 1].startswith(f'  File "{script}", line 5, in main')
    assert "ValueError: boom in 0" in lines and "multiprocessing" not in p.stderr.replace("slurm-hai spawn", "")
