"""The suspend notice on a cluster without `preempt_send_user_signal`, on the live local cluster.

There, Slurm's preemption notice is SIGTERM to every process of the job's steps (not the
job's --signal), and hai-submit renders `--term-is-notice`: the launchers take the first
SIGTERM as the notice (rank 0's node raises the flag, the others ignore it) and the user's
processes ignore it. The module switches the setting off in the cluster's slurm.conf
(`SlurmctldParameters=preempt_send_user_signal` on 22.05, `PreemptParameters=send_user_signal`
from 23.02), `scontrol reconfigure`, and puts slurm.conf back and reconfigures again at the end.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from waiting import wait_for

if TYPE_CHECKING:  # the fixtures come from tests/conftest.py
    from conftest import LiveCluster

pytestmark = pytest.mark.cluster

ALICE = "hai-alice"
NOTICE_KEYS = {"SlurmctldParameters": "preempt_send_user_signal", "PreemptParameters": "send_user_signal"}
STEPS = 200


def without_user_signal(conf: str) -> str:
    """slurm.conf less the setting that makes Slurm's preemption notice the job's --signal."""
    out = []
    for line in conf.splitlines(keepends=True):
        key, sep, value = line.rstrip("\n").partition("=")
        if sep and key.strip() in NOTICE_KEYS:
            kept = [v for v in value.split(",") if v.strip() and v.strip().lower() not in NOTICE_KEYS.values()]
            if kept:
                out.append(f"{key}={','.join(kept)}\n")
            continue
        out.append(line)
    return "".join(out)


def sends_user_signal(c: LiveCluster) -> bool:
    conf = c.run(["scontrol", "show", "config"]).stdout
    return bool(re.search(r"^(SlurmctldParameters|PreemptParameters)\s*=.*send_user_signal", conf, re.M))


def reconfigure(c: LiveCluster) -> None:
    c.run(["scontrol", "reconfigure"])
    wait_for(lambda: c.run(["scontrol", "ping"], check=False).returncode == 0, 30, "slurmctld to answer")
    wait_for(lambda: len(c.run(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"]).stdout.split()) == 4, 60,
             "all 4 nodes idle after the reconfigure")


@pytest.fixture(scope="module")
def term_notice(cluster: LiveCluster):
    """The cluster with SIGTERM as the preemption notice; the cluster as it was afterwards."""
    conf = cluster.conf
    own = conf.read_text()
    changed = without_user_signal(own)
    assert changed != own and "send_user_signal" not in changed, "slurm.conf has no send_user_signal to switch off"
    assert sends_user_signal(cluster)
    cluster.cancel_all()
    try:
        conf.write_text(changed)
        reconfigure(cluster)
        assert not sends_user_signal(cluster)
        yield cluster
    finally:
        cluster.cancel_all()
        conf.write_text(own)
        reconfigure(cluster)
        assert sends_user_signal(cluster) and conf.read_text() == own


@pytest.fixture
def term(term_notice: LiveCluster, live: LiveCluster) -> LiveCluster:
    return live


# Every process polls the notice; global rank 0 does the work: STEPS steps, one line each in
# steps.log, a checkpoint (its step, written atomically) on the notice, then go_suspend();
# the other processes poll until rank 0 is done.
COUNTER = """
    import json, os, sys, time
    from pathlib import Path
    import slurm_hai as hai
    from slurm_hai import spawn

    OUT, STEPS = Path(sys.argv[1]), int(sys.argv[2])
    CKPT = OUT / "ckpt.json"

    def commit(step):
        tmp = OUT / ".ckpt.tmp"
        with open(tmp, "w") as f:
            json.dump({"step": step}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, CKPT)

    def main(local_rank):
        rank = int(os.environ["HAI_GLOBAL_RANK"])
        run = hai.restart_count()
        step = json.loads(CKPT.read_text())["step"] if CKPT.exists() else 0
        (OUT / f"alive.{run}.{rank}").write_text(f"{os.environ['RANK']} {step}")
        while step < STEPS if rank == 0 else not (OUT / "done").exists():
            if hai.receive_suspend_command():
                if not (OUT / f"seen.{run}.{rank}").exists():
                    (OUT / f"seen.{run}.{rank}").write_text(str(step))
                if rank == 0:
                    commit(step)
                    hai.go_suspend()
            time.sleep(0.05)
            if rank == 0:
                step += 1
                with open(OUT / "steps.log", "a") as f:
                    f.write(f"{run} {step}\\n")
        if rank == 0:
            commit(step)
            (OUT / "done").write_text(str(run))

    if __name__ == "__main__":
        spawn(main, nprocs=2)
"""


def events(job_dir: Path) -> list[dict]:
    path = job_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_sigterm_notice_reaches_rank0_only_and_the_job_resumes_with_nothing_lost(term):
    c = term
    out = c.shared_dir("sigterm", owner=ALICE)
    script = out / "job.py"
    script.write_text(textwrap.dedent(COUNTER))
    c.run(["chown", f"{ALICE}:{ALICE}", str(script)])
    p = c.run(["hai-submit", "--json", "-n", "2", "-p", "LOW", "--name", "sigterm", str(script), str(out),
               str(STEPS)], user=ALICE)
    job, job_dir = json.loads(p.stdout)["job_id"], Path(json.loads(p.stdout)["job_dir"])
    # hai-submit saw the cluster's setting: the launchers take the first SIGTERM as the notice
    script_text = c.run(["scontrol", "write", "batch_script", str(job), "-"]).stdout
    assert "--term-is-notice" in script_text, script_text
    wait_for(lambda: len(list(out.glob("alive.0.*"))) == 4, 60, "4 processes on 2 nodes to run")
    wait_for(lambda: (out / "steps.log").exists() and len((out / "steps.log").read_text().split("\n")) > 20, 30,
             "the job to make progress")

    high = c.sbatch("-N4", "--qos=normal", "-o", "/dev/null", "--wrap", "sleep 3", user=ALICE)
    wait_for(lambda: [e for e in events(job_dir) if e["event"] == "suspended"], 60, "the LOW job to suspend")
    c.wait_job(high, lambda j: j["JobState"] in ("RUNNING", "COMPLETED"), 60, "the NORMAL job to take the nodes")
    info = c.wait_job(job, lambda j: j["JobState"] == "COMPLETED", 120, "the LOW job to resume and finish")

    # one notice, by SIGTERM, on node 0 only: both of its processes saw it, node 1's two never did
    assert sorted(p.name for p in out.glob("seen.0.*")) == ["seen.0.0", "seen.0.1"]
    assert {(out / f"alive.0.{r}").read_text().split()[0] for r in (2, 3)} == {"1"}  # ranks 2, 3 ran on node 1
    ev = events(job_dir)
    notices = [e for e in ev if e["event"] == "notice"]
    assert [(e["run"], e["source"]) for e in notices] == [(0, "sigterm")], notices
    assert notices[0].get("cause") == "preempted", (notices[0].get("cause_error"), notices)
    assert [e["how"] for e in ev if e["event"] == "suspended"] == ["go_suspend"]
    assert [e["run"] for e in ev if e["event"] == "start"] == [0, 1]
    assert info["Restarts"] == "1" and json.loads((job_dir / "final.json").read_text())["state"] == "succeeded"
    assert c.job(high)["JobState"] == "COMPLETED"

    # nothing lost: run 1 starts at run 0's checkpoint, and every step is done, none skipped
    committed = int((out / "seen.0.0").read_text())
    assert 0 < committed < STEPS
    assert {(out / f"alive.1.{r}").read_text().split()[1] for r in range(4)} == {str(committed)}
    done = [tuple(map(int, line.split())) for line in (out / "steps.log").read_text().split("\n") if line]
    assert [s for run, s in done if run == 0] == list(range(1, committed + 1))
    assert [s for run, s in done if run == 1] == list(range(committed + 1, STEPS + 1))
    assert json.loads((out / "ckpt.json").read_text()) == {"step": STEPS}
