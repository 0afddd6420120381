"""The policy daemon's metrics on the live cluster, scraped by a real Prometheus (Debian's
`prometheus`): a preemption shows up in the series, read back with PromQL."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import urllib.parse
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from waiting import wait_for

if TYPE_CHECKING:  # the fixtures come from tests/conftest.py
    from conftest import LiveCluster

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
LOCAL_POLICY = REPO / "contrib" / "localcluster" / "policy.toml"
DASHBOARD = REPO / "contrib" / "grafana" / "slurm-hai.json"
GRACE = 5  # grace_seconds of the local policy
COMMIT = 0.5  # how long the job below takes to "commit its checkpoint" after the notice
COOPERATES = f"""
    import time
    import slurm_hai as hai
    print("run", hai.restart_count(), flush=True)
    while True:
        if hai.receive_suspend_command():
            time.sleep({COMMIT})  # stands for the checkpoint commit
            hai.go_suspend()
        time.sleep(0.05)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def promql(live: LiveCluster, tmp_path: Path):
    """`hai-admin daemon --metrics-port` and a Prometheus scraping it every second; yields
    promql(query) -> {labels as a sorted tuple of pairs: value}."""
    metrics_port, prometheus_port = free_port(), free_port()
    log = tmp_path / "daemon.log"
    with log.open("w") as out:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "slurm_hai.cli.admin", "daemon", "--policy", str(LOCAL_POLICY), "--interval",
             "0.5", "--lock", str(tmp_path / "policyd.lock"), "--metrics-port", str(metrics_port),
             "--metrics-address", "127.0.0.1"], env=live.env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    config = tmp_path / "prometheus.yml"  # JSON is YAML
    config.write_text(json.dumps({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                                  "scrape_configs": [{"job_name": "hai-policyd", "static_configs": [
                                      {"targets": [f"127.0.0.1:{metrics_port}"]}]}]}))
    with (tmp_path / "prometheus.log").open("w") as out:
        prometheus = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prometheus_port}"], stdout=out, stderr=subprocess.STDOUT)

    def query(q: str) -> dict:
        url = f"http://127.0.0.1:{prometheus_port}/api/v1/query?{urllib.parse.urlencode({'query': q})}"
        doc = json.loads(urllib.request.urlopen(url, timeout=10).read())
        assert doc["status"] == "success", doc
        return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in doc["data"]["result"]}

    query.metrics_port = metrics_port  # type: ignore[attr-defined]
    try:
        wait_for(lambda: "metrics at http" in log.read_text() or daemon.poll() is not None, 20, "the daemon")
        assert daemon.poll() is None, log.read_text()
        yield query
    finally:
        stop(prometheus)
        stop(daemon)
    assert "Traceback" not in log.read_text(), log.read_text()


def one(result: dict) -> float:
    assert len(result) == 1, result
    return next(iter(result.values()))


def test_a_preemption_shows_up_in_the_prometheus_series(live: LiveCluster, promql):
    out = live.shared_dir("metrics")
    (out / "job.py").write_text(textwrap.dedent(COOPERATES))
    p = live.run(["hai-submit", "--json", "-n", "4", "-p", "LOW", "--gpus-per-node", "8", str(out / "job.py")])
    low = json.loads(p.stdout)["job_id"]
    live.wait_job(low, lambda j: j["JobState"] == "RUNNING", 60, "the LOW job to run")
    # Prometheus has scraped the daemon (its first scrape comes 5-6 s after it starts), and the
    # counters exist at 0 before the preemption: increase() below sees the step
    wait_for(lambda: promql('hai_nodes_held{level="LOW"} == 4'), 30, "a scrape with the LOW job's 4 nodes")
    assert one(promql('hai_suspensions_total{level="LOW",cause="preempted"}')) == 0

    high = live.sbatch("-o", "/dev/null", "-N2", "--qos=high", "--wrap", "sleep 4")
    live.wait_job(high, lambda j: j["JobState"] in ("RUNNING", "COMPLETED"), 40, "the HIGH job to take the nodes")
    live.wait_job(low, lambda j: j["Restarts"] == "1" and j["JobState"] == "RUNNING", 60,
                  "the LOW job to run again once the HIGH job is done")

    wait_for(lambda: promql('hai_restarts_total{level="LOW"} == 1'), 15, "the restart in Prometheus")
    assert one(promql('increase(hai_suspensions_total{level="LOW",cause="preempted"}[2m])')) > 0
    assert one(promql('hai_suspensions_total{level="LOW",cause="preempted"}')) == 1
    assert one(promql('hai_forced_suspensions_total{level="LOW"}')) == 0
    # notice -> go_suspend: the job's "commit"; notice -> the run ended (requeued): within the grace
    assert COMMIT <= one(promql('hai_suspend_checkpoint_seconds_sum{level="LOW"}')) < GRACE
    assert one(promql('hai_preemption_latency_seconds_count{level="LOW",cause="preempted"}')) == 1
    assert COMMIT <= one(promql('hai_preemption_latency_seconds_sum{level="LOW",cause="preempted"}')) < GRACE
    # requeued -> running again: the HIGH job's 4 s and the restart
    assert one(promql('hai_restart_latency_seconds_count{level="LOW"}')) == 1
    assert 0 < one(promql('hai_restart_latency_seconds_sum{level="LOW"}')) < 60
    # the HIGH job's nodes and the LOW job waiting meanwhile, as the gauges went
    assert one(promql('max_over_time(hai_nodes_held{level="HIGH"}[2m])')) == 2
    assert one(promql('max_over_time(sum(hai_pending_jobs{level="LOW"})[2m:1s])')) >= 1
    assert one(promql('hai_daemon_cycle_seconds_count')) > 10
    assert one(promql('hai_daemon_errors_total{kind="slurm"}')) == 0
    # every query of the Grafana dashboard runs, and its suspension panel shows the preemption
    queries = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    results = {q: promql(q.replace("$__rate_interval", "2m")) for q in queries}
    shown = results["sum by (level, cause) (increase(hai_suspensions_total[$__rate_interval]))"]
    assert shown[(("cause", "preempted"), ("level", "LOW"))] > 0, shown
    print("preemption (notice -> requeued) {:.2f} s, checkpoint {:.2f} s, restart {:.2f} s".format(*(
        one(promql(f'{name}_sum{{level="LOW"}}')) for name in ("hai_preemption_latency_seconds",
                                                             "hai_suspend_checkpoint_seconds",
                                                             "hai_restart_latency_seconds"))))


# A user's client that holds the metrics port the slow way (issue 57): it sends its request one
# byte every 0.9 s, connection after connection, for SECONDS, beside a crowd of idle connections;
# it prints the status line each connection was cut with.
SLOW_CLIENT = """
import socket, sys, time
port, seconds = int(sys.argv[1]), float(sys.argv[2])
idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(150)]
end = time.monotonic() + seconds
while time.monotonic() < end:
    s = socket.create_connection(("127.0.0.1", port))
    try:
        for byte in b"GET /metrics HTTP/1.0\\r\\nX-Slow: " + b"y" * 1000:
            s.send(bytes([byte]))
            time.sleep(0.9)
    except OSError:
        pass
    s.settimeout(5)
    try:
        print(s.recv(4096).split(b"\\r\\n")[0].decode(), flush=True)
    except OSError as e:
        print("cut:", e, flush=True)
    s.close()
"""


def test_a_slow_client_and_idle_connections_of_a_user_do_not_stall_prometheus_scrapes(live: LiveCluster, promql):
    seconds = 20
    client = live.shared_dir("metrics-slow", owner="hai-bob") / "slow.py"
    client.write_text(SLOW_CLIENT)
    client.chmod(0o644)
    wait_for(lambda: promql('up{job="hai-policyd"} == 1'), 30, "Prometheus's first scrape")
    p = live.run(["/usr/bin/python3", str(client), str(promql.metrics_port), str(seconds)], user="hai-bob",
                 timeout=seconds + 30)
    cuts = p.stdout.splitlines()
    assert cuts and all(line.startswith("HTTP/1.0 408 ") for line in cuts), p.stdout + p.stderr
    # every scrape of the last `seconds` answered, and fast (one a second)
    window = f"[{seconds}s]"
    assert one(promql(f'count_over_time(up{{job="hai-policyd"}}{window})')) >= seconds // 2
    assert one(promql(f'min_over_time(up{{job="hai-policyd"}}{window})')) == 1
    assert one(promql(f'max_over_time(scrape_duration_seconds{{job="hai-policyd"}}{window})')) < 0.5
