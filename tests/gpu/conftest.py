"""tests/gpu: checkpoints of CUDA state, on a machine with a CUDA GPU (no Slurm needed).

    python -m pytest -m gpu tests/gpu

tests/conftest.py marks them `gpu`; pyproject's addopts deselect that mark (-m 'not gpu'),
since CI has no GPU, and `-m gpu` selects them.
Without a CUDA device they fail, never skip: a skipped test would stand in for a proof.
"""

from __future__ import annotations

import os

# cuBLAS picks the same algorithms run after run only with a fixed workspace: set before
# CUDA starts, so that a resumed run can match an uninterrupted one bit for bit.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def cuda() -> torch.device:
    """The GPU, with deterministic kernels (the bitwise resume tests need them)."""
    if not torch.cuda.is_available():
        pytest.fail("tests/gpu need a CUDA GPU (torch.cuda.is_available() is False)")
    torch.use_deterministic_algorithms(True)
    yield torch.device("cuda", 0)
    torch.use_deterministic_algorithms(False)
    torch.cuda.synchronize()
