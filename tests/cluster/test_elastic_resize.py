"""An elastic job shrinks beside a higher job, grows back once it ends, and ends as an
uninterrupted run would: the acceptance test of issue 11 on the live cluster, with the
policy daemon.

examples/elastic_train.py (float64, a global batch of 48 at every size) runs as LOW on 2:4
nodes. A 2-node HIGH job arrives: Slurm preempts the LOW job whole, the job learns from
`hai.target_size()` that it runs on 2 next, commits and calls go_suspend(), and starts
again at once on the 2 nodes left, beside HIGH. HIGH ends; its nodes stay idle for the
local policy's grow_after (10 s); the daemon asks the job to grow and it runs on 4 again.
Its final weights equal those of a one-process run within 1e-9 (only the order of the sums
differs), and every step consumed the same samples.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from slurm_hai.jobs.jobdir import run_notices
from test_acceptance import daemon, events, named, submit, wait_final  # noqa: F401 (fixture)
from uninterrupted import free_port
from test_elastic import ALICE, _all_idle
from waiting import wait_for

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "elastic_train.py"
STEPS = 2000
# 200 s of training at most (the test lets it hurry once it has grown back): time to shrink
# and to grow, on 22.05 perhaps in two steps (a grow that came back short is asked again
# after 3 x grow_after)
ARGS = ["--steps", str(STEPS), "--step-sleep", "0.1"]
# HIGH holds its nodes until the test has seen the shrunk job run beside it (22.05 may take
# up to about 40 s to start it after a requeue in CI; docs/user-guide.md)
HIGH_HOLDS_AT_MOST = 150


def _runs(log: str) -> list[tuple[int, int]]:
    """(world size, step) at the start of each run, from the example's log."""
    out = []
    for line in log.splitlines():
        if line.startswith("[elastic] run "):
            words = line.replace(",", "").split()
            out.append((int(words[4]), int(words[6])))
    return out


def _log(job_dir: Path) -> str:
    path = job_dir / "logs" / "rank-0.log"
    return path.read_text(errors="replace") if path.exists() else ""


def _ids(path: Path) -> dict[int, list[int]]:
    """step -> its sample ids in global order (the last line of a step wins)."""
    return {e["step"]: e["ids"] for e in map(json.loads, path.read_text().splitlines())}


def test_an_elastic_job_shrinks_beside_a_higher_job_grows_back_and_ends_as_an_uninterrupted_run(
        live, daemon, tmp_path):  # noqa: F811
    out = live.shared_dir("elastic-resize", owner=ALICE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HAI_", "SLURM_"))}
    env["HAI_MASTER_PORT"] = str(free_port())  # not the default, which a cluster job's id may give it too
    reference = subprocess.Popen([sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--ids-out", "ids.jsonl",
                                  "--out", "w.safetensors", "--ckpt-dir", "ckpt"], cwd=tmp_path, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _all_idle(live)
    job, job_dir = submit(live, EXAMPLE, "-n", "2:4", "-p", "LOW", user=ALICE,
                          args=[*ARGS, "--ids-out", str(out / "ids.jsonl"), "--out", str(out / "w.safetensors"),
                                "--sleep-until", str(out / "hurry")])
    # a node Slurm still counts as busy makes it start on 3: it then grows to 4 after grow_after
    wait_for(lambda: (r := _runs(_log(job_dir))) and r[-1][0] == 4 and (out / "ids.jsonl").exists()
             and len(_ids(out / "ids.jsonl")) >= r[-1][1] + 10, 90, "the elastic job to train on 4 nodes")
    before = len(_runs(_log(job_dir)))

    # a HIGH job needs 2 of its nodes: it runs beside them on the 2 left
    release = out / "release-high"
    high = live.sbatch("-N2", "--qos=high", "-o", "/dev/null", "--wrap",
                       f"for i in $(seq {HIGH_HOLDS_AT_MOST * 5}); do [ -e {release} ] && exit 0; sleep 0.2; done",
                       user=ALICE)
    submitted = time.monotonic()
    wait_for(lambda: len(_runs(_log(job_dir))) == before + 1, 60, "the elastic job to run again on 2 nodes")
    shrunk = time.monotonic() - submitted
    assert _runs(_log(job_dir))[before][0] == 2, _log(job_dir)
    assert live.job(high)["JobState"] == "RUNNING" and live.job(job)["NumNodes"] == "2"  # side by side
    assert "next run on 2 node(s)" in _log(job_dir)  # hai.target_size(), before it went
    notices = list(run_notices(events(job_dir)).values())  # with the daemon's word on Slurm's preemption
    notice = notices[before - 1]
    assert (notice["cause"], notice.get("by_job"), notice["target_size"]) == ("preempted", high, 2)
    assert [(e["from"], e["to"]) for e in named(job_dir, "shrink")] == [(4, 2)]

    # HIGH ends; its nodes stay idle for grow_after (10 s): the daemon asks the job to grow back.
    # On 22.05 a restart may come back one node short for a while (docs/user-guide.md): the
    # daemon then grows it again, once more nodes were idle for grow_after.
    released = time.time()  # its nodes cannot be idle before this
    release.touch()
    live.wait_job(high, lambda j: j["JobState"] == "COMPLETED", 30, "the HIGH job to end")
    wait_for(lambda: len(_runs(_log(job_dir))) > before + 1 and _runs(_log(job_dir))[-1][0] == 4, 170,
             "the elastic job to grow back to 4 nodes")
    (out / "hurry").touch()  # the rest at full speed (sleeping changes no result)
    grows = named(job_dir, "notice")[before:]
    assert grows and all((n["cause"], n["target_size"]) == ("grow", 4) for n in grows), grows
    assert grows[0]["t"] - released >= 10  # not before the nodes were idle for grow_after
    assert "next run on 4 node(s)" in _log(job_dir)
    resizes = [e for e in named(job_dir, "grow") if e["t"] > notice["t"]]  # none for a run as big as the last
    assert resizes[0]["from"] == 2 and resizes[-1]["to"] == 4

    final = wait_final(job_dir, 180)
    assert final["state"] == "succeeded", _log(job_dir)
    st = json.loads(live.run(["hai", "status", "--json", str(job)], user=ALICE).stdout)
    assert st["sizes"][before - 1:before + 1] == [4, 2] and st["sizes"][-1] == 4
    assert "hai-grow" not in live.job(job)["AdminComment"]  # the daemon dropped its tag once it ran again

    output, _ = reference.communicate(timeout=300)
    assert reference.returncode == 0, output
    # each step consumed the same samples, in the same global order, at every size
    assert _ids(out / "ids.jsonl") == _ids(tmp_path / "ids.jsonl")
    from safetensors.torch import load_file

    got, want = load_file(str(out / "w.safetensors")), load_file(str(tmp_path / "w.safetensors"))
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype == __import__("torch").float64
        scale = want[name].abs().max().item()
        assert (got[name] - want[name]).abs().max().item() <= 1e-9 * scale, name
    print(f"shrink: HIGH submitted -> LOW running on 2 nodes in {shrunk:.1f} s")
