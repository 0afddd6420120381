"""The weights of examples/train.py run uninterrupted on this host: the reference the cluster
tests compare a preempted, resumed job's final weights with, bit for bit.

A reference depends only on its inputs: the script, its arguments, slurm_hai's code, and the
versions of Python and torch. It is kept under CACHE by a hash of them, so each is computed
once per machine, not once per test module and again on every Slurm version
(tests/each_slurm.py runs the same modules on each Slurm of CI, and a reference takes 15-20 s
of the 2 cores). Any change to an input is another key, so a kept reference never stands in
for a run of other code.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train.py"
CACHE = Path(os.environ.get("HAI_TEST_REFERENCES", "/var/cache/slurm-hai/test-references"))


def key(args: list[str]) -> str:
    """The hash of everything the run's weights depend on."""
    h = hashlib.sha256()
    h.update(json.dumps([sys.version, version("torch"), args]).encode())
    for path in [TRAIN, *sorted((REPO / "slurm_hai").rglob("*.py"))]:
        h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:32]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """train.py with `args` (its --ckpt-dir and --out are added here), started unless its
    weights are kept. `weights()` waits for them and gives their path; `stop()` ends a run
    that is no longer wanted."""

    def __init__(self, args: list[str], timeout: float = 600) -> None:
        self.kept = CACHE / key(args) / "final.safetensors"
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        if self.kept.exists():
            return
        CACHE.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(dir=CACHE, prefix=".run-"))
        env = {**os.environ, "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1"}
        for name in ("HAI_JOB_DIR", "SLURM_JOB_ID"):
            env.pop(name, None)
        with (self.work / "log").open("w") as log:
            self.proc = subprocess.Popen([sys.executable, str(TRAIN), *args, "--ckpt-dir", str(self.work / "ckpt"),
                                          "--out", str(self.work / "final.safetensors")], env=env, stdout=log,
                                         stderr=subprocess.STDOUT)

    def weights(self) -> Path:
        if self.proc is None or self.kept.exists():
            return self.kept
        try:
            code = self.proc.wait(self.timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        assert code == 0, (self.work / "log").read_text()
        shutil.rmtree(self.work / "ckpt")
        try:
            self.work.rename(self.kept.parent)  # whole or not at all
        except OSError:  # another run kept the same weights first
            shutil.rmtree(self.work, ignore_errors=True)
        return self.kept

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            shutil.rmtree(self.work, ignore_errors=True)


def weights(args: list[str]) -> Path:
    """train.py's weights for `args`, run now unless they are kept."""
    return Run(args).weights()


def same_weights(a: Path, b: Path) -> bool:
    """Whether two safetensors files hold the same tensors, bit for bit."""
    from safetensors.torch import load_file

    wa, wb = load_file(str(a)), load_file(str(b))
    return wa.keys() == wb.keys() and all(wa[k].numpy().tobytes() == wb[k].numpy().tobytes() for k in wa)
