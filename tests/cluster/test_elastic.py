"""Elastic jobs on the live cluster, asking for a range of nodes (issue 11, item 1).

An elastic job (`hai-submit -n MIN:MAX[:STEP]`, or `sbatch --nodes=MIN-MAX`) starts once MIN
nodes are free, on as many as it may up to MAX; job_submit.lua keeps its range in the admin
comment; a count its STEP does not allow is cut to the largest allowed one and the other nodes
are given back; quotas cap what it gets.
"""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

from waiting import FIRST_START, wait_for

ALICE = "hai-alice"
PROBE = """
    import os, sys, time
    from pathlib import Path

    out = Path(sys.argv[1])
    rank = os.environ["RANK"]
    (out / f".rank.{rank}").write_text(os.environ["WORLD_SIZE"])
    (out / f".rank.{rank}").rename(out / f"rank.{rank}")  # the test never reads a half-written file
    end = time.monotonic() + 90
    while not (out / "go").exists() and time.monotonic() < end:  # the test looks at the running job
        time.sleep(0.2)
"""


def _all_idle(live) -> None:
    """The nodes of an earlier job may still be completing: an elastic job would start on fewer."""
    wait_for(lambda: len(live.run(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"]).stdout.split()) == 4, 60,
             "all 4 nodes idle")


def _probe(live, name: str) -> tuple[Path, Path]:
    out = live.shared_dir(name, owner=ALICE)
    script = out / "probe.py"
    script.write_text(textwrap.dedent(PROBE))
    live.run(["chown", f"{ALICE}:{ALICE}", str(script)])
    return out, script


def _submit(live, script: Path, out: Path, *opts: str) -> tuple[int, Path]:
    p = live.run(["hai-submit", "--json", *opts, str(script), str(out)], user=ALICE)
    got = json.loads(p.stdout)
    return got["job_id"], Path(got["job_dir"])


def _ranks(out: Path) -> dict[int, int]:
    """rank -> the WORLD_SIZE it saw"""
    return {int(p.name.split(".")[1]): int(p.read_text()) for p in out.glob("rank.*")}


def _events(job_dir: Path, name: str) -> list[dict]:
    path = job_dir / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, filter(None, lines)) if e["event"] == name]


def test_an_elastic_job_starts_on_every_free_node_up_to_max_and_shows_its_range(live):
    out, script = _probe(live, "elastic-max")
    _all_idle(live)
    job, job_dir = _submit(live, script, out, "-n", "2:4", "-p", "LOW")
    wait_for(lambda: len(_ranks(out)) == 4, 60, "4 ranks to run")
    assert _ranks(out) == {0: 4, 1: 4, 2: 4, 3: 4}
    assert "hai-nodes=2:4:1" in live.job(job)["AdminComment"]
    listed = live.run(["hai", "list"], user=ALICE).stdout
    row = next(line for line in listed.splitlines() if line.startswith(str(job)))
    assert " 4/2:4 " in row, listed
    st = json.loads(live.run(["hai", "status", "--json", str(job)], user=ALICE).stdout)
    assert (st["nodes"], st["node_range"], st["sizes"]) == (4, "2:4", [4])
    (out / "go").touch()
    live.wait_job(job, lambda j: j["JobState"] == "COMPLETED", 60, "the elastic job to finish")
    assert [e["size"] for e in _events(job_dir, "start")] == [4]


def test_sbatch_nodes_range_with_the_spank_plugin_is_elastic_and_quotas_cap_it(live):
    # plain sbatch with a Slurm range: job_submit.lua keeps it
    _all_idle(live)
    job = live.sbatch("--nodes=2-4", "--hai-priority=LOW", "-o", "/dev/null", "--wrap", "sleep 30", user=ALICE)
    live.wait_job(job, lambda j: j["JobState"] == "RUNNING", FIRST_START, "the sbatch range job to run")
    assert "hai-nodes=2:4:1" in live.job(job)["AdminComment"] and live.job(job)["NumNodes"] == "4"
    rows = json.loads(live.run(["hai", "list", "--json"], user=ALICE).stdout)
    assert [(r["nodes"], r["node_range"]) for r in rows if r["job_id"] == job] == [(4, "2:4")]
    live.cancel_all()
    _all_idle(live)
    # hai-alice may hold 2 nodes at HIGH: an elastic 1:4 job gets 2, not 4
    out, script = _probe(live, "elastic-quota")
    job, _ = _submit(live, script, out, "-n", "1:4", "-p", "HIGH")
    wait_for(lambda: len(_ranks(out)) == 2, 60, "its ranks to run")
    time.sleep(1)
    assert _ranks(out) == {0: 2, 1: 2} and live.job(job)["NumNodes"] == "2"
    # below its MAX: who grows it back, and that nothing does where no policy daemon runs
    st = json.loads(live.run(["hai", "status", "--json", str(job)], user=ALICE).stdout)
    assert "; the policy daemon grows it to up to 4 nodes once nodes stay idle" in st["reason"], st
    assert st["reason"].endswith("(where none runs, it stays on 2)"), st
    (out / "go").touch()


def test_a_count_the_step_does_not_allow_is_cut_and_the_other_node_given_back(live):
    # Last in this file: for a few seconds after a job gives nodes back, Slurm 22.05's main
    # scheduler offers a range job one node fewer than are idle (not 25.11: measured by hand).
    blocker = live.sbatch("-N1", "--qos=normal", "-o", "/dev/null", "--wrap", "sleep 300", user=ALICE)
    live.wait_job(blocker, lambda j: j["JobState"] == "RUNNING", FIRST_START, "a 1-node job to hold one node")
    out, script = _probe(live, "elastic-step")
    job, job_dir = _submit(live, script, out, "-n", "2:4:2", "-p", "LOW")
    wait_for(lambda: len(_ranks(out)) == 2, 60, "2 ranks to run")
    time.sleep(1)  # a third rank would have written by now too
    assert _ranks(out) == {0: 2, 1: 2}
    assert live.job(job)["NumNodes"] == "2"  # Slurm gave 3; the job kept 2
    assert [e["size"] for e in _events(job_dir, "start")] == [2]
    # the node it gave back runs another job while the elastic job still runs
    other = live.sbatch("-N1", "--qos=low", "-o", "/dev/null", "--wrap", "sleep 1", user=ALICE)
    live.wait_job(other, lambda j: j["JobState"] in ("RUNNING", "COMPLETED"), 30, "a job on the node given back")
    assert live.job(job)["JobState"] == "RUNNING"
    (out / "go").touch()
    live.wait_job(job, lambda j: j["JobState"] == "COMPLETED", 60, "the elastic job to finish")
