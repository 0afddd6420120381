"""A site's own policy, honoured the same everywhere, on the live local Slurm cluster.

tests/fixtures/site_policy.toml differs from HAI's policy in every section: its own ladder
(GOLD 30, SILVER 10, BRONZE 0: no HAI name), default level BRONZE, the notice signal TERM
(USR1 for the second part), a grace of 10 minutes, quota defaults with an account override
(account hai, every test user's) and a user override, its own node groups (`main`, the
default, and `debug` on n4, which takes BRONZE and SILVER only).

The module installs it as a site admin does: `hai-admin check`, `hai-admin render --out DIR`,
job_submit.lua and plugstack.conf copied where slurm.conf expects them (slurmctld re-reads
job_submit.lua when it changes; sbatch and slurmstepd read plugstack.conf each time),
`hai-admin apply --policy FILE` (QOS, associations, partitions), the policy daemon started
with `--policy FILE`, and HAI_POLICY pointing at the file for the users' `hai` commands. At
the end the cluster's own files are put back byte for byte, the site's QOS and partitions
deleted and contrib/localcluster/policy.toml applied again; a probe job then lands in HAI's
NORMAL level on partition gpu again.

Proved (each an assertion that can fail):
  * a 4-node job from `hai-submit` without -p runs at BRONZE in the site's default group;
  * a GOLD job (plain sbatch --hai-priority=gold, through the SPANK plugin and job_submit.lua)
    preempts it; the TERM notice is one notice, on rank 0's node (the other nodes' launchers,
    which get the same TERM, neither raise a flag nor end their ranks); the job suspends with
    go_suspend, is requeued (never failed) and ends with weights bitwise equal to an
    uninterrupted run;
  * quotas: a job larger than the account override is refused, one beyond what is left of it
    waits, a level the user's override forbids is refused, in the site's level names;
    AUTO in node group debug lands on SILVER; GOLD there is refused;
  * `hai list`, `hai status`, `hai quota` (the account override) and `hai-admin explain`
    speak GOLD/SILVER/BRONZE, never HAI's names;
  * one `hai-admin apply` leaves nothing for `hai-admin plan` to change;
  * with notice_signal = "USR1" (the daemon reloads the file) a second preemption's notice
    is USR1, seen on rank 0's node only; the job suspends and is requeued, never killed by the
    signal (exit 138).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import uninterrupted
from slurm_hai.jobs.jobdir import run_notices
from uninterrupted import TRAIN, same_weights
from waiting import wait_for

if TYPE_CHECKING:  # the fixtures come from tests/conftest.py
    from conftest import LiveCluster

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
SITE_POLICY = REPO / "tests" / "fixtures" / "site_policy.toml"
LOCAL_POLICY = REPO / "contrib" / "localcluster" / "policy.toml"
ADMIN = [sys.executable, "-m", "slurm_hai.cli.admin"]
ALICE, BOB = "hai-alice", "hai-bob"
# The files of the cluster's etc/ that a site install replaces (policy.toml: the policy beside
# slurm.conf, which every tool finds without HAI_POLICY).
INSTALLED = ("job_submit.lua", "plugstack.conf", "policy.toml")
RENDERED = {"hai-policy.conf", "partitions.conf", "qos-ladder.sh", "job_submit.lua", "plugstack.conf"}
SITE_QOS = ("gold", "gold.a.hai", "gold.u.hai-bob", "silver", "bronze")
SITE_PARTITIONS = ("main", "debug")
HAI_NAMES = re.compile(r"\b(EXTREME_HIGH|VERY_HIGH|HIGH|ABOVE_NORMAL|NORMAL|UNDER_NORMAL|BELOW_NORMAL|LOW)\b")
GRACE = 600  # grace_seconds = "10m"
# world size 4: 4 nodes x 1 process on the cluster, 1 x 4 for the reference
STEPS = 160
TRAIN_ARGS = ["--nprocs", "1", "--steps", str(STEPS), "--step-sleep", "0.05"]


def admin(c: LiveCluster, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return c.run([*ADMIN, *args], check=check, cwd=REPO)


def spank_plugin(c: LiveCluster) -> str:
    """Where the cluster's plugstack.conf loads hai_spank.so from."""
    for line in (c.state / "etc" / "plugstack.conf").read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if len(words) >= 2 and words[1].endswith("hai_spank.so"):
            return words[1]
    raise AssertionError("the cluster's plugstack.conf loads no hai_spank.so")


class Site:
    """The site policy installed on the cluster; `c` runs commands with HAI_POLICY set to it."""

    def __init__(self, cluster: LiveCluster) -> None:
        self.cluster = cluster
        self.home = cluster.shared_dir("site-policy")  # every user reads the policy file
        self.home.chmod(0o755)
        self.policy = self.home / "policy.toml"
        self.c = copy.copy(cluster)
        self.c.env = {**cluster.env, "HAI_POLICY": str(self.policy)}
        self.spank_so = spank_plugin(cluster)
        self.daemon: subprocess.Popen | None = None
        self.daemon_log = self.home / "daemon.log"

    def install(self, text: str) -> None:
        """check, render, install job_submit.lua and plugstack.conf, apply: a site admin's steps."""
        c, etc = self.c, self.cluster.state / "etc"
        self.policy.write_text(text)
        self.policy.chmod(0o644)
        out = admin(c, "check", "--policy", str(self.policy)).stdout
        assert out.startswith(f"{self.policy}: valid"), out
        rendered = self.home / "rendered"
        shutil.rmtree(rendered, ignore_errors=True)
        admin(c, "render", "--policy", str(self.policy), "--out", str(rendered), "--spank-plugin", self.spank_so)
        assert {p.name for p in rendered.iterdir()} == RENDERED
        for name in ("job_submit.lua", "plugstack.conf"):
            (etc / name).write_bytes((rendered / name).read_bytes())  # keeps the installed file's owner, mode
        (etc / "policy.toml").write_text(text)
        admin(c, "apply", "--quiet", "--policy", str(self.policy))
        self.after_apply = self.plan()  # what one `apply` left to change (the test asserts: nothing)

    def plan(self) -> subprocess.CompletedProcess:
        return admin(self.c, "plan", "--policy", str(self.policy), check=False)

    def start_daemon(self) -> None:
        out = self.daemon_log.open("w")
        self.daemon = subprocess.Popen([*ADMIN, "daemon", "--policy", str(self.policy), "--interval", "0.5",
                                        "--lock", str(self.home / "policyd.lock")], env=self.c.env, cwd=REPO,
                                       stdout=out, stderr=subprocess.STDOUT)
        out.close()
        wait_for(lambda: "policy daemon started" in self.log() or self.daemon.poll() is not None, 20,
                 "the policy daemon to start")
        assert self.daemon.poll() is None, self.log()

    def log(self) -> str:
        return self.daemon_log.read_text() if self.daemon_log.exists() else ""

    def stop_daemon(self) -> None:
        if self.daemon is None:
            return
        self.daemon.terminate()
        try:
            self.daemon.wait(15)
        except subprocess.TimeoutExpired:
            self.daemon.kill()
            self.daemon.wait()
        self.daemon = None


def probe(c: LiveCluster, *args: str, user: str = ALICE) -> dict[str, str]:
    """Where a held job lands (job_submit.lua has run; it never starts); the job is cancelled."""
    job = c.sbatch("--hold", "-o", "/dev/null", *args, "--wrap", "true", user=user)
    try:
        return c.job(job)
    finally:
        c.run(["scancel", str(job)], check=False)


@pytest.fixture(scope="module")
def site(cluster: LiveCluster):
    etc = cluster.state / "etc"
    saved = {name: (etc / name).read_bytes() for name in INSTALLED}
    plan_before = admin(cluster, "plan", "--policy", str(LOCAL_POLICY), check=False).returncode
    cluster.cancel_all()
    s = Site(cluster)
    try:
        s.install(SITE_POLICY.read_text())
        s.start_daemon()
        yield s
    finally:
        s.stop_daemon()
        cluster.cancel_all()
        errors: list[str] = []
        for name, data in saved.items():
            (etc / name).write_bytes(data)
        # the local policy first (default QOS back to normal: hai-bob, whose override replaces
        # normal, may use it for the moment of the change), then what only the site had: its
        # QOS out of the associations (`apply` keeps QOS it does not know), then deleted
        p = admin(cluster, "apply", "--quiet", "--policy", str(LOCAL_POLICY), check=False)
        if p.returncode != 0:
            errors.append(f"hai-admin apply --policy {LOCAL_POLICY}: exit {p.returncode}: {p.stdout}{p.stderr}")
        for argv in (*(["scontrol", "delete", f"PartitionName={p}"] for p in SITE_PARTITIONS
                       if cluster.run(["scontrol", "show", "partition", p], check=False).returncode == 0),
                     ["sacctmgr", "-i", "modify", "account", "where", "name=hai", "set", f"qos-={','.join(SITE_QOS)}"],
                     ["sacctmgr", "-i", "modify", "user", "where", "account=hai", "set",
                      f"qos-={','.join(SITE_QOS)}"],
                     ["sacctmgr", "-i", "delete", "qos", ",".join(SITE_QOS)],
                     [*ADMIN, "apply", "--quiet", "--policy", str(LOCAL_POLICY)]):
            p = cluster.run(argv, check=False, cwd=REPO)
            if p.returncode != 0:
                errors.append(f"{' '.join(argv)}: exit {p.returncode}: {p.stdout}{p.stderr}")
        assert all((etc / name).read_bytes() == data for name, data in saved.items())
        qos = cluster.run(["sacctmgr", "-nP", "show", "qos", "format=name"]).stdout.split()
        parts = cluster.run(["sinfo", "-h", "-o", "%R"]).stdout.split()
        assert not set(SITE_QOS) & set(qos) and not set(SITE_PARTITIONS) & set(parts), (qos, parts)
        if plan_before == 0:
            plan = admin(cluster, "plan", "--policy", str(LOCAL_POLICY), check=False)
            assert plan.returncode == 0, plan.stdout + plan.stderr
        back = wait_for(lambda: probe(cluster), 10, "a probe job")
        assert (back["QOS"], back["Partition"]) == ("normal", "gpu"), back  # HAI's default level again
        text = s.log()
        assert "Traceback" not in text, text
        assert not errors, "\n".join(errors)


@pytest.fixture
def on_site(site: Site, live: LiveCluster) -> Site:
    """The site policy in force, no job left from before (nor after). `live` may have run
    `scontrol reconfigure` (Slurm 22.05), which drops partitions made with scontrol: apply
    again, as an admin would (it changes only what differs)."""
    admin(site.c, "apply", "--quiet", "--policy", str(site.policy))
    return site


@pytest.fixture(scope="module")
def reference(cluster: LiveCluster):
    """train.py uninterrupted, world size 4 (1 process x 4 here; 4 nodes x 1 on the cluster),
    run beside the cluster jobs: the fixture gives a function that waits for its weights."""
    args = [a for a in TRAIN_ARGS if a not in ("--step-sleep", "0.05")]
    args[args.index("--nprocs") + 1] = "4"
    run = uninterrupted.Run(args, timeout=300)
    yield run.weights
    run.stop()


# ----------------------------------------------------------------------------- helpers


def events(job_dir: Path) -> list[dict]:
    path = job_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def named(job_dir: Path, name: str) -> list[dict]:
    return [e for e in events(job_dir) if e["event"] == name]


def rank_log(job_dir: Path, rank: int) -> str:
    path = job_dir / "logs" / f"rank-{rank}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def last_step(job_dir: Path) -> int:
    steps = re.findall(r"^\[train\] .* step (\d+)/", rank_log(job_dir, 0), re.M)
    return int(steps[-1]) if steps else 0


def user_file(c: LiveCluster, name: str, text: str, user: str = ALICE) -> Path:
    d = c.shared_dir(name, owner=user)
    path = d / Path(name).with_suffix(".py").name
    path.write_text(text)
    shutil.chown(path, user, user)
    return path


def hai_submit(c: LiveCluster, *args: str, user: str = ALICE) -> tuple[int, Path]:
    out = json.loads(c.run(["hai-submit", "--json", *args], user=user).stdout)
    return out["job_id"], Path(out["job_dir"])


def sbatch_refusal(c: LiveCluster, *args: str, user: str = ALICE) -> str:
    """The one `hai:` line of a submission job_submit.lua (or the plugin) refuses."""
    p = c.run(["sbatch", "-o", "/dev/null", *args, "--wrap", "true"], user=user, check=False)
    assert p.returncode != 0, f"sbatch {' '.join(args)} was accepted: {p.stdout}"
    ours = [line for line in p.stderr.splitlines() if "hai:" in line]
    assert len(ours) == 1, p.stderr
    return ours[0]


def final(job_dir: Path, timeout: float) -> dict:
    return wait_for(lambda: (job_dir / "final.json").exists() and json.loads((job_dir / "final.json").read_text()),
                    timeout, f"{job_dir} to end")


def accounting(c: LiveCluster, job: int) -> list[tuple[str, str, str]]:
    """(step, state, exit code) of every record of every run of `job` (sacct --duplicates)."""
    out = c.run(["sacct", "-j", str(job), "--duplicates", "-n", "-P", "-o", "JobID,State,ExitCode"]).stdout
    return [tuple(line.split("|")) for line in out.splitlines() if line.strip()]


def no_hai_names(text: str, what: str) -> None:
    found = HAI_NAMES.findall(text)
    assert not found, f"{what} names HAI's levels {found}:\n{text}"


# ----------------------------------------------------------------------------- tests


def test_site_levels_preempt_with_a_term_notice_on_rank0_resume_bitwise_and_speak_the_site_s_words(reference, on_site):
    s = on_site
    c = s.c
    # -- submission: the site's names, groups and quotas, in the site's words
    auto = probe(c, "-p", "debug", "--hai-priority=AUTO")
    assert (auto["QOS"], auto["Partition"]) == ("silver", "debug"), auto  # debug's highest level
    assert auto["AdminComment"].split() == ["hai-level=AUTO", f"hai-grace={GRACE}"], auto
    line = sbatch_refusal(c, "-p", "debug", "--hai-priority=GOLD")
    assert "node group debug takes jobs at BRONZE, SILVER only" in line, line
    line = sbatch_refusal(c, "-N4", "--hai-priority=GOLD")  # the account override: 3 GOLD nodes
    assert "hai: 4 nodes at GOLD exceed your quota of 3 nodes at that level" in line, line
    line = sbatch_refusal(c, "--hai-priority=gold", user=BOB)  # bob's own override: no GOLD
    assert "hai: your quota at GOLD is 0 nodes" in line, line
    line = sbatch_refusal(c, "--hai-priority=HIGH")
    assert "unknown priority level 'HIGH'; use one of GOLD(30), SILVER(10), BRONZE(0) or AUTO" in line, line
    script = user_file(c, "site-train", TRAIN.read_text())
    p = c.run(["hai-submit", "-n", "4", "-p", "GOLD", str(script)], user=ALICE, check=False)
    assert p.returncode != 0 and "4 nodes at GOLD exceed your quota of 3 nodes at that level" in p.stderr, p.stderr

    # -- a 4-node job at the default level, BRONZE
    job, job_dir = hai_submit(c, "-n", "4", str(script), "--", *TRAIN_ARGS)
    info = c.wait_job(job, lambda j: j["JobState"] == "RUNNING", 90, "the BRONZE job to run")
    assert (info["QOS"], info["Partition"], info["NumNodes"]) == ("bronze", "main", "4"), info
    assert info["AdminComment"].split() == ["hai-level=BRONZE", f"hai-grace={GRACE}"], info
    batch = c.run(["scontrol", "write", "batch_script", str(job), "-"]).stdout
    assert re.search(r"^#SBATCH --signal=(\w+:)?TERM@\d+$", batch, re.M), batch  # the policy's notice signal
    wait_for(lambda: last_step(job_dir) >= 20, 120, "the BRONZE job to train", 0.2)

    # -- a GOLD job preempts it: plain sbatch through the SPANK plugin
    gold = c.sbatch("-N2", "--hai-priority=gold", "-o", "/dev/null", "--wrap", "sleep 600", user=ALICE)
    notice = wait_for(lambda: named(job_dir, "notice"), 30, "the notice")
    suspended = wait_for(lambda: named(job_dir, "suspended"), 60, "the BRONZE job to suspend")
    assert [e["how"] for e in suspended] == ["go_suspend"], suspended
    info = c.wait_job(gold, lambda j: j["JobState"] == "RUNNING", 60, "the GOLD job to take the nodes")
    assert info["QOS"] == "gold.a.hai", info  # GOLD through the account's quota variant
    # The job Slurm preempted it for is the policy daemon's word, which a run that leaves
    # within a daemon cycle of the notice may not hear (docs/design.md, "Where a notice's
    # cause comes from"); the USR1 test below waits for it and asks it in the site's words.
    assert notice[0]["run"] == 0 and notice[0].get("cause") == "preempted", notice
    requeued = c.wait_job(job, lambda j: j["Restarts"] == "1" and j["JobState"] == "PENDING", 30,
                          "the BRONZE job to wait, requeued")
    assert requeued["QOS"] == "bronze", requeued

    # -- quotas hold: a second GOLD job beyond what is left of alice's 3 nodes waits
    over = c.sbatch("-N2", "--hai-priority=GOLD", "-o", "/dev/null", "--wrap", "sleep 600", user=ALICE)
    c.wait_job(over, lambda j: j["Reason"] == "QOSMaxNodePerUserLimit", 30, "Slurm's quota reason")
    why = admin(c, "explain", str(over)).stdout
    assert "over quota at GOLD: 2/3 nodes in use" in why, why

    # -- every command speaks the site's names
    listing = c.run(["hai", "list"], user=ALICE).stdout
    ours = [line for line in listing.splitlines() if line.split()[0] in (str(job), str(gold), str(over))]
    assert len(ours) == 3 and {"GOLD", "BRONZE"} <= set(" ".join(ours).split()), listing
    no_hai_names("\n".join(ours), "hai list")  # (jobs of earlier tests ran at HAI's levels)
    status = c.run(["hai", "status", str(job)], user=ALICE).stdout
    assert re.search(r"^level\s+BRONZE$", status, re.M), status
    no_hai_names(status, "hai status")
    quota = c.run(["hai", "quota"], user=ALICE).stdout
    rows = {line.split()[0]: line.split()[1:] for line in quota.splitlines()
            if line.split()[:1] in (["GOLD"], ["SILVER"], ["BRONZE"])}
    # GOLD: the account's override (3 nodes), in use by the running GOLD job
    assert rows == {"GOLD": ["30", "2", "3"], "SILVER": ["10", "0", "2"], "BRONZE": ["0", "0", "no", "limit"]}, quota
    no_hai_names(quota, "hai quota")
    # the BRONZE job waits at its level once Slurm's requeue delay is over ("held back after
    # requeue" names no level)
    explained = wait_for(lambda: (lambda out: out if "BRONZE" in out else None)(admin(c, "explain").stdout), 30,
                         "hai-admin explain to show the requeued job waiting at BRONZE")
    assert "GOLD" in explained, explained
    no_hai_names(explained, "hai-admin explain")

    # -- the GOLD jobs end: the BRONZE job resumes where it stopped and ends bitwise equal
    c.run(["scancel", str(over), str(gold)])
    result = final(job_dir, 240)
    assert result["state"] == "succeeded", result
    assert same_weights(job_dir / "final-weights.safetensors", reference()), "resumed weights differ"
    ev = events(job_dir)
    assert [e["run"] for e in ev if e["event"] == "start"] == [0, 1], ev
    assert len([e for e in ev if e["event"] == "notice"]) == 1, ev  # one notice: rank 0's node's
    assert not [e for e in ev if e["event"] in ("forced_suspend", "killed", "retry")], ev
    committed = [int(m) for m in re.findall(r"checkpoint step (\d+) committed", rank_log(job_dir, 0))]
    resumed = [int(m) for m in re.findall(r"resumed from step (\d+)", rank_log(job_dir, 0))]
    assert resumed == committed[-1:] and 0 < resumed[0] < STEPS, (committed, resumed)
    for rank in (1, 2, 3):  # the other nodes got the TERM too; their ranks went on to the suspend
        text = rank_log(job_dir, rank)
        assert "Traceback" not in text and text.count("==== slurm-hai run") == 2, text
    states = accounting(c, job)
    assert not [r for r in states if "." not in r[0] and r[1].startswith("FAILED")], states  # runs: none failed
    # one `hai-admin apply` left nothing to change: the cluster matched the site policy
    plan = s.after_apply
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert "differs from what this policy renders" not in plan.stderr, plan.stderr


COUNTER = """
    import json, os, sys, time
    from pathlib import Path
    import slurm_hai as hai

    OUT, STEPS = Path(sys.argv[1]), int(sys.argv[2])
    rank, run = int(os.environ["RANK"]), hai.restart_count()
    ckpt = OUT / "ckpt.json"
    step = json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0
    (OUT / f"alive.{run}.{rank}").write_text(str(step))
    # rank 0 counts; every rank polls the notice, and notes it if it sees it
    while step < STEPS if rank == 0 else not (OUT / "done").exists():
        if hai.receive_suspend_command():
            if not (OUT / f"seen.{run}.{rank}").exists():
                (OUT / f"seen.{run}.{rank}").write_text(str(step))
            if rank == 0:
                tmp = OUT / ".ckpt.tmp"
                tmp.write_text(json.dumps({"step": step}))
                os.replace(tmp, ckpt)
                hai.target_size(timeout=60)  # the daemon's word: the job it gives way to (its level)
                hai.go_suspend()
        time.sleep(0.05)
        if rank == 0:
            step += 1
    if rank == 0:
        ckpt.write_text(json.dumps({"step": step}))
        (OUT / "done").write_text(str(run))
"""


def test_a_usr1_notice_reaches_rank0_only_and_the_job_is_requeued_never_killed_by_it(on_site):
    s = on_site
    c = s.c
    text = SITE_POLICY.read_text()
    usr1 = text.replace('notice_signal = "TERM"', 'notice_signal = "USR1"')
    assert usr1 != text
    reloads = s.log().count("policy reloaded")
    s.install(usr1)
    wait_for(lambda: s.log().count("policy reloaded") > reloads, 20, "the daemon to reload the policy")

    out = c.shared_dir("site-usr1", owner=ALICE)
    script = out / "job.py"
    script.write_text(textwrap.dedent(COUNTER))
    shutil.chown(script, ALICE, ALICE)
    job, job_dir = hai_submit(c, "-n", "2", str(script), str(out), "400")
    batch = c.run(["scontrol", "write", "batch_script", str(job), "-"]).stdout
    assert re.search(r"^#SBATCH --signal=(\w+:)?USR1@\d+$", batch, re.M), batch
    wait_for(lambda: (out / "alive.0.0").exists() and (out / "alive.0.1").exists(), 90, "both ranks to run")
    assert c.job(job)["QOS"] == "bronze"

    gold = c.sbatch("-N3", "--hai-priority=GOLD", "-o", "/dev/null", "--wrap", "sleep 2", user=ALICE)
    wait_for(lambda: named(job_dir, "suspended"), 60, "the BRONZE job to suspend")
    result = final(job_dir, 120)
    assert result["state"] == "succeeded", result
    assert c.job(gold).get("JobState", "COMPLETED") == "COMPLETED"

    # USR1 reached both nodes' steps; only rank 0's node raised the flag
    assert sorted(p.name for p in out.glob("seen.0.*")) == ["seen.0.0"], sorted(os.listdir(out))
    notices = list(run_notices(events(job_dir)).values())
    assert [(e["run"], e.get("cause"), e.get("by_level")) for e in notices] == [(0, "preempted", "GOLD")], notices
    assert [e["how"] for e in named(job_dir, "suspended")] == ["go_suspend"]
    assert [e["run"] for e in named(job_dir, "start")] == [0, 1]
    seen = int((out / "seen.0.0").read_text())
    assert (out / "alive.1.0").read_text() == str(seen) and json.loads((out / "ckpt.json").read_text()) == {"step": 400}
    # suspended and requeued, never failed, never ended by USR1 (exit 138, or signal 10)
    states = accounting(c, job)
    assert not [r for r in states if "." not in r[0] and r[1].startswith("FAILED")], states
    assert not [r for r in states if r[2] in ("138:0", "0:10")], states
    assert c.job(job)["Restarts"] == "1"
    for rank in (0, 1):
        assert "User defined signal 1" not in rank_log(job_dir, rank)
