"""The lighthouse service: one torchft lighthouse per elastic job, outliving the job's parts
(issue 31; docs/elastic-in-place.md, "Who coordinates").

`hai-admin lighthouse` answers `GET /v1/jobs/<job id>?min=<MIN>` (a part's `ask`,
runtime/parts.py) with the job's lighthouse, ``{"job": 123, "address": "http://host:port"}``:
started at the first ask while Slurm holds the job, its quorums of at least MIN parts (the
job's own MIN; 1 without `min`), the same one after; 404 once the job has ended. A sweep ends
the lighthouses of jobs that ended.

Each lighthouse is a process of its own (`python -m slurm_hai.controller.lighthouse`) that
loads only torchft's Rust extension: importing the torchft package imports torch, which is
what makes torchft's own `torchft_lighthouse` 228 MiB; this one is about 14 MiB
(`benchmarks/lighthouse_bench.py`). It runs in a session of its own, so the service's restart
or crash leaves every lighthouse running; the next service finds them in its state
directory (one `<job>.json` each: pid, address; `<job>.log`: the lighthouse's warnings).

A lighthouse that dies is never started again at its address: a new torchft lighthouse
numbers its quorums from 1 again, and a torchft Manager keys its process group's store by
quorum id, so parts that carried on under it could meet stale keys. The next ask starts a new
lighthouse on a new port; the parts of the old one fail their next quorum and leave.

Standard library only, and torchft's extension in the lighthouse processes: the service
itself loads no torch.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

from ..jobs.jobdir import write_atomic
from ..runtime.parts import JOBS_PATH

# Measured (docs/benchmarks.md, "Elastic in place"): the heartbeat timeout is what the parts
# that stay lose when others leave (4.9 s at torchft's 5 s default, 0.5 s at 500 ms); a part
# heartbeats every 100 ms (torchft's Manager, from a thread of its own, not Python's), so
# 300 ms is three beats missed. A part dropped while it still trains is not lost: it is in
# the next quorum and heals there. `hai-admin lighthouse --heartbeat-timeout-ms`; torchft's
# command's default join timeout is kept (a short one left a part late to a step out of every
# quorum): LighthouseServer's own default is far shorter, and under it four parts on the
# local cluster trained as two pairs (197 of 200 steps).
HEARTBEAT_TIMEOUT_MS = 300
JOIN_TIMEOUT_MS = 60_000
QUORUM_TICK_MS = 100  # torchft_lighthouse's: how often a waiting quorum is looked at again
MODULE = "slurm_hai.controller.lighthouse"
JOB_PATH = re.compile(rf"^{re.escape(JOBS_PATH)}([1-9][0-9]{{0,9}})(?:\?min=([1-9][0-9]{{0,4}}))?$")
log = logging.getLogger("hai-lighthouse")


class LighthouseError(Exception):
    """The service cannot do what was asked; the message says what to do."""


def torchft_extension() -> Path:
    """torchft's Rust extension (`_torchft*.so`), found without importing torchft (whose
    package imports torch)."""
    spec = importlib.util.find_spec("torchft")
    if spec is None or not spec.submodule_search_locations:
        raise LighthouseError("the lighthouse needs torchft: pip install 'slurm-hai[elastic]'")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("_torchft*.so"))
    if not found:
        raise LighthouseError(f"torchft at {spec.submodule_search_locations[0]} has no _torchft extension: "
                              "reinstall it (pip install 'slurm-hai[elastic]')")
    return found[0]


@dataclass(frozen=True)
class Lighthouse:
    """One job's lighthouse, as its state file records it."""

    job: int
    pid: int
    address: str
    started: float

    def alive(self) -> bool:
        """The process is this lighthouse (its command line names the module and the job),
        not an exited one or a pid reused by another process."""
        try:
            argv = Path(f"/proc/{self.pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return MODULE.encode() in argv and str(self.job).encode() in argv


class Service:
    """The jobs' lighthouses: started on the first ask, found again after a restart, ended
    when their job ends. `ended(ids)` says which of the jobs Slurm no longer runs or holds
    (LighthouseError when it cannot tell)."""

    def __init__(self, state_dir: Path, ended: Callable[[list[int]], set[int]],
                 heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS):
        self.state_dir = state_dir
        self.ended = ended
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self.lock = threading.Lock()
        self.children: dict[int, subprocess.Popen] = {}  # job -> the lighthouses this service started
        state_dir.mkdir(parents=True, exist_ok=True)
        self.lighthouses: dict[int, Lighthouse] = {}
        for path in sorted(state_dir.glob("*.json")):
            found = self._read(path)
            if found and found.alive():
                self.lighthouses[found.job] = found
                log.info("job %d: its lighthouse runs on at %s (pid %d)", found.job, found.address, found.pid)
            else:
                path.unlink(missing_ok=True)

    def _read(self, path: Path) -> Lighthouse | None:
        try:
            return Lighthouse(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            log.warning("%s: not a lighthouse record; removed", path)
            return None

    def _path(self, job: int) -> Path:
        return self.state_dir / f"{job}.json"

    def address(self, job: int, min_parts: int = 1) -> str | None:
        """The job's lighthouse address, started now if it has none (its quorums of at least
        `min_parts` parts); None if the job ended."""
        with self.lock:
            known = self.lighthouses.get(job)
            if known and known.alive():
                return known.address
            if known:
                log.warning("job %d: its lighthouse (pid %d) is gone", job, known.pid)
                self._forget(job)
            if job in self.ended([job]):
                return None
            started = self._start(job, min_parts)
            self.lighthouses[job] = started
            return started.address

    def _start(self, job: int, min_parts: int) -> Lighthouse:
        argv = [sys.executable, "-m", MODULE, "--job", str(job), "--min-parts", str(min_parts), "--heartbeat-timeout-ms",
                str(self.heartbeat_timeout_ms), "--extension", str(torchft_extension())]
        # torchft logs each quorum at INFO: its warnings and errors go to <job>.log
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        with open(self._path(job).with_suffix(".log"), "ab") as errors:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors,
                                    text=True, env=env, start_new_session=True)  # outlives this service
        line = proc.stdout.readline().strip() if proc.stdout else ""
        if not line.startswith("http://"):
            proc.kill()
            proc.wait()
            raise LighthouseError(f"job {job}: its lighthouse did not start (exit {proc.returncode})")
        found = Lighthouse(job=job, pid=proc.pid, address=line, started=time.time())
        write_atomic(self._path(job), json.dumps(asdict(found)) + "\n")
        self.children[job] = proc
        log.info("job %d: lighthouse started at %s (pid %d), quorums of %d part(s) or more", job, found.address,
                 proc.pid, min_parts)
        return found

    def _forget(self, job: int) -> None:
        """Stop the job's lighthouse if it runs, and drop its record."""
        known = self.lighthouses.pop(job, None)
        if known and known.alive():
            os.kill(known.pid, signal.SIGTERM)
        child = self.children.pop(job, None)
        if child:
            child.wait()
        self._path(job).unlink(missing_ok=True)
        self._path(job).with_suffix(".log").unlink(missing_ok=True)

    def sweep(self) -> list[int]:
        """End the lighthouses of jobs that ended (and forget the ones that died); the jobs."""
        with self.lock:
            jobs = sorted(self.lighthouses)
            over = self.ended(jobs) if jobs else set()
            gone = [job for job in jobs if job in over or not self.lighthouses[job].alive()]
            for job in gone:
                log.info("job %d: %s", job, "ended, its lighthouse stopped" if job in over else "its lighthouse died")
                self._forget(job)
            return gone

    def detach(self) -> None:
        """Leave every lighthouse running (what the service's own end does)."""
        for proc in self.children.values():
            if proc.stdout:
                proc.stdout.close()
        self.children.clear()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """A part that went away before its answer (its task ended while it asked) is no
        error; anything else is logged, with its traceback, once."""
        if isinstance(sys.exc_info()[1], ConnectionError):  # a broken pipe, a reset
            log.debug("%s went away before its answer", client_address[0])
        else:
            log.exception("a request from %s failed", client_address[0])


def serve(service: Service, listen: str, port: int, sweep_every: float,
          ready: Callable[[int], None] | None = None, stop: threading.Event | None = None) -> None:
    """Answer the parts' asks on listen:port and sweep every `sweep_every` seconds until
    `stop` is set (or SIGTERM/SIGINT); the lighthouses stay."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            m = JOB_PATH.match(self.path)
            if not m:
                return self._reply(400, {"error": f"ask GET {JOBS_PATH}<job id>[?min=<parts>]"})
            job = int(m.group(1))
            try:
                address = service.address(job, int(m.group(2) or 1))
            except LighthouseError as e:
                return self._reply(503, {"error": str(e)})
            if address is None:
                return self._reply(404, {"error": f"job {job} is not running or waiting in Slurm"})
            self._reply(200, {"job": job, "address": address})

        def _reply(self, status: int, body: dict) -> None:
            data = (json.dumps(body) + "\n").encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - http.server's signature
            log.debug("%s %s", self.address_string(), format % args)

    try:
        httpd = _Server((listen, port), Handler)
    except OSError as e:
        raise LighthouseError(f"cannot listen on {listen}:{port}: {e.strerror or e}; give another --port") from None
    threading.Thread(target=httpd.serve_forever, name="lighthouse-http", daemon=True).start()
    log.info("lighthouse service on %s:%d, state in %s", listen, httpd.server_address[1], service.state_dir)
    if ready:
        ready(httpd.server_address[1])
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(sweep_every):
            try:
                service.sweep()
            except LighthouseError as e:
                log.warning("sweep skipped: %s", e)
    finally:
        httpd.shutdown()
        httpd.server_close()
        service.detach()
        log.info("lighthouse service stopped; %d lighthouses run on", len(service.lighthouses))


def run_one(extension: Path, min_parts: int, heartbeat_timeout_ms: int) -> None:
    """One lighthouse, torch-free: print its address, serve until SIGTERM."""
    loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", str(extension))
    spec = importlib.util.spec_from_file_location("torchft._torchft", str(extension), loader=loader)
    if spec is None:
        raise LighthouseError(f"{extension}: not a loadable extension")
    ext = importlib.util.module_from_spec(spec)
    loader.exec_module(ext)
    server = ext.LighthouseServer(bind="[::]:0", min_replicas=min_parts, join_timeout_ms=JOIN_TIMEOUT_MS,
                                  quorum_tick_ms=QUORUM_TICK_MS, heartbeat_timeout_ms=heartbeat_timeout_ms)
    print(server.address(), flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description="one job's torchft lighthouse "
                                 "(started by hai-admin lighthouse)")
    ap.add_argument("--job", type=int, required=True)
    ap.add_argument("--extension", type=Path, required=True)
    ap.add_argument("--min-parts", type=int, default=1)
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=HEARTBEAT_TIMEOUT_MS)
    args = ap.parse_args(argv)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # for sigwait
    run_one(args.extension, args.min_parts, args.heartbeat_timeout_ms)


if __name__ == "__main__":
    main()
