"""An elastic job in place on the live cluster (issue 31; docs/elastic-in-place.md):
`hai-submit --in-place -n 2:4` runs examples/parts_train.py as four parts, a job array of
one-node tasks, under the site's lighthouse service (`hai-admin lighthouse`, started here as
an admin runs it, and named by the policy). A 2-node HIGH job takes two of its nodes: the
parts there leave and their tasks wait in the queue, while the other two train on without
a restart. When HIGH ends, the two start again and heal from a live peer. Every part ends
bitwise equal to the others and within 1e-9 of one process (float64)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from test_acceptance import events, named, wait_final
from test_lighthouse import start_service
from waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "parts_train.py"
ALICE = "hai-alice"
STEPS = 300


def rows(out: Path) -> list[dict]:
    found = []
    for f in out.glob("part*.log"):
        found += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return sorted(found, key=lambda r: r["t"])


def test_two_parts_leave_for_a_higher_job_the_others_train_on_and_all_end_as_one_process(live, tmp_path):
    out = live.shared_dir("parts", owner=ALICE)
    policy = live.shared_root() / "parts-policy.toml"
    service, url = start_service(live, tmp_path / "lighthouses", tmp_path / "service.log")
    array = None
    try:
        text = (REPO / "contrib" / "localcluster" / "policy.toml").read_text()
        policy.write_text(text.replace("[elastic]\n", f'[elastic]\nlighthouse_service = "{url}"\n', 1))
        policy.chmod(0o644)
        p = live.run(["env", f"HAI_POLICY={policy}", "hai-submit", "--json", "--in-place", "-n", "2:4", "-p", "LOW",
                      str(EXAMPLE), "--steps", str(STEPS), "--step-sleep", "0.2", "--hurry", str(out / "hurry"),
                      "--out", str(out)], user=ALICE)
        submitted = json.loads(p.stdout)
        array, job_dir = submitted["job_id"], Path(submitted["job_dir"])
        assert submitted["node_range"] == "2:4" and job_dir.name == str(array)
        wait_for(lambda: any(r.get("parts") == 4 and r["step"] >= 5 for r in rows(out) if r["event"] == "step"),
                 240, "four parts in one quorum", 0.3)

        high = live.sbatch("-N2", "--qos=high", "-o", "/dev/null", "--wrap", "sleep 15", user="root")
        live.wait_job(high, lambda j: j["JobState"] == "RUNNING", 60, "the HIGH job to take two nodes")
        left = wait_for(lambda: found if len(found := named(job_dir, "left")) == 2 else None, 60,
                        "two parts to leave", 0.3)
        gone = {e["part"] for e in left}
        stayed = sorted({0, 1, 2, 3} - gone)
        wait_for(lambda: [r for r in rows(out) if r["event"] == "step" and r.get("parts") == 2 and r["committed"]],
                 60, "the other two to train on as two", 0.3)
        # one job to its user, on the nodes of its running parts
        st, listed = hai(live, "status", str(array)), hai(live, "list")
        assert (st["state"], st["nodes"], st["node_range"]) == ("running", 2, "2:4"), st
        assert [r["job_id"] for r in listed if r["job_id"] >= array] == [array], listed  # not a line per task
        wait_for(lambda: live.job(high).get("JobState", "COMPLETED") == "COMPLETED", 90, "the HIGH job to end", 0.5)
        wait_for(lambda: [r for r in rows(out) if r["event"] == "step" and r.get("parts") == 4
                          and r["t"] > max(e["t"] for e in left)], 120, "the four parts together again", 0.5)
        assert hai(live, "status", str(array))["nodes"] == 4
        (out / "hurry").touch()  # the rest of the steps without a pause
        final = wait_final(job_dir, 240)
        # once every task has ended, and only then, the service stops the job's lighthouse
        wait_for(lambda: not (tmp_path / "lighthouses" / f"{array}.json").exists(), 60,
                 "the job's lighthouse to stop with its last part", 0.5)
    finally:
        if array is not None:
            live.run(["scancel", str(array)], check=False)
        service.send_signal(signal.SIGTERM)
        service.wait(15)
        for path in (tmp_path / "lighthouses").glob("*.json"):
            os.kill(json.loads(path.read_text())["pid"], signal.SIGKILL)

    assert final["state"] == "succeeded"
    all_rows = rows(out)
    # the two that stayed never restarted: one join each, and their steps have no gap but the leave's
    for part in stayed:
        assert [r["run"] for r in all_rows if r["event"] == "joined" and r["part"] == part] == [0], part
    # the two that left came back as run 1 of their task, healed from a live peer, trained with all four
    for part in gone:
        assert [r["run"] for r in all_rows if r["event"] == "joined" and r["part"] == part] == [0, 1], part
        assert any(r["event"] == "healed" and r["part"] == part for r in all_rows), part
    ends = {p: json.loads((out / f"part{p}.json").read_text()) for p in range(4)}
    assert ends[0] == ends[1] == ends[2] == ends[3]  # bitwise
    one = tmp_path / "one.json"
    subprocess.run([sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--reference", str(one)], check=True)
    reference = [float.fromhex(w) for w in json.loads(one.read_text())]
    assert max(abs(float.fromhex(a) - b) for a, b in zip(ends[0], reference)) < 1e-9
    starts = [(e["part"], e["run"]) for e in events(job_dir) if e["event"] == "start"]
    assert sorted(starts) == sorted([(p, 0) for p in range(4)] + [(p, 1) for p in gone]), starts
    assert "Traceback" not in (tmp_path / "service.log").read_text()


def hai(live, *argv: str):
    """`hai ARGV --json` as the job's user."""
    return json.loads(live.run(["hai", *argv, "--json"], user=ALICE).stdout)

