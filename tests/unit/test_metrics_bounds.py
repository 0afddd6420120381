"""What a user can send the policy daemon's metrics (it runs as root or the SlurmUser): the
HTTP endpoint bounds each request in size and time, so that slow, oversized or idle clients
never hold a scrape; what the daemon keeps of the jobs' records is bounded (issue 57)."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest

from slurm_hai.controller import bounded_http, metrics
from slurm_hai.controller.metrics import DaemonMetrics
from slurm_hai.policy.levels import DEFAULT_LADDER
from test_metrics import value
from test_policy_daemon import job

# ------------------------------------------------------------------ the jobs' records


def test_a_record_that_names_a_new_run_every_cycle_keeps_one_entry_per_job_and_gone_jobs_are_forgotten(
        monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: clock[0])
    m = DaemonMetrics(DEFAULT_LADDER, since=0)
    for run in range(1, 2_000):
        said = f"hai-suspend={run - 1}:forced:user:{run}.000:{run + 0.5:.3f}"
        m.observe_cycle([job(1, state="RUNNING", qos="low", restart_count=run, start_time=run + 2, submit_time=run + 1,
                             comment=said)], 0.1, 0)
    assert len(m._runs) == 1 and m._runs[1].suspended.run == 1_998  # the newest alone is kept
    assert value(m, "hai_suspensions_total", level="LOW", cause="user") == 1_999
    assert value(m, "hai_restarts_total", level="LOW") == 1_999
    clock[0] += metrics.FORGET_AFTER - 1
    m.observe_cycle([job(2, state="RUNNING", qos="low")], 0.1, 0)
    assert set(m._runs) == {1, 2}  # job 1 left one snapshot: not forgotten (nor counted again) yet
    clock[0] += 2
    m.observe_cycle([job(2, state="RUNNING", qos="low")], 0.1, 0)
    assert set(m._runs) == {2}


# ------------------------------------------------------------------ the HTTP endpoint


@pytest.fixture
def server(monkeypatch):
    """The metrics served on a free port of 127.0.0.1 (the head's deadline 2 s); yields the server."""
    monkeypatch.setattr(bounded_http, "HEAD_TIMEOUT", 2.0)
    m = DaemonMetrics(DEFAULT_LADDER, since=0)
    m.serve(0, "127.0.0.1")
    try:
        yield m._server
    finally:
        m.close()


@pytest.fixture
def served(server) -> int:
    return server.server_port


def scrape(port: int) -> float:
    """Seconds a scrape took (a failed one raises)."""
    t0 = time.monotonic()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "hai_daemon_cycle_seconds_count 0.0" in text
    return time.monotonic() - t0


def test_a_client_that_sends_one_byte_every_0_9_s_neither_stalls_scrapes_nor_keeps_its_connection(served):
    slow = socket.create_connection(("127.0.0.1", served))
    gone = threading.Event()

    def trickle() -> None:
        try:
            for byte in b"GET /metrics HTTP/1.0\r\nX-Slow: " + b"y" * 100:
                slow.send(bytes([byte]))
                if gone.wait(0.9):
                    return
        except OSError:
            pass

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    t0 = time.monotonic()
    assert max(scrape(served) for _ in range(5)) < 2.0
    slow.settimeout(10)
    answer = slow.recv(4096)  # cut at the deadline, whatever it still sends
    assert answer.startswith(b"HTTP/1.0 408 ") and answer.count(b"\n", answer.index(b"\r\n\r\n") + 4) == 1
    assert time.monotonic() - t0 < 5
    gone.set()
    slow.close()


def test_an_oversized_request_is_refused_in_one_line(served):
    with socket.create_connection(("127.0.0.1", served), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.0\r\n" + b"X-Big: " + b"z" * 100_000 + b"\r\n\r\n")
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 431 ")
    assert body == b"request line and headers over 8192 bytes; send a shorter request\n"
    scrape(served)


def test_a_crowd_of_idle_connections_cannot_keep_a_scrape_out(server):
    port = server.server_port
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(3 * bounded_http.MAX_CONNECTIONS)]
    try:
        assert scrape(port) < 2.0
        assert len(server._open) <= bounded_http.MAX_CONNECTIONS
        idle[0].settimeout(5)
        assert idle[0].recv(1) == b""  # the oldest was dropped for the newer ones
    finally:
        for s in idle:
            s.close()


def test_a_client_that_does_not_read_its_answer_is_dropped(served, monkeypatch):
    monkeypatch.setattr(bounded_http, "WRITE_TIMEOUT", 0.5)
    # an answer bigger than the socket buffers: a client that never reads holds the write
    m = DaemonMetrics(DEFAULT_LADDER, since=0)
    from test_metrics import job
    m.observe_cycle([job(i, state="RUNNING", user=f"u{i}", num_nodes=1) for i in range(30_000)], 0.1, 0)
    m.serve(0, "127.0.0.1")
    try:
        port = m._server.server_port
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            time.sleep(0)  # never reads
            deadline = time.monotonic() + 10
            while m._server._open and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not m._server._open  # its thread gave up and closed it
    finally:
        m.close()
