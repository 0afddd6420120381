"""Slurm versions and the config spellings chosen for each (the templates ask version.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_hai.policy.model import load_policy
from slurm_hai.policy.ladder import template_context
from slurm_hai.render import render
from slurm_hai.slurm.version import OLDEST_SUPPORTED, SlurmVersion

POLICY = Path(__file__).resolve().parents[2] / "contrib" / "localcluster" / "policy.toml"


@pytest.mark.parametrize("text,expected", [
    ("slurm 22.05.8", SlurmVersion(22, 5, 8)), ("slurm-wlm 22.05.8", SlurmVersion(22, 5, 8)),
    ("slurm 25.11.7\n", SlurmVersion(25, 11, 7)), ("26.05", SlurmVersion(26, 5, 0)),
])
def test_versions_are_read_from_what_slurm_prints(text, expected):
    assert SlurmVersion.parse(text) == expected


def test_no_version_is_a_value_error():
    with pytest.raises(ValueError, match="no Slurm version"):
        SlurmVersion.parse("command not found")


def test_features_follow_the_releases_that_brought_them():
    old, new = SlurmVersion(22, 5, 8), SlurmVersion(25, 11, 7)
    assert not old.preempt_parameters and new.preempt_parameters
    assert not old.requeue_delay and new.requeue_delay
    assert not old.requeues_preempted_job_on_exit and new.requeues_preempted_job_on_exit
    assert SlurmVersion(24, 5).requeues_preempted_job_on_exit and not SlurmVersion(23, 11, 10).requeues_preempted_job_on_exit
    assert str(SlurmVersion(26, 5, 3)) == "26.05.3" and OLDEST_SUPPORTED == SlurmVersion(22, 5)


def policy_fragment(version: SlurmVersion | None) -> str:
    named = {} if version is None else {"slurm": version}  # None: render()'s own, the oldest supported
    return render("slurm/hai-policy.conf.j2", **template_context(load_policy(POLICY)), **named)


def test_each_version_gets_its_own_spelling_of_the_same_settings():
    old, new = policy_fragment(SlurmVersion(22, 5, 8)), policy_fragment(SlurmVersion(25, 11, 7))
    assert "SlurmctldParameters=preempt_send_user_signal" in old and "PreemptParameters" not in old
    assert "PreemptParameters=send_user_signal" in new and "preempt_send_user_signal" not in new
    sched = [line for text in (old, new) for line in text.splitlines() if line.startswith("SchedulerParameters=")]
    assert len(sched) == 2 and not any("requeue_delay" in line for line in sched)  # measured, not kept
    assert policy_fragment(None) == old  # hai-admin render: the spelling every version reads
