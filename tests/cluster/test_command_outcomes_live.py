"""`hai stop` and `hai suspend` say only what happened, on the live cluster (issue 34, item 3).

Slurm's own answer cannot tell: `scancel` of a job that has ended (or that slurmctld has
forgotten) exits 0 without a word. A job here ends when the test opens its gate, so the
command's read can be taken while it runs and the action made once it has ended: the race
of a job ending between the two, made certain. docs/commands-audit.md has the whole table.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from test_frontdoor import one_error_line, status, user_dir, wait_state, write
from waiting import wait_for

GATED = """
    import os, sys, time
    while not os.path.exists(sys.argv[1]):  # ends once the test opens the gate
        time.sleep(0.05)
"""

# As the job's owner: stop and suspend read the job while it runs; it ends on its own just
# before Slurm's cancel reaches it (the backend opens the gate and waits for the end), and
# Slurm's real scancel answers.
RACE = """
    import json, sys, time
    from slurm_hai.cli.common import lookup
    from slurm_hai.jobs import control
    from slurm_hai.slurm import backend

    job_id, gate = int(sys.argv[1]), sys.argv[2]
    slurm = backend()
    seen, jobdir = lookup(job_id)

    class EndsFirst:
        def __getattr__(self, name):
            return getattr(slurm, name)

        def cancel(self, job_id, signal=None):
            open(gate, "w").close()
            while jobdir.final() is None or ((now := slurm.job(job_id)) is not None and now.state not in (
                    "COMPLETED", "FAILED", "CANCELLED")):
                time.sleep(0.1)
            slurm.cancel(job_id, signal)

    control.check_running(job_id, seen, jobdir, True)  # passes: the job runs
    said = {}
    for name, act in (("stop", lambda: control.stop(EndsFirst(), job_id, seen, jobdir, True)),
                      ("suspend", lambda: control.request_suspend(slurm, job_id, seen.restart_count, jobdir, True, "USR2"))):
        try:
            act()
            said[name] = "done"
        except control.NoEffect as e:
            said[name] = str(e)
    print(json.dumps(said))
"""


def test_stop_and_suspend_of_a_job_that_ended_first_do_nothing_and_exit_1_a_running_one_stops(live):
    d = user_dir(live, "outcomes", "hai-alice")
    script = write(d / "gated.py", GATED, "hai-alice")

    def submit(gate: str) -> int:
        p = live.run(["hai-submit", "--json", "-p", "LOW", str(script), str(d / gate)], user="hai-alice")
        return json.loads(p.stdout)["job_id"]

    ends, runs = submit("go"), submit("never")
    for job in (ends, runs):
        wait_state(live, job, lambda s: s["state"] == "running", 60, f"job {job} running", user="hai-alice")

    # the race: read while it runs, ended on its own before Slurm's cancel reaches it
    raced = live.run([sys.executable, "-c", textwrap.dedent(RACE), str(ends), str(d / "go")],
                     user="hai-alice", timeout=90)
    said = json.loads(raced.stdout)
    assert said["stop"] == f"job {ends} ended on its own (finished-succeeded) before the stop reached it: " \
                           "nothing stopped", said
    assert said["suspend"] == f"job {ends} is finished-succeeded now, not running: no suspend notice sent", said

    # the job ended before the command: nothing is sent, exit 1, its end stays as it was
    stop = live.run(["hai", "stop", str(ends)], user="hai-alice", check=False)
    assert f"job {ends} has already ended (finished-succeeded): nothing to stop" in one_error_line(stop)
    suspend = live.run(["hai", "suspend", str(ends)], user="hai-alice", check=False)
    assert f"job {ends} is finished-succeeded, not running" in one_error_line(suspend)
    st = status(live, ends, user="hai-alice")
    assert st["state"] == "finished-succeeded" and st["reason"] == "exited 0", st
    events = [json.loads(line)["event"] for line in Path(st["job_dir"], "events.jsonl").read_text().splitlines()]
    assert "stop" not in events and events.count("suspend_request_failed") == 1, events

    # a running job: Slurm's cancel is told from an own end, and it is stopped
    stop = live.run(["hai", "stop", str(runs)], user="hai-alice")
    assert stop.stdout == f"job {runs} stopped\n" and stop.stderr == ""
    st = wait_state(live, runs, lambda s: s["state"] == "finished-stopped", 30, "stopped", user="hai-alice")
    assert st["reason"] == "stopped by its user"


DEAF = """
    import time
    time.sleep(600)  # never asks for a notice: the grace runs out, or the test stops it
"""

FAILS = """
    import sys
    print("about to fail", flush=True)
    sys.exit(3)
"""


def test_a_second_suspend_sends_nothing_and_a_followed_failure_exits_1(live):
    """Issue 54, finding 10, live: a second `hai suspend` within the grace says no second
    notice went (exit 1), and both `hai-submit -f` and `hai logs -f` of a job that failed
    exit 1."""
    d = user_dir(live, "outcomes-10", "hai-alice")
    deaf = write(d / "deaf.py", DEAF, "hai-alice")
    p = live.run(["hai-submit", "--json", "-p", "LOW", "--grace", "60", str(deaf)], user="hai-alice")
    job = json.loads(p.stdout)["job_id"]
    wait_state(live, job, lambda s: s["state"] == "running", 60, f"job {job} running", user="hai-alice")
    first = live.run(["hai", "suspend", str(job)], user="hai-alice")
    assert first.returncode == 0 and "suspend notice sent" in first.stdout, first.stdout
    job_dir = Path(status(live, job, user="hai-alice")["job_dir"])
    wait_for(lambda: '"event": "notice"' in (job_dir / "events.jsonl").read_text(), 30, "the notice", 0.2)
    second = live.run(["hai", "suspend", str(job)], user="hai-alice", check=False)
    said = one_error_line(second)
    assert f"job {job} has had its suspend notice since" in said and "no second notice sent" in said, said
    events = [json.loads(line)["event"] for line in (job_dir / "events.jsonl").read_text().splitlines()]
    assert events.count("suspend_requested") == 1 and events.count("notice") == 1, events
    live.run(["hai", "stop", str(job)], user="hai-alice")

    fails = write(d / "fails.py", FAILS, "hai-alice")
    followed = live.run(["hai-submit", "-f", "-p", "LOW", str(fails)], user="hai-alice", check=False, timeout=180)
    assert followed.returncode == 1 and "about to fail" in followed.stdout, (followed.returncode, followed.stdout)
    failed = int(followed.stdout.split("Submitted job ")[1].split()[0])
    logs = live.run(["hai", "logs", "-f", str(failed)], user="hai-alice", check=False, timeout=60)
    assert logs.returncode == 1 and "about to fail" in logs.stdout and "finished-failed" in logs.stderr, (logs.stdout, logs.stderr)
