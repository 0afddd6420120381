"""Small promises of the command line: --version, quiet broken pipes, no-config message,
run-local's progress and traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_hai import __version__
from slurm_hai.cli import common
from slurm_hai.cli.common import no_config_hint, one_line_errors

BIN = Path(sys.executable).parent


def run(*argv: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], text=True, capture_output=True, timeout=60,
                          env={**os.environ, **(env or {})}, **kw)


@pytest.mark.parametrize("cmd", ["hai", "hai-submit"])
def test_version(cmd):
    p = run(cmd, "--version")
    assert p.returncode == 0 and p.stdout.strip() == f"{cmd} (slurm-hai) {__version__}"


def test_a_broken_pipe_is_not_turned_into_an_error_line():
    @one_line_errors
    def writes():
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(BrokenPipeError):
        writes()


def test_output_cut_short_by_head_ends_quietly(tmp_path):
    for i in range(3000):
        (tmp_path / f"step-{i}").mkdir()
    p = subprocess.run(f"{BIN / 'hai'} ckpt ls {tmp_path} | head -1", shell=True, text=True, capture_output=True,
                       timeout=60)
    assert p.stdout.split()[0] == "STEP" and p.stderr == ""


def test_a_slurm_conf_that_names_no_file_is_one_line_at_once(tmp_path):
    t0 = time.monotonic()
    p = run("hai", "list", env={"SLURM_CONF": str(tmp_path / "nope.conf")})
    assert time.monotonic() - t0 < 10  # Slurm itself would retry for 60 s
    assert p.returncode == 1 and p.stderr.count("\n") == 1
    assert p.stderr.startswith("Error: no Slurm configuration found:") and "export SLURM_CONF=" in p.stderr


def test_slurms_dns_srv_errors_become_one_line():
    slurm = ("squeue: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host fetch_config: DNS SRV "
             "lookup failed fatal: Could not establish a configuration source")
    assert no_config_hint(slurm).startswith("no Slurm configuration found")
    assert no_config_hint("squeue: Invalid job id specified") == ""


def test_the_no_configuration_hint_sends_a_sites_user_to_the_admin_and_names_the_local_cluster_as_such(
        monkeypatch, tmp_path):
    slurm = "fatal: Could not establish a configuration source"
    monkeypatch.setattr(common, "LOCAL_CLUSTER_ENV", str(tmp_path / "env"))
    site = no_config_hint(slurm)
    assert "ask your cluster's admin where its slurm.conf is" in site and "export SLURM_CONF=" in site
    assert "local" not in site and "source" not in site
    (tmp_path / "env").write_text("export SLURM_CONF=...\n")
    here = no_config_hint(slurm)  # a site's login node that also runs the local test cluster
    assert here.startswith(site) and here.endswith(f" (slurm-hai's local test cluster on this host: source "
                                                   f"{tmp_path / 'env'})")


def test_run_local_shows_progress_and_the_traceback_of_a_failed_run(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("print('hello')\nraise RuntimeError('boom at step 3')\n")
    p = run("hai", "run-local", str(script), "--restarts", "0", "--job-dir", str(tmp_path / "job"))
    assert p.returncode == 1
    assert "run 0 started" in p.stdout and "RuntimeError: boom at step 3" in p.stdout and "Traceback" in p.stdout


def test_a_policy_that_would_drop_quotas_is_named_in_a_warning():
    from slurm_hai.cli.admin import quota_loss_warning
    from slurm_hai.policy.ladder import Change

    changes = [
        Change("modify", "qos", where={"name": "high"}, settings={"MaxTRESPU": "node=-1"},
               why="high: Preempt -normal.u.bob; MaxTRESPU node=2 -> (none)"),
        Change("delete", "qos", where={"name": "high.u.bob"}, why="override gone from the policy: high.u.bob"),
        Change("modify", "qos", where={"name": "low"}, settings={"Priority": "0"}, why="low: Priority 1 -> 0"),
    ]
    warning = quota_loss_warning(changes)
    assert "removes the quota of high (2 nodes per user)" in warning and "deletes the overrides high.u.bob" in warning
    assert quota_loss_warning(changes[2:]) == ""


def test_plan_notes_a_rendered_file_the_policy_no_longer_matches(tmp_path):
    from slurm_hai.cli.admin import stale_rendered_files
    from slurm_hai.policy.model import default_policy
    from slurm_hai.policy.ladder import template_context
    from slurm_hai.render import render

    policy = default_policy()
    lua = render("slurm/job_submit.lua.j2", **template_context(policy))
    (tmp_path / "job_submit.lua").write_text("-- rendered elsewhere, from another path\n" + lua)
    assert stale_rendered_files(policy, tmp_path) == []  # comments aside, the same
    (tmp_path / "job_submit.lua").write_text(lua.replace("HIGH", "HIGHER", 1))
    assert stale_rendered_files(policy, tmp_path) == [str(tmp_path / "job_submit.lua")]
    # the site's own job_submit.lua calling slurm-hai's (docs/admin-guide.md): only slurm-hai's is compared
    (tmp_path / "job_submit.lua").write_text('dofile("/etc/slurm/hai_job_submit.lua")\n')
    (tmp_path / "hai_job_submit.lua").write_text(lua)
    assert stale_rendered_files(policy, tmp_path) == []
    (tmp_path / "hai_job_submit.lua").write_text(lua.replace("HIGH", "HIGHER", 1))
    assert stale_rendered_files(policy, tmp_path) == [str(tmp_path / "hai_job_submit.lua")]
