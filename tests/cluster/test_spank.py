"""The SPANK plugin (spank/hai_spank.so) on the live local Slurm cluster.

Covers: the --hai-* options in sbatch/srun/salloc help, --hai-priority reaching
job_submit.lua (job lands in the level's QOS), refusal of bad values at submission,
the HAI environment contract in srun steps and batch scripts (RANK, WORLD_SIZE,
MASTER_IP from NodeAddr, MASTER_PORT, HAI_RESTART_COUNT after a requeue), a
launcher-owned contract left alone, and no plugin errors in the daemon logs.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from slurm_hai.policy.limits import MASTER_PORT_BASE, MASTER_PORT_SPAN
from waiting import wait_for

if TYPE_CHECKING:  # the fixtures come from tests/conftest.py
    from conftest import LiveCluster

pytestmark = pytest.mark.cluster

USER = "hai-alice"
CONTRACT_VARS = ("RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_IP", "MASTER_ADDR", "MASTER_PORT",
                 "HAI_RESTART_COUNT", "HAI_CONTRACT", "HAI_MASTER_NODE", "HAI_MASTER_IP")
# What the plugin may log about itself; gres.conf complaints name the state dir
# (/var/lib/slurm-hai/...), so match the plugin's own prefixes only.
PLUGIN_ERROR = re.compile(r"error: .*(\bhai: |hai_spank|spank: .*(failed|Failed))")


# ----------------------------------------------------------------- helpers


def plugin_args(c: LiveCluster) -> dict[str, str]:
    """key=value arguments of the hai_spank.so line in the live plugstack.conf."""
    text = (c.state / "etc" / "plugstack.conf").read_text()
    for line in text.splitlines():
        line = line.split("#", 1)[0].split()
        if len(line) >= 2 and line[1].endswith("hai_spank.so"):
            assert line[0] == "optional", "the plugin must be listed as optional"
            return dict(a.split("=", 1) for a in line[2:] if "=" in a)
    raise AssertionError(f"hai_spank.so is not in {c.state / 'etc' / 'plugstack.conf'}:\n{text}")


def expected_port(c: LiveCluster, job_id: int) -> int:
    args = plugin_args(c)
    return int(args.get("master_port_base", MASTER_PORT_BASE)) + job_id % int(args.get("master_port_span", MASTER_PORT_SPAN))


def node_ipv4(c: LiveCluster, node: str) -> str:
    """A node's IPv4 as the plugin must compute it: its NodeAddr, resolved if a name."""
    line = c.run(["scontrol", "show", "node", "-o", node]).stdout
    info = dict(p.split("=", 1) for p in re.split(r" (?=[A-Za-z/:]+=)", line.strip()) if "=" in p)
    addr = info.get("NodeAddr") or node
    try:
        return str(ipaddress.IPv4Address(addr))
    except ValueError:
        return socket.gethostbyname(addr)


def parse_env_lines(text: str, prefix: str) -> list[dict[str, str]]:
    """Lines 'PREFIX K=V K=V ...' -> one dict per line, in order."""
    out = []
    for line in text.splitlines():
        if line.startswith(prefix + " "):
            out.append(dict(kv.split("=", 1) for kv in line[len(prefix) + 1:].split() if "=" in kv))
    return out


def labelled_env(stdout: str) -> dict[int, dict[str, str]]:
    """`srun -l env` output -> {task id: environment}."""
    tasks: dict[int, dict[str, str]] = {}
    for line in stdout.splitlines():
        m = re.match(r"\s*(\d+): ([A-Za-z_][A-Za-z0-9_]*)=(.*)$", line)
        if m:
            tasks.setdefault(int(m.group(1)), {})[m.group(2)] = m.group(3)
    return tasks




SHOW = ("show() { env | grep -E '^(" + "|".join(CONTRACT_VARS) + "|SLURM_JOB_ID|SLURM_RESTART_COUNT)=' "
        "| sort | tr '\\n' ' '; echo; }")


# ----------------------------------------------------------------- log watch


@pytest.fixture(scope="module")
def log_marks(cluster: LiveCluster) -> dict[Path, int]:
    """Sizes of the Slurm daemon logs before this module's jobs ran."""
    return {p: p.stat().st_size for p in sorted(cluster.log_dir.glob("slurm*.log"))}


# ----------------------------------------------------------------- tests


@pytest.mark.parametrize("command", ["sbatch", "srun", "salloc"])
def test_help_lists_options(live: LiveCluster, log_marks, command: str) -> None:
    out = live.run([command, "--help"], user=USER).stdout
    assert "--hai-priority=LEVEL" in out, out
    assert "--hai-grace=SECONDS" in out, out
    # the usage text shows the ladder that plugstack.conf configured
    for item in plugin_args(live).get("levels", "HIGH:30").split(","):
        assert item.split(":")[0] in out.replace("\n", " "), item


@pytest.mark.parametrize("value,qos", [("HIGH", "high"), ("high", "high"), ("40", "very_high"), ("LOW", "low")])
def test_priority_lands_in_level_qos(live: LiveCluster, value: str, qos: str) -> None:
    job = live.sbatch(f"--hai-priority={value}", "--hold", "-o", "/dev/null", "--wrap=true", user=USER)
    assert live.run(["squeue", "-h", "-j", str(job), "-o", "%q"]).stdout.strip() == qos
    assert live.job(job).get("QOS") == qos


@pytest.mark.parametrize("option,message", [
    ("--hai-priority=bogus", "hai: unknown priority level 'bogus'; use one of "),
    ("--hai-priority=7", "hai: unknown priority level '7'; use one of "),
    # the policy's words for a grace out of its bounds (placement.REFUSALS), as hai-submit says them
    ("--hai-grace=0", "hai: grace '0' is not allowed on this cluster; ask for whole seconds from 1 to "),
    ("--hai-grace=86401", "hai: grace '86401' is not allowed on this cluster; ask for whole seconds from 1 to "),
    ("--hai-grace=5s", "hai: grace '5s' is not allowed on this cluster; ask for whole seconds from 1 to "),
])
def test_bad_value_refused_at_submission(live: LiveCluster, option: str, message: str) -> None:
    p = live.run(["sbatch", option, "-o", "/dev/null", "--wrap=true"], user=USER, check=False)
    assert p.returncode != 0
    ours = [line for line in p.stderr.splitlines() if "hai:" in line]
    assert len(ours) == 1 and message in ours[0], p.stderr
    if "priority" in option:
        assert ours[0].rstrip().endswith("or AUTO"), ours[0]
    assert live.run(["squeue", "-h", "-u", USER, "-o", "%i"]).stdout.split() == []


def test_srun_two_nodes_contract(live: LiveCluster) -> None:
    p = live.run(["srun", "-N2", "-w", "n1,n2", "-l", "env"], user=USER, timeout=120)
    tasks = labelled_env(p.stdout)
    assert sorted(tasks) == [0, 1], p.stdout + p.stderr
    job_id = int(tasks[0]["SLURM_JOB_ID"])
    master_ip = node_ipv4(live, "n1")
    assert master_ip == "127.0.0.1"  # all local nodes have NodeAddr=127.0.0.1
    for env in tasks.values():
        node_rank = int(env["SLURM_NODEID"])
        assert env["RANK"] == env["NODE_RANK"] == str(node_rank)
        assert env["WORLD_SIZE"] == "2"
        assert env["MASTER_IP"] == env["MASTER_ADDR"] == env["HAI_MASTER_IP"] == master_ip
        assert env["HAI_MASTER_NODE"] == "n1"
        assert env["MASTER_PORT"] == str(expected_port(live, job_id))
        assert env["HAI_RESTART_COUNT"] == "0"
        assert env["HAI_CONTRACT"] == "spank"
    assert {env["RANK"] for env in tasks.values()} == {"0", "1"}


def test_contract_follows_the_step_not_the_job(live: LiveCluster) -> None:
    """Inside a 3-node allocation a step on n2,n3 has its own master and ranks, several
    tasks per node share their node's rank, and a launcher's own contract is left alone."""
    d = live.shared_dir("spank-steps", owner=USER)
    script = f"""#!/bin/bash
#SBATCH -N3 -w n[1-3] -o {d}/out
{SHOW}
echo "batch $(show)"
srun -N2 -n4 -w n2,n3 bash -c "$(declare -f show); echo \\"sub \\$(show) PROCID=\\$SLURM_PROCID NODEID=\\$SLURM_NODEID\\""
HAI_CONTRACT=launcher RANK=7 srun -N2 -w n1,n2 bash -c "$(declare -f show); echo \\"own \\$(show)\\""
HAI_MASTER_PORT=2345 srun -N1 -w n3 bash -c "$(declare -f show); echo \\"port \\$(show)\\""
"""
    job = live.sbatch(user=USER, script=script)
    live.wait_job(job, lambda j: j.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"), 120, "the job to end")
    text = (d / "out").read_text()
    assert live.job(job).get("JobState") == "COMPLETED", text

    (batch,) = parse_env_lines(text, "batch")
    assert batch["RANK"] == "0" and batch["WORLD_SIZE"] == "3", text  # the job's launcher on node 0
    assert batch["HAI_MASTER_NODE"] == "n1" and batch["MASTER_IP"] == node_ipv4(live, "n1")
    assert batch["MASTER_PORT"] == str(expected_port(live, job))

    sub = parse_env_lines(text, "sub")
    assert len(sub) == 4, text
    for env in sub:
        assert env["WORLD_SIZE"] == "2" and env["HAI_MASTER_NODE"] == "n2", env
        assert env["RANK"] == env["NODEID"], env
        assert env["MASTER_IP"] == node_ipv4(live, "n2") and env["HAI_CONTRACT"] == "spank"
    assert sorted(e["RANK"] for e in sub) == ["0", "0", "1", "1"]

    own = parse_env_lines(text, "own")
    assert len(own) == 2 and all(e["HAI_CONTRACT"] == "launcher" and e["RANK"] == "7" for e in own), text

    (port,) = parse_env_lines(text, "port")
    assert port["MASTER_PORT"] == "2345" and port["HAI_CONTRACT"] == "spank", text


def test_restart_count_after_requeue(live: LiveCluster) -> None:
    d = live.shared_dir("spank-requeue", owner=USER)
    script = f"""#!/bin/bash
#SBATCH -N2 -o {d}/out --open-mode=append
{SHOW}
echo "batch $(show)"
srun -N2 -l bash -c "$(declare -f show); echo \\"step \\$(show)\\"" | sed 's/^[0-9]*: //'
sleep 300
"""
    job = live.sbatch(user=USER, script=script)
    out = d / "out"

    def runs(kind: str) -> list[dict[str, str]]:
        return parse_env_lines(out.read_text(), kind) if out.exists() else []

    wait_for(lambda: len(runs("step")) == 2, 60, "the first run's step output")
    live.run(["scontrol", "requeue", str(job)])
    # No `StartTime=now` here: a relaunch in the requeue's own second is killed by slurmctld
    # ("Job credential revoked", the job ends FAILED); Slurm starts it after cred_expire.
    live.wait_job(job, lambda j: j.get("JobState") == "PENDING", 60, "the requeued job to pend")
    wait_for(lambda: len(runs("step")) == 4, 120, "the second run's step output")
    live.run(["scancel", str(job)])

    batch, step = runs("batch"), runs("step")
    assert [b["HAI_RESTART_COUNT"] for b in batch] == ["0", "1"], out.read_text()
    assert [s["HAI_RESTART_COUNT"] for s in step] == ["0", "0", "1", "1"], out.read_text()
    assert all(e["HAI_CONTRACT"] == "spank" and e["WORLD_SIZE"] == "2" for e in batch + step)
    assert sorted(s["RANK"] for s in step[2:]) == ["0", "1"]


def test_no_plugin_errors_in_daemon_logs(live: LiveCluster, log_marks: dict[Path, int]) -> None:
    """Runs last in this module: everything above must have left no plugin error."""
    # one more ordinary step, so the check also covers a plain job
    live.run(["srun", "-N1", "true"], user=USER, timeout=120)
    bad = []
    for path in sorted(live.log_dir.glob("slurm*.log")):
        with path.open("rb") as f:
            f.seek(log_marks.get(path, 0))
            for line in f.read().decode(errors="replace").splitlines():
                if PLUGIN_ERROR.search(line):
                    bad.append(f"{path.name}: {line}")
    assert not bad, "\n".join(bad)


# ----------------------------------------------------------------- what a user sends the plugin (issue 57)
# After test_no_plugin_errors_in_daemon_logs: the second test makes the plugin log on purpose.


@pytest.mark.parametrize("option", ["--hai-priority", "--hai-grace"])
def test_an_oversized_option_value_is_refused_in_one_line(live: LiveCluster, option: str) -> None:
    p = live.run(["sbatch", f"{option}={'9' * 100_000}", "-o", "/dev/null", "--wrap=true"], user="hai-bob",
                 check=False)
    assert p.returncode != 0
    ours = [line for line in p.stderr.splitlines() if "hai:" in line]
    assert ours == [f"sbatch: error: hai: {option} refused: its value is longer than 256 bytes; give a "
                    + ("number of seconds" if option == "--hai-grace" else "level's name or number")], p.stderr
    # (Slurm's own "Invalid --hai-... argument: VALUE" line after it echoes the value whole)
    assert live.run(["squeue", "-h", "-u", "hai-bob", "-o", "%i"]).stdout.split() == []


def test_a_port_the_job_sets_cannot_forge_a_line_in_slurmds_log(live: LiveCluster) -> None:
    """HAI_MASTER_PORT is the job's: a bad one leaves the contract unset, and slurmd's log
    shows at most 64 bytes of it, its new lines as '?' (a long one: not at all)."""
    marks = {p: p.stat().st_size for p in live.log_dir.glob("slurmd-*.log")}
    forged = "error: hai: FORGED by hai-bob"
    for value in (f"7\n{forged}", f"7\n{forged}\n" + "x" * 10_000):
        p = live.run(["srun", "-N1", "-w", "n1", f"--export=ALL,HAI_MASTER_PORT={value}", "sh", "-c",
                      'echo "contract=${HAI_CONTRACT:-none}"'], user="hai-bob", timeout=120)
        assert "contract=none" in p.stdout, p.stdout + p.stderr
    logged = ""
    for path, mark in marks.items():
        with path.open("rb") as f:
            f.seek(mark)
            logged += f.read().decode(errors="replace")
    said = [line for line in logged.splitlines() if "HAI_MASTER_PORT=" in line]
    assert len(said) == 2, logged[-2000:]
    assert f"HAI_MASTER_PORT='7?{forged}' is not a port number" in said[0]
    assert "HAI_MASTER_PORT='(too long)' is not a port number" in said[1]
    assert not [line for line in logged.splitlines() if line.startswith(forged) or "xxxxxxxx" in line]
