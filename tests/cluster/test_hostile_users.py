"""Hostile users, as real Unix users (issue 18): Bob cannot suspend, stop, requeue, hold,
re-level, read or forge anything of Alice's job, nor keep it from starting by making paths
before her. Each attempt is refused, and her job runs through untouched."""

from __future__ import annotations

import json
import pwd
import time
from pathlib import Path

from test_frontdoor import one_error_line, status, user_dir, wait_state, write


def as_bob(live, *argv: str):
    return live.run(list(argv), user="hai-bob", check=False)


def test_bob_can_neither_touch_alice_s_job_nor_keep_it_from_starting(live):
    alice = pwd.getpwnam("hai-alice").pw_uid
    bob = pwd.getpwnam("hai-bob").pw_uid
    # Before Alice runs anything, Bob makes on every node every path he can guess that a job
    # might use (each node has its own /dev/shm and /tmp).
    squats = [Path("/dev/shm") / f"slurm-hai-{alice}", Path("/tmp") / f"slurm-hai-{alice}"]
    ckpt_squat = Path("/tmp") / f"hai-alice-ckpt-{live.state.name}"
    nodes = live.run(["sinfo", "-h", "-N", "-o", "%N"]).stdout.split()
    for node in nodes:
        for p in [*squats, ckpt_squat]:
            live.on_node(node, ["rm", "-rf", str(p)])  # left by an older slurm-hai or an earlier run
            live.on_node(node, ["mkdir", "-m", "777", str(p)], user="hai-bob")
            assert live.on_node(node, ["stat", "-c", "%u", str(p)]).stdout.strip() == str(bob)
    d = user_dir(live, "hostile", "hai-alice")
    done = d / "done"
    script = write(d / "train.py", f"""
        import os, sys, time
        import slurm_hai.runtime.client as hai
        from slurm_hai.checkpoint import CheckpointManager
        from slurm_hai.checkpoint.errors import CheckpointError
        try:
            CheckpointManager({str(ckpt_squat)!r})
            print("USED BOB'S DIRECTORY", flush=True)
        except CheckpointError as e:
            print("refused:", e, flush=True)
        mgr = CheckpointManager({str(d / "ckpt")!r})
        mgr.save(1, {{"w": [1.0, 2.0]}})
        print("flag", os.environ["HAI_SUSPEND_FLAG"], flush=True)
        while not os.path.exists({str(done)!r}):
            if hai.receive_suspend_command():
                print("NOTICE", flush=True)
                hai.go_suspend()
            time.sleep(0.1)
        print("done", flush=True)
    """, "hai-alice")
    job = json.loads(live.run(["hai-submit", "--json", "-p", "LOW", str(script)], user="hai-alice").stdout)["job_id"]
    wait_state(live, job, lambda s: s["state"] == "running", 60, "running", user="hai-alice")
    jobdir = Path("/home/hai-alice/.hai/jobs") / str(job)
    log = jobdir / "logs" / "rank-0.log"
    flag = None
    for _ in range(100):
        text = log.read_text() if log.exists() else ""
        if "flag " in text:
            flag = Path(text.split("flag ", 1)[1].split()[0])
            break
        time.sleep(0.2)
    assert flag is not None, text
    node = live.job(job)["NodeList"]
    assert live.on_node(node, ["stat", "-c", "%u", str(flag.parent)]).stdout.strip() == str(alice)

    # through hai: one line each, refused
    for argv in (["hai", "suspend", str(job)], ["hai", "stop", str(job)], ["hai", "logs", str(job)]):
        p = as_bob(live, *argv)
        assert p.returncode != 0, argv
        one_error_line(p)
    # through Slurm itself
    for argv in (["scontrol", "requeue", str(job)], ["scontrol", "hold", str(job)],
                 ["scontrol", "update", f"jobid={job}", "qos=high"], ["scancel", str(job)],
                 ["scancel", "--signal=USR2", str(job)], ["scancel", "--signal=TERM", "--full", str(job)]):
        p = as_bob(live, *argv)
        assert p.returncode != 0 or "denied" in (p.stderr + p.stdout).lower(), (argv, p.stdout, p.stderr)
    # through the files: her job directory, her checkpoints, her suspend flag (on her node)
    for argv in (["cat", str(jobdir / "events.jsonl")], ["cat", str(log)], ["ls", str(d / "ckpt")],
                 ["touch", str(jobdir / "suspend.0")], ["sh", "-c", f"echo 1 > {jobdir / 'final.json'}"]):
        p = as_bob(live, *argv)
        assert p.returncode != 0, (argv, p.stdout)
    for argv in (["sh", "-c", f"echo 1 > {flag}"], ["ls", str(flag.parent)]):
        p = live.on_node(node, argv, user="hai-bob", check=False)
        assert p.returncode != 0, (argv, p.stdout)

    done.touch()
    st = wait_state(live, job, lambda s: s["state"].startswith("finished"), 60, "the end", user="hai-alice")
    assert st["state"] == "finished-succeeded" and st["suspends"] == 0 and st["restarts"] == 0, st
    out = live.run(["hai", "logs", str(job)], user="hai-alice").stdout
    assert "NOTICE" not in out and "USED BOB'S DIRECTORY" not in out and "done" in out
    assert f"refused: checkpoint directory {ckpt_squat} belongs to uid {bob}" in out
    assert live.on_node(node, ["test", "-e", str(flag.parent)], check=False).returncode == 1  # removed by the run
    for node in nodes:
        left = live.on_node(node, ["find", *map(str, [*squats, ckpt_squat]), "-mindepth", "1"]).stdout
        assert not left, (node, left)  # nothing of hers in Bob's paths
        live.on_node(node, ["rm", "-rf", *map(str, [*squats, ckpt_squat])])
    assert status(live, job, user="hai-bob")["state"] == "finished-succeeded"  # Bob sees Slurm's view only


def test_a_run_that_cannot_start_says_why_in_status_and_logs(live):
    d = user_dir(live, "cannot-start", "hai-alice")
    script = write(d / "run.sh", "#!/bin/bash\necho hi\n", "hai-alice", mode=0o700)
    job = json.loads(live.run(["hai-submit", "--json", "-p", "LOW", str(script)], user="hai-alice").stdout)["job_id"]
    script.unlink()  # gone before the job starts: the launcher cannot start it
    st = wait_state(live, job, lambda s: s["state"].startswith("finished"), 60, "the end", user="hai-alice")
    assert st["state"] == "finished-failed" and st["reason"].startswith("could not start: cannot start "), st
    logs = live.run(["hai", "logs", str(job)], user="hai-alice").stdout
    assert "could not start" in logs and "No such file" in logs
