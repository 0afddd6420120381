"""An elastic job shrinks beside a higher job and grows back once it ends, on the live
cluster with the policy daemon (issue 11, items 2, 3 and 5).

Slurm preempts the elastic LOW job (2:4) whole for a 2-node HIGH job; the job learns from
`hai.target_size()` that it runs on 2 nodes next, commits and calls go_suspend(); it is
requeued and starts again at once on the 2 nodes left, beside HIGH. When HIGH ends, the
nodes stay idle for the local policy's grow_after (10 s); the daemon asks the job to grow,
and it runs again on 4.
"""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

from test_acceptance import daemon  # noqa: F401 (fixture)
from test_elastic import ALICE, _all_idle, _events, _submit
from waiting import wait_for

PROBE = """
    import os, sys, time
    from pathlib import Path
    import slurm_hai as hai

    out, run = Path(sys.argv[1]), hai.restart_count()
    (out / f"run{run}.rank{os.environ['RANK']}").write_text(os.environ["WORLD_SIZE"])
    end = time.monotonic() + 240
    while time.monotonic() < end and not (out / "go").exists():
        if hai.receive_suspend_command():
            (out / f"run{run}.target").write_text(str(hai.target_size()))
            hai.go_suspend()
        time.sleep(0.1)
"""


def _ranks(out: Path, run: int) -> dict[int, int]:
    """rank -> the WORLD_SIZE it saw, in run `run`"""
    return {int(p.name.split("rank")[1]): int(p.read_text()) for p in out.glob(f"run{run}.rank*")}


def test_an_elastic_job_shrinks_beside_a_higher_job_and_grows_back_when_it_ends(live, daemon):  # noqa: F811
    out = live.shared_dir("elastic-resize", owner=ALICE)
    script = out / "probe.py"
    script.write_text(textwrap.dedent(PROBE))
    live.run(["chown", f"{ALICE}:{ALICE}", str(script)])
    _all_idle(live)
    job, job_dir = _submit(live, script, out, "-n", "2:4", "-p", "LOW")
    wait_for(lambda: len(_ranks(out, 0)) == 4, 60, "the elastic job to run on 4 nodes")

    # a HIGH job needs 2 of them: the LOW job shrinks to 2 and runs beside it
    high = live.sbatch("-N2", "--qos=high", "-o", "/dev/null", "--wrap", "sleep 20", user=ALICE)
    wait_for(lambda: len(_ranks(out, 1)) == 2, 60, "the elastic job to run again on the 2 nodes left")
    assert _ranks(out, 1) == {0: 2, 1: 2}
    assert (out / "run0.target").read_text() == "2"  # hai.target_size() told it before it went
    assert live.job(high)["JobState"] == "RUNNING" and live.job(job)["NumNodes"] == "2"
    notice = _events(job_dir, "notice")[0]
    assert (notice["cause"], notice.get("by_job"), notice["target_size"]) == ("preempted", high, 2)
    assert [(e["from"], e["to"]) for e in _events(job_dir, "shrink")] == [(4, 2)]

    # HIGH ends; its nodes stay idle for grow_after: the daemon asks the job to grow back to 4
    live.wait_job(high, lambda j: j["JobState"] == "COMPLETED", 60, "the HIGH job to end")
    ended = time.monotonic()
    wait_for(lambda: len(_ranks(out, 2)) == 4, 90, "the elastic job to grow back to 4 nodes")
    assert time.monotonic() - ended >= 10  # not before the nodes were idle for grow_after (10 s)
    assert (out / "run1.target").read_text() == "4"
    notice = _events(job_dir, "notice")[1]
    assert (notice["cause"], notice["target_size"]) == ("grow", 4)
    assert [(e["from"], e["to"]) for e in _events(job_dir, "grow")] == [(2, 4)]
    assert "grow" in daemon.read_text()

    (out / "go").touch()
    live.wait_job(job, lambda j: j["JobState"] == "COMPLETED", 60, "the elastic job to finish")
    st = json.loads(live.run(["hai", "status", "--json", str(job)], user=ALICE).stdout)
    assert st["sizes"] == [4, 2, 4]
    assert "hai-grow" not in live.job(job)["AdminComment"]  # the daemon dropped its tag once it ran again
