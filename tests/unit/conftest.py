"""Unit tests: each starts with no policy kept from another (policy.model.find_policy keeps
the one it read while its file stays as it is; a test's own policy file may be at the path
of another's, rewritten within the same clock tick)."""

import pytest

import slurm_hai.policy.model


@pytest.fixture(autouse=True)
def no_kept_policy(monkeypatch):
    monkeypatch.setattr(slurm_hai.policy.model, "_kept", {})
