"""A new user's first day (issue 54), walked as the README and the admin guide say: a Unix
user Slurm's accounting has never seen, in a fresh login shell whose only set-up is the
README's `source .../etc/env`. The walk fails on the first surprise: a command not found, a
refusal that does not say what to do, a step of the docs that does not work as written."""

from __future__ import annotations

import json
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from conftest import REPO, LiveCluster
from waiting import wait_for

NEWCOMER = "hai-newcomer"


def newcomer(live: LiveCluster) -> str:
    """The Unix user, created once; unknown to Slurm's accounting at every start of the walk."""
    try:
        pwd.getpwnam(NEWCOMER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", NEWCOMER], check=True)
    live.run(["sacctmgr", "-i", "delete", "user", NEWCOMER], check=False)
    home = f"/home/{NEWCOMER}"
    shutil.rmtree(f"{home}/examples", ignore_errors=True)
    shutil.rmtree(f"{home}/.hai", ignore_errors=True)
    shutil.copytree(REPO / "examples", f"{home}/examples")
    subprocess.run(["chown", "-R", f"{NEWCOMER}:{NEWCOMER}", f"{home}/examples"], check=True)
    return home


def login_shell(live: LiveCluster, home: str, command: str) -> subprocess.CompletedProcess:
    """`command` as the newcomer in a shell with nothing of ours in its environment but what
    the README says to source."""
    env_file = live.state / "etc" / "env"
    argv = ["runuser", "-u", NEWCOMER, "--", "env", "-i", f"HOME={home}", f"USER={NEWCOMER}", f"LOGNAME={NEWCOMER}",
            "PATH=/usr/local/bin:/usr/bin:/bin", "bash", "-c", f"source {env_file} && {command}"]
    return subprocess.run(argv, text=True, capture_output=True, cwd=home, timeout=120)


def test_a_new_user_in_a_fresh_shell_is_told_what_to_ask_for_and_then_runs_the_readmes_first_job(live):
    home = newcomer(live)
    # README: "On the cluster: `hai-submit -p LOW examples/resumable.py`"
    first = login_shell(live, home, "hai-submit -p LOW examples/resumable.py")
    assert first.returncode == 2 and first.stderr.count("\n") == 1, (first.stdout, first.stderr)
    assert f"Slurm's accounting has no account for {NEWCOMER}" in first.stderr
    assert f"`sacctmgr add user {NEWCOMER} account=ACCOUNT`" in first.stderr and "Adding a user" in first.stderr
    # docs/admin-guide.md, "Adding a user", as the administrator does it
    live.run(["sacctmgr", "-i", "add", "user", NEWCOMER, "account=hai"])
    plan = live.run(["hai-admin", "plan", "--policy", str(live.state / "etc" / "policy.toml")], check=False)
    assert plan.returncode == 0 and "no change" in plan.stdout, (plan.stdout, plan.stderr)
    again = login_shell(live, home, "hai-submit --json -p LOW examples/resumable.py")
    assert again.returncode == 0, (again.stdout, again.stderr)
    job = json.loads(again.stdout)["job_id"]

    def status() -> dict:
        p = login_shell(live, home, f"hai status --json {job}")
        assert p.returncode == 0, (p.stdout, p.stderr)
        return json.loads(p.stdout)

    wait_for(lambda: status()["state"].startswith("finished"), 180, "the first job's end")
    assert status()["state"] == "finished-succeeded", status()
    logs = login_shell(live, home, f"hai logs {job}").stdout
    assert "run 0 starts at step 0" in logs and "done at step 300" in logs, logs


def test_a_job_submitted_from_an_interpreter_the_nodes_cannot_see_says_so_in_status_and_logs(live):
    """hai-submit from a venv on the login host's own disk (here the host's /tmp: each local
    node has a /tmp of its own): Slurm takes the job, its batch script cannot exec the batch
    driver on the node (exit 127); `hai status` and `hai logs` quote the script's last line."""
    login = Path(tempfile.mkdtemp(prefix="hai-login-venv-", dir="/tmp"))
    try:
        venv = login / "venv"
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True)
        site = next((REPO / ".venv" / "lib").glob("python3.*/site-packages"))
        (next((venv / "lib").glob("python3.*")) / "site-packages" / "hai.pth").write_text(f"{REPO}\n{site}\n")
        subprocess.run(["chmod", "-R", "a+rX", str(login)], check=True)
        d = live.shared_dir("newcomer-venv", owner="hai-alice")
        (d / "job.py").write_text("print('never runs')\n")
        submit = "import sys; from slurm_hai.cli.front import hai_submit; sys.argv[0] = 'hai-submit'; hai_submit()"
        p = live.run([str(venv / "bin" / "python3"), "-c", submit, "--json", "-p", "LOW", str(d / "job.py")],
                     user="hai-alice", cwd=d)
        job = json.loads(p.stdout)["job_id"]

        def status() -> dict:
            return json.loads(live.run(["hai", "status", "--json", str(job)], user="hai-alice").stdout)

        wait_for(lambda: status()["state"].startswith("finished"), 120, "the job's end")
        st = status()
        missing = f"{venv}/bin/python3: No such file or directory"
        assert st["state"] == "finished-failed" and "exit code 127" in st["reason"], st
        assert "before it started, its batch script said: " in st["reason"] and missing in st["reason"], st
        logs = live.run(["hai", "logs", str(job)], user="hai-alice", check=False)
        assert logs.returncode == 1 and logs.stderr.count("\n") == 1 and missing in logs.stderr, logs.stderr
    finally:
        shutil.rmtree(login, ignore_errors=True)
