"""HAI's 8-GPU rule (policy `min_gpus`) on the live local cluster: hai-submit and plain
sbatch refuse a job with too few GPUs per node in the same one line, and take one with enough.

The local cluster's own policy sets `min_gpus = 0` (its other tests submit jobs without
GPUs). This module runs it with `[groups.gpu] min_gpus = 8` in force: the policy file beside
slurm.conf (what hai-submit reads) and job_submit.lua rendered from it by `hai-admin render`
(slurmctld reloads the script when its mtime moves on); both are put back afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from waiting import wait_for

if TYPE_CHECKING:  # the fixtures come from tests/conftest.py
    from conftest import LiveCluster

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
ALICE = "hai-alice"
RULE_8 = ("node group gpu takes jobs of at least 8 GPUs per node (whole nodes); this job asks for {} per node: "
          "use --gpus-per-node=8")


def install(path: Path, text: str) -> None:
    """Replace `path` (same mode and owner) with a later mtime than it had: slurmctld reloads
    job_submit.lua only when the mtime is past the one it loaded."""
    st = path.stat()
    tmp = path.with_name(path.name + ".hai-test")
    tmp.write_text(text)
    os.chmod(tmp, st.st_mode & 0o7777)
    os.chown(tmp, st.st_uid, st.st_gid)
    tmp.replace(path)
    later = max(time.time(), st.st_mtime) + 2
    os.utime(path, (later, later))


def sbatch(c: LiveCluster, *args: str) -> subprocess.CompletedProcess:
    return c.run(["sbatch", "--parsable", "-o", "/dev/null", *args, "--wrap", "true"], user=ALICE, check=False)


@pytest.fixture(scope="module")
def rule_of_8(cluster: LiveCluster, tmp_path_factory):
    """The cluster with `[groups.gpu] min_gpus = 8` in force; the cluster's own files afterwards."""
    etc = cluster.state / "etc"
    policy, lua = etc / "policy.toml", etc / "job_submit.lua"
    own_policy, own_lua = policy.read_text(), lua.read_text()
    assert own_policy.count("[groups.gpu]\n") == 1
    variant = own_policy.replace("[groups.gpu]\n", "[groups.gpu]\nmin_gpus = 8\n")
    out = tmp_path_factory.mktemp("render")
    try:
        install(policy, variant)
        cluster.run([sys.executable, "-m", "slurm_hai.cli.admin", "render", "--policy", str(policy), "--out",
                     str(out)], cwd=REPO)
        install(lua, (out / "job_submit.lua").read_text())
        # the first submission loads it: a job without GPUs is refused from now on
        wait_for(lambda: sbatch(cluster).returncode != 0, 10, "slurmctld to load the rendered job_submit.lua")
        yield cluster
    finally:
        cluster.cancel_all()
        install(policy, own_policy)
        install(lua, own_lua)
        wait_for(lambda: sbatch(cluster).returncode == 0, 10, "slurmctld to load the cluster's own job_submit.lua")
        cluster.cancel_all()
        assert policy.read_text() == own_policy and lua.read_text() == own_lua


@pytest.fixture
def rule(rule_of_8: LiveCluster, live: LiveCluster) -> LiveCluster:
    return live


def refusal(p: subprocess.CompletedProcess) -> str:
    """The one line that says why (sbatch adds its own "submission failed" line after it)."""
    assert p.returncode != 0, p.stdout
    lines = [line for line in p.stderr.splitlines() if "GPUs per node" in line]
    assert len(lines) == 1, p.stderr
    return lines[0]


def test_sbatch_with_too_few_gpus_per_node_is_refused_in_one_line(rule):
    c = rule
    assert refusal(sbatch(c)).endswith("hai: " + RULE_8.format(0))  # no GPU request at all
    assert refusal(sbatch(c, "-N2", "--gres=gpu:4")).endswith("hai: " + RULE_8.format(4))
    assert refusal(sbatch(c, "-p", "gpu", "--gpus-per-node=2")).endswith("hai: " + RULE_8.format(2))
    assert refusal(sbatch(c, "-N2", "--gpus=8")).endswith("hai: " + RULE_8.format(4))  # 8 over 2 nodes
    for enough in (["--gres=gpu:8"], ["-N2", "--gpus-per-node=8"], ["-p", "gpu", "-N2", "--gpus=16"]):
        p = sbatch(c, *enough)
        assert p.returncode == 0 and p.stdout.strip().isdigit(), (enough, p.stderr)


def test_hai_submit_with_too_few_gpus_is_refused_before_sbatch_in_the_same_words(rule):
    c = rule
    d = c.shared_dir("min-gpus", owner=ALICE)
    script = d / "job.sh"
    script.write_text("#!/bin/bash\necho done\n")
    script.chmod(0o755)
    shutil.chown(script, ALICE, ALICE)
    p = c.run(["hai-submit", "--gpus-per-node", "4", str(script)], user=ALICE, check=False)
    assert p.returncode == 2 and p.stderr.strip() == "Error: " + RULE_8.format(4), p.stderr
    assert c.run(["squeue", "-h", "-o", "%i"]).stdout.split() == []  # nothing reached Slurm
    # a login node whose policy lacks the rule: job_submit.lua refuses it, and hai-submit says the same
    lax = d / "lax.toml"
    lax.write_text((c.state / "etc" / "policy.toml").read_text().replace("min_gpus = 8\n", ""))
    lax.chmod(0o644)
    p = c.run(["env", f"HAI_POLICY={lax}", "hai-submit", "--gpus-per-node", "4", str(script)], user=ALICE,
              check=False)
    assert p.returncode == 2 and p.stderr.strip() == "Error: " + RULE_8.format(4), p.stderr
    # the default --gpus-per-node is what the group's nodes have: 8 here, enough
    p = c.run(["hai-submit", "--json", "-n", "2", str(script)], user=ALICE)
    job = json.loads(p.stdout)["job_id"]
    info = c.wait_job(job, lambda j: j["JobState"] == "COMPLETED", 60, "the job to finish")
    assert "gpu:8" in info.get("TresPerNode", info.get("Gres", "")), info
