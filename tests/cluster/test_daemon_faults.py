"""The policy daemon under faults (issue 18): one leader across hosts, a standby that takes
over when the leader is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from test_policy_rules import daemon_lines, running, sbatch
from waiting import wait_for

REPO = Path(__file__).resolve().parents[2]


def start_daemon(live, log: Path, *extra: str, namespace: bool = False,
                 prefix: Sequence[str] = ()) -> subprocess.Popen:
    """`hai-admin daemon` (`extra` its options); `prefix` runs it elsewhere (a network namespace)."""
    argv = [*prefix, sys.executable, "-m", "slurm_hai.cli.admin", "daemon", "--policy",
            str(live.state / "etc" / "policy.toml"), "--interval", "0.5", *extra]
    if namespace:  # "another host": its own /run and /tmp (a private tmpfs each), the same Slurm
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                'mount -t tmpfs tmpfs /run && mount -t tmpfs tmpfs /tmp && exec "$@"', "sh", *argv]
    with log.open("w") as out:
        return subprocess.Popen(argv, env=live.env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_one_daemon_leads_across_hosts_and_the_standby_takes_over_when_it_is_killed(live, tmp_path):
    lock = Path(live.run(["scontrol", "show", "config"]).stdout.split("StateSaveLocation")[1].split("=")[1]
                .split()[0]) / "hai-policyd.lock"
    a_log, b_log = tmp_path / "a.log", tmp_path / "b.log"
    a = start_daemon(live, a_log)
    b = None
    try:
        wait_for(lambda: "policy daemon started" in a_log.read_text() or a.poll() is not None, 30, "the first daemon")
        assert a.poll() is None, a_log.read_text()
        assert (Path(f"{lock}.pid").read_text().strip()) == str(a.pid)  # the lock is beside Slurm's state
        # a second daemon, "on another host": its /run differs, the lock is the same
        b = start_daemon(live, b_log, "--wait-for-lock", namespace=True)
        wait_for(lambda: "standing by" in b_log.read_text() or b.poll() is not None, 30, "the standby's line")
        assert b.poll() is None, b_log.read_text()
        assert [ln for ln in b_log.read_text().splitlines() if ln.strip()] == [
            ln for ln in b_log.read_text().splitlines() if "standing by" in ln], b_log.read_text()
        # without --wait-for-lock a third one says so in one line and exits 4
        third = subprocess.run([sys.executable, "-m", "slurm_hai.cli.admin", "daemon", "--policy",
                                str(live.state / "etc" / "policy.toml")], env=live.env, cwd=REPO,
                               capture_output=True, text=True, timeout=60)
        assert third.returncode == 4 and third.stderr.strip().count("\n") == 0, third.stderr
        assert "another hai-admin daemon holds" in third.stderr

        # something to act on: a pending job whose priority is out of its level's band
        blocker = sbatch(live, "-N4", "--qos=low", user="root", wrap="sleep 120")
        running(live, blocker)
        waiting = sbatch(live, "-N1", "--qos=low", user="root")
        live.run(["scontrol", "update", f"jobid={waiting}", "priority=5"])
        wait_for(lambda: daemon_lines(a_log.read_text(), waiting, "fcfs"), 20, "the leader's fcfs fix")
        time.sleep(1.5)  # three standby cycles' worth
        assert not daemon_lines(b_log.read_text(), waiting, "fcfs"), b_log.read_text()

        os.kill(a.pid, signal.SIGKILL)
        a.wait(10)
        wait_for(lambda: "took over the lock" in b_log.read_text(), 15, "the standby to take over")
        live.run(["scontrol", "update", f"jobid={waiting}", "priority=5"])
        wait_for(lambda: daemon_lines(b_log.read_text(), waiting, "fcfs"), 20, "the new leader's fcfs fix")
        assert int(live.job(waiting)["Priority"]) > 5
        assert Path(f"{lock}.pid").read_text().strip() != str(a.pid)
    finally:
        stop(a)
        if b is not None:
            stop(b)
    assert "Traceback" not in a_log.read_text() + b_log.read_text()


def test_with_slurmdbd_stopped_the_front_door_and_the_daemon_work_or_say_so_in_one_line(live, tmp_path):
    from test_frontdoor import one_error_line

    user = "hai-carol"
    job_dir = live.shared_dir("dbd-down", owner=user)
    script = job_dir / "work.sh"
    script.write_text('#!/bin/sh\necho "done $SLURM_JOB_ID"\n')
    script.chmod(0o755)
    ended = json.loads(live.run(["hai-submit", "--json", "-p", "LOW", "--workdir", str(job_dir), str(script)],
                                user=user).stdout)["job_id"]
    wait_for(lambda: live.job(ended).get("JobState") == "COMPLETED", 60, "a job that ends before slurmdbd stops")
    d_log = tmp_path / "daemon.log"
    daemon = start_daemon(live, d_log, "--lock", str(tmp_path / "policyd.lock"), "--log-level", "debug")
    pid_file = live.state / "run" / "slurmdbd.pid"
    try:
        wait_for(lambda: "policy daemon started" in d_log.read_text() or daemon.poll() is not None, 30, "the daemon")
        os.kill(int(pid_file.read_text()), signal.SIGTERM)
        wait_for(lambda: live.run(["sacct", "-X", "-n", "-j", str(ended)], check=False).returncode != 0, 30,
                 "sacct to fail without slurmdbd")
        cycles = d_log.read_text().count("cycle: ")
        # submitting, running, status and list need slurmctld only
        p = live.run(["hai-submit", "--json", "-p", "NORMAL", "--workdir", str(job_dir), str(script)], user=user)
        during = json.loads(p.stdout)["job_id"]
        wait_for(lambda: live.job(during).get("JobState") == "COMPLETED", 60, "the job submitted without slurmdbd")
        assert f"done {during}" in live.run(["hai", "logs", str(during)], user=user).stdout
        assert json.loads(live.run(["hai", "status", "--json", str(ended)], user=user).stdout)["state"] \
            == "finished-succeeded"
        listed = {j["job_id"] for j in json.loads(live.run(["hai", "list", "--json", "--since", "30m"],
                                                            user=user).stdout)}
        assert {ended, during} <= listed, listed
        # what needs accounting fails in one line that names it: a job slurmctld does not know, the timeline
        for argv in (["hai", "status", "999999"], ["hai", "timeline", "--since", "10m"]):
            line = one_error_line(live.run(argv, user=user, check=False))
            assert "slurmdbd" in line or "database" in line, line
        wait_for(lambda: d_log.read_text().count("cycle: ") >= cycles + 4, 20, "the daemon to go on cycling")
        assert daemon.poll() is None, d_log.read_text()
    finally:
        up = subprocess.run([str(REPO / "contrib" / "localcluster" / "up")], capture_output=True, text=True)
        stop(daemon)
    assert up.returncode == 0, up.stdout + up.stderr
    assert "Traceback" not in d_log.read_text(), d_log.read_text()
    # nothing lost: slurmctld hands slurmdbd what it recorded meanwhile
    wait_for(lambda: "COMPLETED" in live.run(["sacct", "-X", "-n", "-o", "state", "-j", str(during)],
                                             check=False).stdout, 60, "the job run without slurmdbd in accounting")


def test_daemon_killed_in_the_middle_of_a_yield_the_next_one_finishes_it_one_requeue_never_held(live, tmp_path):
    """SIGKILL the daemon right after it tagged a job to yield its node (before the notice's
    grace ran out and the requeue): the next daemon replays the notice, requeues the job
    once, and releases it (docs/design.md, "The policy daemon under faults")."""
    from test_policy_rules import BOB, earlier_and_later

    lock = tmp_path / "policyd.lock"
    a_log, b_log = tmp_path / "a.log", tmp_path / "b.log"
    a = start_daemon(live, a_log, "--lock", str(lock))
    b = None
    try:
        wait_for(lambda: "policy daemon started" in a_log.read_text() or a.poll() is not None, 30, "the daemon")
        first, later, high = earlier_and_later(live, BOB)
        # once VERY_HIGH ends, alice's earlier job is owed bob's node: the daemon tags his to yield
        live.run(["scancel", str(high)])
        wait_for(lambda: "hai-yield=" in live.job(later).get("AdminComment", ""), 20, "the yield tag")
        os.kill(a.pid, signal.SIGKILL)
        a.wait(10)
        assert live.job(later)["Restarts"] == "0"  # killed before the requeue

        b = start_daemon(live, b_log, "--lock", str(lock))
        running(live, first, 40, "the earlier job to get its node back")
        info = live.wait_job(later, lambda j: j["Restarts"] == "1" and j["Reason"] != "JobHeldAdmin"
                             and "hai-yield" not in j["AdminComment"], 30, "the later job requeued and released")
        time.sleep(3)  # six more cycles: no second requeue, no hold
        info = live.job(later)
        assert info["Restarts"] == "1" and info["Reason"] != "JobHeldAdmin", info
        assert daemon_lines(b_log.read_text(), later, "yield"), b_log.read_text()
    finally:
        stop(a)
        if b is not None:
            stop(b)
    assert "Traceback" not in a_log.read_text() + b_log.read_text()


def test_what_a_user_plants_in_a_job_directory_never_stops_or_fools_the_daemon(live, tmp_path):
    """issue 57: hai-bob's FAILED jobs' suspend markers are a FIFO, a link to a root file, and a
    1 TiB file; their events files a FIFO, a line nested past the parser, a 1 TiB file. The
    daemon (with its metrics) goes on cycling and answering scrapes. None of the markers counts:
    the daemon reads no user's directory to judge a lost requeue (issue 55), only the job's own
    record does (a fourth job's comment says its run 0 was suspended: its lost requeue is made)."""
    import urllib.request

    from test_metrics_prometheus import free_port

    user = "hai-bob"
    root = live.shared_dir("planted", owner=user)
    kinds = ("fifo", "symlink", "huge")
    jobs = {kind: sbatch(live, "-H", "-N1", "--qos=low", f"--comment=hai-dir={root}", user=user, wrap="exit 1")
            for kind in (*kinds, "said")}
    live.run(["scontrol", "update", f"JobId={jobs['said']}", f"Comment=hai-dir={root} hai-suspend=0:go_suspend:none:0:1796600000"],
             user=user)
    plant = {"fifo": "mkfifo {d}/suspend.0 {d}/events.jsonl",
             "symlink": "ln -s /etc/hostname {d}/suspend.0 && printf '%s\\n' \"$(head -c 200000 /dev/zero | "
                        "tr '\\0' '[')\" > {d}/events.jsonl",
             "huge": "truncate -s 1T {d}/suspend.0 {d}/events.jsonl"}
    for kind in kinds:
        d = root / str(jobs[kind])
        live.run(["sh", "-c", f"mkdir {d} && " + plant[kind].format(d=d)], user=user)
    d_log = tmp_path / "daemon.log"
    port = free_port()
    daemon = start_daemon(live, d_log, "--lock", str(tmp_path / "policyd.lock"), "--log-level", "debug",
                          "--metrics-port", str(port), "--metrics-address", "127.0.0.1")
    try:
        wait_for(lambda: "policy daemon started" in d_log.read_text() or daemon.poll() is not None, 30, "the daemon")
        live.run(["scontrol", "release", ",".join(map(str, jobs.values()))])
        for job in jobs.values():
            live.wait_job(job, lambda j: j["JobState"] == "FAILED" or j["Restarts"] != "0", 60, "the job to fail")
        wait_for(lambda: daemon_lines(d_log.read_text(), jobs["said"], "requeue-failed"), 30,
                 "the lost requeue of the job whose own record says it was suspended")
        cycles = d_log.read_text().count("cycle: ")
        wait_for(lambda: d_log.read_text().count("cycle: ") >= cycles + 6, 30, "the daemon to go on cycling")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "hai_daemon_cycle_seconds_count" in text
        assert daemon.poll() is None, d_log.read_text()
        for kind in kinds:
            assert not daemon_lines(d_log.read_text(), jobs[kind], "requeue-failed"), kind
            assert live.job(jobs[kind])["Restarts"] == "0", kind
        # bob's own commands and root's timeline read the same files: no hang, no traceback
        listed = json.loads(live.run(["hai", "list", "--all", "--json"], user=user, timeout=30).stdout)
        assert {r["job_id"] for r in listed} >= set(jobs.values())
        live.run(["hai-admin", "timeline", "--since", "1h", "--out", str(tmp_path / "timeline.html")], timeout=60)
    finally:
        stop(daemon)
        live.run(["scancel", *map(str, jobs.values())], check=False)
        live.run(["rm", "-rf", str(root)], check=False)  # what later tests' `hai list --all` would read
    assert "Traceback" not in d_log.read_text(), d_log.read_text()[-3000:]


def test_a_lock_where_users_can_write_is_refused_in_one_line(live, tmp_path):
    shared = tmp_path / "sticky"
    shared.mkdir()
    shared.chmod(0o1777)
    p = subprocess.run([sys.executable, "-m", "slurm_hai.cli.admin", "daemon", "--policy",
                        str(live.state / "etc" / "policy.toml"), "--once", "--lock", str(shared / "policyd.lock")],
                       env=live.env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 4 and p.stderr.count("\n") == 1, p.stderr
    assert "writable by others than its owner" in p.stderr and "pass --lock FILE" in p.stderr
    assert not (shared / "policyd.lock").exists()
