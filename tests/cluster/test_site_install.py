"""slurm-hai added to a running cluster of a site's own, from the built wheel alone, and
taken out again (docs/admin-guide.md, "Adding slurm-hai to a running cluster").

A second local cluster boots in site mode (`contrib/localcluster/up --site`, its own state
directory and ports): QOS `normal` and `high` of the site's own settings, an account `lab`,
partitions `batch` (the default) and `debug`, PreemptMode=CANCEL and a job_submit.lua that
charges a job with no account to `lab`. The wheel (`python -m build --wheel`) goes into a
fresh virtualenv outside the checkout (torch and the other dependencies reach it through a
.pth naming this environment's site-packages, whose own .pth files, the checkout's editable
install among them, are not read), and every slurm-hai command below is that venv's.

Proved (each an assertion that can fail):
  * `hai-admin plan` warns, one line each, that PreemptMode=CANCEL cancels a preempted job
    and that QOS high and normal are the site's; `apply` without --adopt refuses in one line
    and changes nothing;
  * installed as the guide says (render; hai-policy.conf included from slurm.conf; the SPANK
    plugin built against this Slurm by `hai-admin spank install`; slurm-hai's job_submit.lua
    called from the site's; `apply --adopt high,normal`; the policy daemon and a persist
    agent on each node), a 4-node job from the wheel's hai-submit is charged to `lab` by the
    site's job_submit.lua and runs at NORMAL; a HIGH job (plain sbatch through the SPANK
    plugin) preempts it; it suspends with go_suspend, is requeued (never cancelled) and
    ends with weights bitwise equal to an uninterrupted run;
  * `apply --remove` and the guide's removal steps give back the QOS, associations,
    partitions, slurm.conf and preemption mode exactly as they were before the install.
  * a new admin's walk of the guide's "Setting up a cluster" with its commands as written:
    `hai-admin files docs`, the shipped policy.example.toml copied, checked and edited where it
    says SITE:, `render`, the `Include`, `plan` naming `apply --adopt high,normal`, that apply,
    `plan` then "no change", and `hai-admin units` writing units that run this venv's
    hai-admin, name installed documentation and the policy where the guide copied it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import LOCALCLUSTER, STATE, LiveCluster
from test_site_policy import (STEPS, TRAIN, TRAIN_ARGS, accounting, events, final, last_step, named,  # noqa: F401
                              reference, same_weights, user_file)
from waiting import wait_for

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
# beside the session's cluster, on ports of its own: a private session cluster
# (HAI_CLUSTER_DIR, HAI_CLUSTER_PORT_BASE) gets a private site cluster too
SITE_STATE = STATE.with_name(f"{STATE.name}-site")
SITE_PORT_BASE = int(os.environ.get("HAI_CLUSTER_PORT_BASE", "16800")) - 200
ALICE = "hai-alice"
POLICY = """\
# HAI's ladder on the site's partition batch, for the users of the site's account lab
accounts = ["lab"]
min_gpus = 0

[groups.batch]
nodes = "n[1-4]"
priority_tier = 3
"""
# The lines the guide adds to a site's job_submit.lua, before its last line (`return slurm.SUCCESS`).
LUA_HOOK = """\
-- slurm-hai: its rules after the site's own (docs/admin-guide.md)
local site_job_submit, site_job_modify = slurm_job_submit, slurm_job_modify
dofile("{path}")
local hai_job_submit, hai_job_modify = slurm_job_submit, slurm_job_modify
function slurm_job_submit(job_desc, part_list, submit_uid)
   local rc = site_job_submit(job_desc, part_list, submit_uid)
   if rc ~= slurm.SUCCESS then return rc end
   return hai_job_submit(job_desc, part_list, submit_uid)
end
function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
   local rc = site_job_modify(job_desc, job_rec, part_list, modify_uid)
   if rc ~= slurm.SUCCESS then return rc end
   return hai_job_modify(job_desc, job_rec, part_list, modify_uid)
end
"""


def localcluster(command: str, env: dict[str, str]) -> None:
    p = subprocess.run([sys.executable, str(LOCALCLUSTER), *command.split()], env=env, text=True,
                       capture_output=True, timeout=600)
    assert p.returncode == 0, f"localcluster {command}: {p.stdout[-3000:]}{p.stderr[-3000:]}"


def site_env(cluster: LiveCluster) -> dict[str, str]:
    """contrib/localcluster's environment for the site cluster, on the session's Slurm."""
    env = {**os.environ, "HAI_CLUSTER_DIR": str(SITE_STATE), "HAI_CLUSTER_PORT_BASE": str(SITE_PORT_BASE),
           "HAI_CLUSTER_FIRST_JOB_ID": "60000"}
    env.pop("HAI_SLURM_SOURCE", None)
    env["HAI_SLURM_PREFIX"] = (cluster.state / "etc" / "slurm-prefix").read_text().strip()
    return env


@pytest.fixture(scope="module")
def site_cluster(cluster: LiveCluster):
    """A cluster in site mode on the session's Slurm, booted fresh and removed after."""
    env = site_env(cluster)
    if SITE_STATE.exists():
        localcluster("down", env)
        shutil.rmtree(SITE_STATE)
    localcluster("up --site", env)
    try:
        yield LiveCluster(SITE_STATE)
    finally:
        localcluster("down", env)
        shutil.rmtree(SITE_STATE, ignore_errors=True)


@pytest.fixture(scope="module")
def wheel_venv(site_cluster: LiveCluster, tmp_path_factory) -> Path:
    """The wheel, built from the checkout, in a fresh venv every test user can run."""
    out = tmp_path_factory.mktemp("wheel")
    p = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--outdir", str(out), str(REPO)],
                       text=True, capture_output=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (wheel,) = out.glob("slurm_hai-*.whl")
    venv = SITE_STATE / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    p = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                        "--no-deps", "--no-index", str(wheel)], text=True, capture_output=True)
    assert p.returncode == 0, p.stdout + p.stderr
    (site_packages,) = (venv / "lib").glob("python3*/site-packages")
    ours = next(Path(p) for p in sys.path if p.endswith("site-packages") and (Path(p) / "torch").is_dir())
    (site_packages / "dependencies.pth").write_text(f"{ours}\n")
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import slurm_hai, torch; print(slurm_hai.__file__)"],
                           text=True, capture_output=True, cwd="/", env={"PATH": "/usr/bin:/bin"})
    assert where.returncode == 0 and where.stdout.startswith(str(site_packages)), where.stdout + where.stderr
    return venv


def snapshot(c: LiveCluster) -> dict[str, str]:
    """What an install may change and a removal must give back, as Slurm shows it."""
    qos = ["sacctmgr", "-nP", "show", "qos", "format=Name,Priority,GraceTime,Preempt,PreemptMode,Flags,"
           "UsageFactor,MaxTRESPU,MaxWall,PreemptExemptTime,Description"]
    assoc = ["sacctmgr", "-nP", "show", "assoc", "format=Cluster,Account,User,Partition,Share,QOS,DefaultQOS,"
             "GrpTRES,MaxJobs"]
    config = c.run(["scontrol", "show", "config"]).stdout
    return {"qos": c.run(qos).stdout, "associations": c.run(assoc).stdout,
            "partitions": c.run(["scontrol", "show", "partition", "-o"]).stdout,
            "slurm.conf": c.conf.read_text(),
            "preemption": "\n".join(line for line in config.splitlines()
                                    if line.split("=")[0].strip() in ("PreemptMode", "PreemptType", "JobRequeue"))}


def test_added_from_the_wheel_to_a_sites_cluster_preempts_resumes_bitwise_and_comes_out_leaving_it_as_it_was(
        site_cluster: LiveCluster, wheel_venv: Path, reference):
    c = site_cluster
    etc = c.state / "etc"
    home = etc / "slurm-hai"  # where the admin keeps the policy and what render writes
    home.mkdir(mode=0o755)
    policy = home / "policy.toml"
    policy.write_text(POLICY)
    c.env = {**c.env, "HAI_POLICY": str(policy), "PATH": f"{wheel_venv / 'bin'}:{c.env['PATH']}"}
    tool = {name: str(wheel_venv / "bin" / name) for name in ("hai-admin", "hai-submit", "hai")}
    before = snapshot(c)
    site_lua = (etc / "job_submit.lua").read_text()
    assert "PreemptMode = CANCEL" in " ".join(before["preemption"].split()), before["preemption"]

    # -- what would defeat slurm-hai, one line each; nothing of the site's changed unasked
    out = c.run([tool["hai-admin"], "check", "--policy", str(policy)], cwd="/").stdout
    assert out.startswith(f"{policy}: valid"), out
    plan = c.run([tool["hai-admin"], "plan"], check=False, cwd="/")
    assert plan.returncode == 3, plan.stdout + plan.stderr
    warnings = [line for line in plan.stderr.splitlines() if line.startswith("warning: ")]
    assert any("PreemptMode=CANCEL cancels a preempted job" in w for w in warnings), plan.stderr
    assert [re.match(r"warning: QOS (\w+) is the site's", w).group(1) for w in warnings
            if w.startswith("warning: QOS ")] == ["high", "normal"], plan.stderr
    assert plan.stdout.splitlines()[-1].endswith("run `hai-admin apply --adopt high,normal` to make them"), plan.stdout
    refused = c.run([tool["hai-admin"], "apply"], check=False, cwd="/")
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stdout + refused.stderr
    assert "QOS high, normal of the site would be changed" in refused.stderr and "--adopt high,normal" in refused.stderr
    assert snapshot(c) == before

    # -- the install, as docs/admin-guide.md says
    include = f"Include {home / 'hai-policy.conf'}"
    plugin_dir = c.state / "lib" / "slurm-hai"
    prefix = (etc / "slurm-prefix").read_text().strip()  # empty: Debian's Slurm, headers in /usr/include
    headers = ["--slurm-include", f"{prefix}/include"] if prefix else []
    c.run([tool["hai-admin"], "spank", "install", "--plugin-dir", str(plugin_dir), *headers], cwd="/")
    c.run([tool["hai-admin"], "render", "--out", str(home), "--spank-plugin", str(plugin_dir / "hai_spank.so")],
          cwd="/")
    with c.conf.open("a") as conf:
        conf.write(f"{include}\n")
    shutil.copy(home / "plugstack.conf", etc / "plugstack.conf")
    shutil.copy(home / "job_submit.lua", etc / "hai_job_submit.lua")
    head, last = site_lua.rstrip("\n").rsplit("\n", 1)
    assert last == "return slurm.SUCCESS", site_lua
    (etc / "job_submit.lua").write_text(f"{head}\n{LUA_HOOK.format(path=etc / 'hai_job_submit.lua')}{last}\n")
    c.run(["scontrol", "reconfigure"])
    wait_for(lambda: "PreemptMode = REQUEUE" in " ".join(snapshot(c)["preemption"].split()), 30,
             "PreemptMode=REQUEUE in force")
    applied = c.run([tool["hai-admin"], "apply", "--adopt", "high,normal"], cwd="/")
    assert "change(s) applied" in applied.stdout, applied.stdout
    again = c.run([tool["hai-admin"], "plan"], check=False, cwd="/")
    assert again.returncode == 0 and not [w for w in again.stderr.splitlines() if w.startswith(("warning: ", "note: "))], \
        again.stdout + again.stderr  # the site's job_submit.lua that calls slurm-hai's is not a stale one of ours
    daemon_log = home / "daemon.log"
    daemons = [subprocess.Popen([tool["hai-admin"], "daemon", "--interval", "0.5", "--lock", str(home / "policyd.lock")],
                                env=c.env, cwd="/", stdout=daemon_log.open("w"), stderr=subprocess.STDOUT)]
    for node in ("n1", "n2", "n3", "n4"):
        daemons.append(subprocess.Popen(["nsenter", f"--target={c.node_pid(node)}", "--mount", "--", tool["hai-admin"],
                                         "persist-agent", "--sweep-every", "5"], env=c.env, cwd="/",
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        wait_for(lambda: "policy daemon started" in daemon_log.read_text(), 20, "the policy daemon to start")

        # -- a preemption that resumes bitwise, every part of slurm-hai the wheel's
        script = user_file(c, "site-install-train", TRAIN.read_text())
        out = c.run([tool["hai-submit"], "--json", "-n", "4", str(script), "--", *TRAIN_ARGS], user=ALICE).stdout
        submitted = json.loads(out)
        job, job_dir = submitted["job_id"], Path(submitted["job_dir"])
        info = c.wait_job(job, lambda j: j["JobState"] == "RUNNING", 90, "the NORMAL job to run")
        # the site's job_submit.lua chose the account, slurm-hai's the level
        assert (info["Account"], info["QOS"], info["Partition"]) == ("lab", "normal", "batch"), info
        assert info["AdminComment"].split()[0] == "hai-level=NORMAL", info
        wait_for(lambda: last_step(job_dir) >= 20, 120, "the NORMAL job to train", 0.2)
        high = c.sbatch("-N1", "--hai-priority=high", "-o", "/dev/null", "--wrap", "sleep 600", user=ALICE)
        try:
            suspended = wait_for(lambda: named(job_dir, "suspended"), 60, "the NORMAL job to suspend")
        except AssertionError as e:
            log = (c.state / "log" / "slurmctld.log").read_text().splitlines()[-40:]
            raise AssertionError(f"{e}\nHIGH job: {c.job(high)}\nNORMAL job: {c.job(job)}\nevents: {events(job_dir)}"
                                 "\nslurmctld.log:\n" + "\n".join(log)) from None
        assert [e["how"] for e in suspended] == ["go_suspend"], suspended
        c.wait_job(high, lambda j: j["JobState"] == "RUNNING", 60, "the HIGH job to take a node")
        c.wait_job(job, lambda j: j["Restarts"] == "1", 30, "the NORMAL job to be requeued")

        def told() -> str | None:  # when it runs again: the site's batch has MaxTime=INFINITE, so HIGH has no limit
            st = json.loads(c.run([tool["hai"], "status", "--json", str(job)], user=ALICE, cwd="/").stdout)
            return st["reason"] if st["state"] == "suspended" and f"job {high} ends" in st["reason"] else None

        reason = wait_for(told, 30, "hai status to say when the suspended job runs again")
        assert f"runs again when job {high} ends, which has no time limit: no time can be told" in reason, reason
        c.run(["scancel", str(high)])
        result = final(job_dir, 240)
        assert result["state"] == "succeeded", result
        assert same_weights(job_dir / "final-weights.safetensors", reference()), "resumed weights differ"
        assert [e["run"] for e in events(job_dir) if e["event"] == "start"] == [0, 1]
        states = accounting(c, job)
        assert not [r for r in states if "." not in r[0] and r[1].startswith(("FAILED", "CANCELLED"))], states
    finally:
        for d in daemons:
            d.terminate()
            d.wait(15)
    assert "Traceback" not in daemon_log.read_text(), daemon_log.read_text()

    # -- the removal: apply --remove, then the guide's steps in the files, back in reverse
    c.cancel_all()
    removed = c.run([tool["hai-admin"], "apply", "--remove"], cwd="/")
    assert "slurm-hai is taken out" in removed.stdout, removed.stdout
    c.conf.write_text(before["slurm.conf"])
    (etc / "job_submit.lua").write_text(site_lua)
    (etc / "plugstack.conf").write_text("")
    c.run(["scontrol", "reconfigure"])
    wait_for(lambda: snapshot(c)["preemption"] == before["preemption"], 30, "PreemptMode=CANCEL again")
    after = snapshot(c)
    for key in before:
        assert after[key] == before[key], f"{key} before the install:\n{before[key]}\nafter the removal:\n{after[key]}"
    plan = c.run([tool["hai-admin"], "apply", "--remove"], cwd="/")
    # the removal took its record away too: nothing is known to take out, and it says why
    assert "no change: there is no install record at" in plan.stdout, plan.stdout


GUIDE = REPO / "docs" / "admin-guide.md"
# docs/admin-guide.md, "Setting up a cluster", as a new admin reads it: its commands as written
COPY = 'cp "$(hai-admin files docs)/policy.example.toml" /etc/slurm-hai/policy.toml'
CHECK = "hai-admin check"
RENDER = "hai-admin render --out /etc/slurm/hai"
INCLUDE = "Include /etc/slurm/hai/hai-policy.conf"
UNITS = "hai-admin units"
# The lines of the shipped example a site edits for this cluster: those marked SITE: (its
# account, its nodes), and the 8-GPU rule (its nodes have no GPUs).
SITE_EDITS = {'accounts = ["research"]': 'accounts = ["lab"]', "min_gpus = 8": "min_gpus = 0",
              '[groups.gpu]\nnodes = "gpu[001-064]"': '[groups.batch]\nnodes = "n[1-4]"'}


def test_a_new_admin_sets_it_up_from_the_wheel_with_the_admin_guides_commands_and_takes_it_out_again(
        cluster: LiveCluster, site_cluster: LiveCluster, wheel_venv: Path):
    c = site_cluster
    # A cluster that had slurm-hai and took it out (the test above, on this cluster) restarts
    # slurmdbd before installing it again, as the guide says: without it, slurmdbd's stale
    # Preempt lists refused this apply ("QOS Preemption loop detected", 22.05.8).
    slurmdbd = int((c.state / "run" / "slurmdbd.pid").read_text())
    os.kill(slurmdbd, signal.SIGTERM)
    wait_for(lambda: not Path(f"/proc/{slurmdbd}").exists(), 30, "slurmdbd to stop")
    localcluster("up --site", site_env(cluster))
    guide = GUIDE.read_text()
    for command in (COPY, f"`{CHECK}`", RENDER, INCLUDE, f"`{UNITS}`"):
        assert command in guide, f"docs/admin-guide.md no longer says {command}: walk what it says now"
    host_etc = c.state / "etc" / "new-admin"  # stands for the host's /etc, which other clusters share
    (host_etc / "slurm-hai").mkdir(parents=True)
    policy = host_etc / "slurm-hai" / "policy.toml"
    hai_admin = wheel_venv / "bin" / "hai-admin"
    # HAI_POLICY: where a bare `hai-admin check` looks on a site (/etc/slurm-hai/policy.toml), moved
    c.env = {**c.env, "HAI_POLICY": str(policy), "PATH": f"{wheel_venv / 'bin'}:{c.env['PATH']}"}
    before = snapshot(c)

    def shell(command: str) -> subprocess.CompletedProcess:
        return c.run(["bash", "-c", command.replace("/etc/", f"{host_etc}/")], check=False, cwd="/")

    # -- 1. the policy, from the example the wheel ships, checked, then edited for this site
    docs = Path(shell("hai-admin files docs").stdout.strip())
    assert (docs / "admin-guide.md").is_file() and (docs / "policy.md").is_file(), docs
    copied = shell(COPY)
    assert copied.returncode == 0 and policy.read_text() == (docs / "policy.example.toml").read_text(), copied.stderr
    checked = shell(CHECK)
    assert checked.returncode == 0 and checked.stdout.startswith(f"{policy}: valid"), checked.stdout + checked.stderr
    text = policy.read_text()
    for line, site in SITE_EDITS.items():
        assert line in text, f"the shipped example has no {line!r} to edit"
        text = text.replace(line, site)
    policy.write_text(text)
    assert shell(CHECK).stdout.startswith(f"{policy}: valid")

    # -- 2. the Slurm side: rendered, hai-policy.conf included from slurm.conf
    rendered = shell(RENDER)
    assert rendered.returncode == 0, rendered.stdout + rendered.stderr
    for name in ("hai-policy.conf", "job_submit.lua", "plugstack.conf", "partitions.conf"):
        assert (host_etc / "slurm" / "hai" / name).is_file(), rendered.stdout
    with c.conf.open("a") as conf:
        conf.write(INCLUDE.replace("/etc/", f"{host_etc}/") + "\n")
    c.run(["scontrol", "reconfigure"])
    wait_for(lambda: "PreemptMode = REQUEUE" in " ".join(snapshot(c)["preemption"].split()), 30,
             "PreemptMode=REQUEUE in force")

    # -- 3. plan names the apply to run; that apply makes it all; plan again: nothing left
    plan = shell("hai-admin plan")
    assert plan.returncode == 3, plan.stdout + plan.stderr
    told = re.fullmatch(r"\d+ change\(s\); run `(hai-admin apply[^`]*)` to make them", plan.stdout.splitlines()[-1])
    assert told and told.group(1) == "hai-admin apply --adopt high,normal", plan.stdout
    applied = shell(told.group(1))
    assert applied.returncode == 0 and f"change(s) applied from {policy}" in applied.stdout, \
        applied.stdout + applied.stderr
    again = shell("hai-admin plan")
    assert again.returncode == 0 and again.stdout == "no change: the cluster matches the policy\n", \
        again.stdout + again.stderr
    assert not [w for w in again.stderr.splitlines() if w.startswith("warning: ")], again.stderr

    # -- 4. the systemd units: this venv's hai-admin, documentation that is installed, the
    # policy where step 1 put it
    units = shell(f"{UNITS} --out /etc/systemd/system")
    assert units.returncode == 0, units.stdout + units.stderr
    unit_dir = host_etc / "systemd" / "system"
    assert sorted(p.name for p in unit_dir.iterdir()) == [
        "hai-lighthouse.service", "hai-policyd.service", "slurm-hai-persist.service"], units.stdout
    for unit in unit_dir.iterdir():
        lines = unit.read_text().splitlines()
        execs = [ln.split("=", 1)[1].split() for ln in lines if ln.startswith(("ExecStart=", "ExecStartPre="))]
        assert execs and all(argv[0] == str(hai_admin) for argv in execs), (unit.name, execs)
        (doc,) = [ln.split("=", 1)[1] for ln in lines if ln.startswith("Documentation=")]
        assert doc.startswith("file://") and Path(doc[len("file://"):]).is_file(), (unit.name, doc)
        env = dict(ln.split("=", 2)[1:] for ln in lines if ln.startswith("Environment="))
        for argv in execs:
            if argv[1] == "check":  # ExecStartPre: the policy the unit names, as systemd would run it
                argv = [env.get(a[2:-1], a).replace("/etc/", f"{host_etc}/") if a.startswith("${") else a
                        for a in argv]
                assert c.run(argv, cwd="/").stdout.startswith(f"{policy}: valid"), argv
    assert os.access(hai_admin, os.X_OK)

    # -- taken out again: apply --remove, the Include line out, the cluster as it was
    removed = shell("hai-admin apply --remove")
    assert "slurm-hai is taken out" in removed.stdout, removed.stdout + removed.stderr
    c.conf.write_text(before["slurm.conf"])
    c.run(["scontrol", "reconfigure"])
    wait_for(lambda: snapshot(c)["preemption"] == before["preemption"], 30, "PreemptMode=CANCEL again")
    after = snapshot(c)
    for key in before:
        assert after[key] == before[key], f"{key} before the install:\n{before[key]}\nafter the removal:\n{after[key]}"
