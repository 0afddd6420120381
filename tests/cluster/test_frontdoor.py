"""The front door on the live cluster: what a new user meets in the first hour (issue 20).

Arguments reach the script, submit refuses what could only fail later, listings work for
every user, a preempted user is told why and when, defaults fit the nodes, and every
command shown in the README and the user guide still works.
"""

from __future__ import annotations

import json
import os
import pwd
import textwrap
import time
from pathlib import Path

import pytest
from waiting import wait_for


def as_owner(path: Path, user: str) -> Path:
    pw = pwd.getpwnam(user)
    os.chown(path, pw.pw_uid, pw.pw_gid)
    return path


def user_dir(live, name: str, user: str) -> Path:
    return live.shared_dir(name, owner=user)


def write(path: Path, body: str, user: str | None = None, mode: int = 0o600) -> Path:
    path.write_text(textwrap.dedent(body))
    path.chmod(mode)
    return as_owner(path, user) if user else path


def status(live, job: int, user: str | None = None) -> dict:
    return json.loads(live.run(["hai", "status", "--json", str(job)], user=user).stdout)


def wait_state(live, job: int, pred, timeout: float, what: str, user: str | None = None) -> dict:
    return wait_for(lambda: (lambda s: s if pred(s) else None)(status(live, job, user)), timeout, what, 0.5)


def one_error_line(p) -> str:
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode != 0 and len(lines) == 1 and lines[0].startswith("Error: "), (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and "Errno" not in p.stderr
    return lines[0]


# ---------------------------------------------------------------- major 1: script arguments

def test_arguments_after_the_script_reach_it_unchanged(live):
    d = user_dir(live, "fd-args", "hai-alice")
    script = write(d / "train.py", """
        import sys
        print("ARGV", sys.argv[1:], flush=True)
    """, "hai-alice")
    p = live.run(["hai-submit", "--json", "-n", "2", "-p", "HIGH", "--time", "4:00:00", str(script),
                  "--lr", "0.1", "-n", "7", "--json", "two words"], user="hai-alice")
    job = json.loads(p.stdout)["job_id"]
    st = wait_state(live, job, lambda s: s["state"].startswith("finished"), 90, "the end", user="hai-alice")
    assert st["state"] == "finished-succeeded" and st["nodes"] == 2 and st["level"] == "HIGH"
    logs = live.run(["hai", "logs", str(job)], user="hai-alice").stdout
    assert "ARGV ['--lr', '0.1', '-n', '7', '--json', 'two words']" in logs


# ---------------------------------------------------------------- major 3: refused at submit

def test_submit_refuses_what_could_only_fail_later_as_the_jobs_user(live):
    d = user_dir(live, "fd-refuse", "hai-bob")
    good = write(d / "ok.py", "print(1)\n", "hai-bob")
    secret = write(d / "secret.py", "print(1)\n", "root", mode=0o600)  # bob cannot read it
    noexec = write(d / "run.sh", "#!/bin/bash\necho hi\n", "hai-bob", mode=0o600)
    readme = write(d / "README", "Read me first.\n", "hai-bob", mode=0o700)
    locked = d / "locked"
    locked.mkdir(mode=0o700)  # root's: bob cannot enter it
    cases = [
        ([str(d / "missing.py")], "no such file"),
        ([str(d)], "is a directory"),
        ([str(readme)], "nor a program"),
        ([str(noexec)], "not executable"),
        ([str(secret)], "cannot read it"),
        (["--workdir", "/nonexistent", str(good)], "no such directory"),
        (["--workdir", str(locked), str(good)], "cannot enter it"),
    ]
    for args, needle in cases:
        for dry in ([], ["--dry-run"]):
            p = live.run(["hai-submit", *dry, "-p", "LOW", *args], user="hai-bob", check=False)
            line = one_error_line(p)
            assert needle in line, (args, line)
            assert p.returncode == 2
    # nothing reached Slurm
    assert live.run(["squeue", "-h", "-u", "hai-bob"]).stdout.strip() == ""
    # and the good script is accepted from the same place
    assert live.run(["hai-submit", "--dry-run", "-p", "LOW", str(good)], user="hai-bob").stdout.startswith("#!/bin/bash")
