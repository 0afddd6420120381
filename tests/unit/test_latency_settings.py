"""The scheduling settings that keep a preemption as fast as an idle start (issue 19)."""

from __future__ import annotations

from pathlib import Path

from slurm_hai.policy.ladder import template_context
from slurm_hai.policy.model import load_policy
from slurm_hai.render import render
from slurm_hai.slurm.version import SlurmVersion

POLICY = Path(__file__).resolve().parents[2] / "contrib" / "localcluster" / "policy.toml"


def fragment(version: SlurmVersion | None) -> str:
    """The policy fragment for Slurm `version` (None: render()'s own, the oldest supported)."""
    named = {} if version is None else {"slurm": version}
    return render("slurm/hai-policy.conf.j2", **template_context(load_policy(POLICY)), **named)


def test_no_defer_in_scheduler_parameters_and_each_setting_is_explained():
    for version in (SlurmVersion(22, 5, 8), SlurmVersion(25, 11, 7), None):
        text = fragment(version)
        (line,) = [x for x in text.splitlines() if x.startswith("SchedulerParameters=")]
        # any word containing "defer" makes slurmctld wait for its 1 s tick after a job's
        # last epilog (_slurm_rpc_epilog_complete): the preempting job waits with free nodes
        assert "defer" not in line
        for key in line.split("=", 1)[1].split(","):
            assert f"#  {key.split('=')[0]}" in text, key  # the reason sits next to the setting


def test_epilog_on_the_versions_that_free_nodes_without_it():
    assert "\nEpilog=/bin/true\n" in fragment(SlurmVersion(25, 11, 7))
    for version in (SlurmVersion(22, 5, 8), None):  # 22.05 gets epilog-complete messages anyway
        text = fragment(version)
        assert "\nEpilog=" not in text and "# On Slurm 24.05 and later also set Epilog=/bin/true" in text
