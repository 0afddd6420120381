"""Why jobs wait, as the leading policy daemon last read the queue: served by the daemon,
asked by `hai status` and `hai list`.

The policy's words for a waiting job (policy/explain.py) need the whole queue: its place in
line, its user's nodes in use. The daemon reads that queue every cycle anyway; where the
policy names `[daemon] service = "http://HOST:PORT"`, the leading daemon answers

    GET /why?jobs=ID,ID,...  ->  {"seen": EPOCH, "jobs": {"ID": {"state", "restarts", "reason", "why"}}}

from its last read (`seen`: when it read it), leaving out the jobs it did not see waiting,
and a command asks it instead of reading the whole queue itself (at 10,000 jobs 5 ms
against 0.3 s, docs/benchmarks.md). A command takes a job's words only while they hold: the
job in its own fresh record in the same state, run (restart count) and Slurm reason, the
daemon's read at most MAX_AGE old; else, or when the daemon does not answer within TIMEOUT,
it reads the whole queue as before. The asking side is the standard library's socket alone
(it runs in every `hai`); the serving side runs in the daemon (`WhyService`).

The words are those `hai list --all` shows any user; a site whose slurm.conf hides jobs
from other users (PrivateData=jobs) leaves the service out (docs/policy.md, `[daemon]`).
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Sequence
from urllib.parse import parse_qs, urlsplit

if TYPE_CHECKING:
    from ..policy.explain import Explainer
    from ..policy.model import Policy
    from ..slurm.records import JobInfo

log = logging.getLogger("hai-policyd")

TIMEOUT = 1.0  # seconds a command waits for the daemon's answer before reading the queue itself
MAX_AGE = 10.0  # a read older than this is not used (a daemon stuck on a slurmctld that does not answer)
# job ids in one question (its request line stays under http.server's 64 KiB); a user with more
# jobs waiting is told from the command's own read of the queue
MAX_JOBS = 5_000
# The daemon's cycle holds the GIL for most of its 0.2-0.6 s at 10,000 jobs; an answer waits for
# it at each of its few switches, by default 5 ms each (measured: p99 of an answer in a cycle).
SWITCH_INTERVAL = 0.0005


# ------------------------------------------------------------------ asking (in `hai`)


def _address(service: str) -> tuple[str, int]:
    url = urlsplit(service)
    return url.hostname or "", url.port or 80


def ask(service: str, jobs: Sequence[JobInfo], timeout: float = TIMEOUT) -> dict[int, str]:
    """The daemon's words for each of `jobs` (records read just now) that still hold; {} when
    the daemon does not answer, or answers what is not its answer."""
    if not jobs or len(jobs) > MAX_JOBS:
        return {}
    host, port = _address(service)
    ids = ",".join(str(j.job_id) for j in jobs)
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(f"GET /why?jobs={ids} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
        if head.split(b" ", 2)[1:2] != [b"200"]:
            return {}
        said = json.loads(body)
        seen, answers = float(said["seen"]), said["jobs"]
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return {}
    if not isinstance(answers, dict) or not time.time() - MAX_AGE <= seen:
        return {}
    out: dict[int, str] = {}
    for j in jobs:
        e = answers.get(str(j.job_id))
        if (isinstance(e, dict) and isinstance(e.get("why"), str) and e.get("state") == j.state
                and e.get("restarts") == j.restart_count and e.get("reason") == j.reason):
            out[j.job_id] = e["why"]
    return out


# ------------------------------------------------------------------ serving (in the daemon)


class WhyService:
    """The daemon's answers, on address:port (a thread per request); `seen` is called with
    each cycle's queue."""

    def __init__(self, port: int, address: str = "0.0.0.0") -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                url = urlsplit(self.path)
                try:
                    if url.path != "/why":
                        raise ValueError("ask GET /why?jobs=ID,ID")
                    ids = [int(x) for x in ",".join(parse_qs(url.query).get("jobs", [])).split(",") if x]
                    if len(ids) > MAX_JOBS:
                        raise ValueError(f"at most {MAX_JOBS} jobs at once")
                except ValueError as e:
                    self.send_error(400, str(e))
                    return
                body = json.dumps(service.answer(ids)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's name
                log.debug("why service: " + format, *args)

        self._lock = threading.Lock()  # an Explainer builds its lines of waiting jobs on first use
        self._explained: tuple[float, Explainer, dict[int, JobInfo]] | None = None
        self._server = ThreadingHTTPServer((address, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.1,), name="why-service",
                                        daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def seen(self, jobs: Sequence[JobInfo], policy: Policy, now: float) -> None:
        """The queue the daemon read at `now` (its clock), under `policy`: its Explainer is
        built here, in the daemon's cycle (17 ms at 10,000 jobs), so that no question waits for it."""
        from ..jobs.status import as_one_job
        from ..policy.explain import Explainer

        pending = {j.job_id: j for j in as_one_job(jobs) if j.state == "PENDING"}
        explained = (now, Explainer(jobs, policy, now), pending)
        with self._lock:
            self._explained = explained

    def answer(self, ids: Sequence[int]) -> dict:
        with self._lock:
            if self._explained is None:
                return {"seen": 0, "jobs": {}}
            now, why, pending = self._explained
            at, out = time.time(), {}
            for i in ids:
                j = pending.get(i)
                if j is not None:
                    out[str(i)] = {"state": j.state, "restarts": j.restart_count, "reason": j.reason,
                                   "why": why(j, at)}
        return {"seen": now, "jobs": out}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def serve(policy: Policy) -> WhyService | None:
    """The service the policy names, on every address at its port; None (logged) when the
    policy names none or the port is taken (the commands then read the queue themselves)."""
    if not policy.daemon_service:
        return None
    port = _address(policy.daemon_service)[1]
    try:
        service = WhyService(port)
        sys.setswitchinterval(SWITCH_INTERVAL)
    except OSError as e:
        log.warning("not answering why jobs wait at %s (port %d: %s); the commands read the queue themselves",
                    policy.daemon_service, port, e.strerror or e)
        return None
    log.info("answering why jobs wait at %s", policy.daemon_service)
    return service
