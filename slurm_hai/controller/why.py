"""Why jobs wait, as the leading policy daemon last read the queue: served by the daemon,
asked by `hai status` and `hai list`.

The policy's words for a waiting job (policy/explain.py) need the whole queue: its place in
line, its user's nodes in use. The daemon reads that queue every cycle anyway; where the
policy names `[daemon] service = "http://HOST:PORT"`, the leading daemon answers

    GET /why?jobs=ID,ID,...  ->  {"seen": EPOCH, "jobs": {"ID": {"state", "restarts", "reason", "why"}}}

from its last read (`seen`: when it read it), leaving out the jobs it did not see waiting,
and a command asks it instead of reading the whole queue itself (which costs far more on a
large queue: docs/results-archive.md). It also answers

    GET /jobs  ->  {"seen": EPOCH, "fields": [NAME, ...], "jobs": [[VALUE, ...], ...]}

every job of a read as any user sees it (jobs.status.as_others_see: HaiStatus's fields, in
its order, explained as of the answer's making), for `hai list --all`, which then reads
only its own user's jobs from Slurm (their files, and a job submitted a moment ago, are
the user's own) and takes everyone else's from here: one whole-queue read of slurmctld per
daemon cycle, not one per command. The answer is made for a read when it is first asked
for, on a thread of its own, and kept until the next read's is made: an answer comes at
once from the read before while the newest's is being made (long on a large queue), and a
daemon no one asks makes none. A command takes a job's words only while they hold: the
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
from operator import attrgetter
from typing import TYPE_CHECKING, Sequence
from urllib.parse import parse_qs, urlsplit

if TYPE_CHECKING:
    from ..jobs.status import HaiStatus
    from ..policy.explain import Explainer
    from ..policy.model import Policy
    from ..slurm.records import JobInfo

log = logging.getLogger("hai-policyd")

TIMEOUT = 1.0  # seconds a command waits for the daemon's answer before reading the queue itself
MAX_AGE = 10.0  # a read older than this is not used (a daemon stuck on a slurmctld that does not answer)
# job ids in one question (its request line stays under QUESTION_HEAD); a user with more jobs
# waiting is told from the command's own read of the queue
MAX_JOBS = 5_000
# bytes of a question's request line and headers the service reads (controller/bounded_http.py):
# MAX_JOBS ids of up to 10 digits and their commas, and the rest of a question
QUESTION_HEAD = 1 << 16
# The daemon's cycle holds the GIL for most of its time on a large queue; an answer waits for
# it at each of its few switches, 5 ms each at Python's default (sys.getswitchinterval()), hence a shorter one:
SWITCH_INTERVAL = 0.0005


# ------------------------------------------------------------------ asking (in `hai`)


def _address(service: str) -> tuple[str, int]:
    url = urlsplit(service)
    return url.hostname or "", url.port or 80


class Question:
    """A question to the daemon, sent when made; its answer is read when the command needs it
    (`answer`), so that the daemon answers while the command asks Slurm for its own records."""

    def __init__(self, service: str, path: str, timeout: float = TIMEOUT) -> None:
        host, port = _address(service)
        self._sock: socket.socket | None = None
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
            self._sock.sendall(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        except OSError:
            self.close()

    def answer(self) -> bytes | None:
        """The body of the daemon's 200 answer; None for any other answer, or none in time."""
        if self._sock is None:
            return None
        chunks = []
        try:
            while chunk := self._sock.recv(1 << 20):
                chunks.append(chunk)
        except OSError:
            return None
        finally:
            self.close()
        head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
        return body if head.split(b" ", 2)[1:2] == [b"200"] else None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def why_question(service: str, job_ids: Sequence[int], timeout: float = TIMEOUT) -> Question | None:
    """GET /why of the jobs, sent now; None for no jobs or more than MAX_JOBS (not asked)."""
    if not job_ids or len(job_ids) > MAX_JOBS:
        return None
    return Question(service, "/why?jobs=" + ",".join(map(str, job_ids)), timeout)


def words(question: Question | None, jobs: Sequence[JobInfo]) -> dict[int, str]:
    """The answer's words for each of `jobs` (records read just now) that still hold; {} when
    the daemon did not answer, or answered what is not its answer."""
    body = question.answer() if question is not None else None
    try:
        said = json.loads(body) if body is not None else {}
        seen, answers = float(said["seen"]), said["jobs"]
    except (ValueError, KeyError, TypeError):
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


def ask(service: str, jobs: Sequence[JobInfo], timeout: float = TIMEOUT) -> dict[int, str]:
    """The daemon's words for each of `jobs` (records read just now) that still hold."""
    return words(why_question(service, [j.job_id for j in jobs], timeout), jobs)


def everyone(service: str, timeout: float = TIMEOUT) -> list[HaiStatus] | None:
    """Every job of the daemon's last read as any user sees it, by job id; None when the
    daemon does not answer, its read is older than MAX_AGE, or its rows are not of this
    slurm-hai's HaiStatus (a daemon of another version)."""
    from ..jobs.status import HaiStatus  # lazy: serving side, +13 ms to hai

    body = Question(service, "/jobs", timeout).answer()
    try:
        said = json.loads(body) if body is not None else None
        if said is None or said["fields"] != _fields() or not time.time() - MAX_AGE <= float(said["seen"]):
            return None
        return [HaiStatus(*row) for row in said["jobs"]]
    except (ValueError, KeyError, TypeError):
        return None


def _fields() -> list[str]:
    from dataclasses import fields  # lazy: serving side, +5 ms to hai

    from ..jobs.status import HaiStatus  # lazy: serving side, +13 ms to hai

    return [f.name for f in fields(HaiStatus)]


# ------------------------------------------------------------------ serving (in the daemon)


class WhyService:
    """The daemon's answers, on address:port (a thread per request, each bounded in size and
    time: controller/bounded_http.py); `seen` is called with each cycle's queue."""

    def __init__(self, port: int, address: str = "0.0.0.0") -> None:
        from http.server import BaseHTTPRequestHandler, HTTPServer  # lazy: serving side, +18 ms to hai

        from .bounded_http import BoundedHandler, BoundedServer, family_of  # lazy: serving side, +3 ms to hai

        service = self

        class Handler(BoundedHandler, BaseHTTPRequestHandler):
            max_head = QUESTION_HEAD

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                url = urlsplit(self.path)
                try:
                    if url.path == "/jobs":
                        body = service.everyone()
                    elif url.path == "/why":
                        ids = [int(x) for x in ",".join(parse_qs(url.query).get("jobs", [])).split(",") if x]
                        if len(ids) > MAX_JOBS:
                            raise ValueError(f"at most {MAX_JOBS} jobs at once")
                        body = json.dumps(service.answer(ids)).encode()
                    else:
                        raise ValueError("ask GET /why?jobs=ID,ID or GET /jobs")
                except ValueError as e:
                    self.send_error(400, str(e))
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        class Server(BoundedServer, HTTPServer):
            address_family = family_of(address)

        self._lock = threading.Lock()  # an Explainer builds its lines of waiting jobs on first use
        self._explained: tuple[float, Explainer, dict[int, JobInfo]] | None = None
        self._read: tuple[float, Sequence[JobInfo], Policy] | None = None  # the last read, for /jobs
        self._everyone: tuple[float, bytes] | None = None  # /jobs's answer, and the time of its read
        self._making = threading.Lock()  # held while an answer to /jobs is being made
        self._server = Server((address, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.1,), name="why-service",
                                        daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def seen(self, jobs: Sequence[JobInfo], policy: Policy, now: float) -> None:
        """The queue the daemon read at `now` (its clock), under `policy`: its Explainer is
        built here, in the daemon's cycle, so that no question waits for it."""
        from ..jobs.status import as_one_job  # lazy: serving side, +13 ms to hai
        from ..policy.explain import Explainer  # lazy: serving side, +14 ms to hai

        pending = {j.job_id: j for j in as_one_job(jobs) if j.state == "PENDING"}
        explained = (now, Explainer(jobs, policy, now), pending)
        with self._lock:
            self._explained, self._read = explained, (now, jobs, policy)

    def everyone(self) -> bytes:
        """GET /jobs's answer: the newest read's, made now if there is none younger than
        MAX_AGE; while the newest read's is made (on a thread), the one before's."""
        with self._lock:
            read, made = self._read, self._everyone
        if read is None:
            return json.dumps({"seen": 0, "fields": _fields(), "jobs": []}).encode()
        if made is not None and made[0] >= read[0]:
            return made[1]
        if made is not None and time.time() - made[0] <= MAX_AGE:
            if self._making.acquire(blocking=False):
                threading.Thread(target=self._make, args=(read, True), name="why-everyone", daemon=True).start()
            return made[1]
        with self._making:
            return self._make(read, False)

    def _make(self, read: tuple[float, Sequence[JobInfo], Policy], release: bool) -> bytes:
        """Make (and keep) /jobs's answer for `read`, unless one for it or a newer one was made
        meanwhile. `release`: the caller took self._making for this thread to let go."""
        from ..jobs.status import as_one_job, as_others_see  # lazy: serving side, +13 ms to hai
        from ..policy.explain import Explainer  # lazy: serving side, +14 ms to hai

        try:
            with self._lock:
                made = self._everyone
            if made is not None and made[0] >= read[0]:
                return made[1]
            now, jobs, policy = read
            at, why = time.time(), Explainer(jobs, policy, now)  # an Explainer of its own: no lock held
            names = _fields()
            row = attrgetter(*names)
            rows = [row(as_others_see(j, lambda j: why(j, at))) for j in sorted(as_one_job(jobs), key=lambda j: j.job_id)]
            body = json.dumps({"seen": now, "fields": names, "jobs": rows}).encode()
            with self._lock:
                if self._everyone is None or self._everyone[0] < now:
                    self._everyone = (now, body)
            return body
        finally:
            if release:
                self._making.release()

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
