"""The lighthouse service: one torchft lighthouse per elastic job, outliving the job's parts
(issue 31; docs/elastic-in-place.md, "Who coordinates").

`hai-admin lighthouse` answers `GET /v1/jobs/<job id>?min=<MIN>` (a part's `ask`,
runtime/parts.py) with the job's lighthouse, ``{"job": 123, "address": "http://host:port"}``:
started at the first ask while Slurm holds the job, its quorums of at least MIN parts (the
job's own MIN; 1 without `min`), the same one after; 404 once the job has ended. A sweep ends
the lighthouses of jobs that ended.

Who asks is proven as Slurm proves it across nodes: the ask carries a MUNGE credential
(`Authorization: Munge <credential>`) whose payload is the request's target; `unmunge`, on
Slurm's own MUNGE socket (AuthInfo), gives its uid, and munged itself refuses a replayed or
expired one. Only the job's owner (as Slurm records it), root and the user this service runs
as get an answer; anyone else gets 403 and one line. Each connection is bounded as the policy
daemon's are (controller/bounded_http.py: its head's size and time, connections at once), and
the state directory must be this service's own, out of every other user's reach. The
lighthouses listen where the service does (`--listen`).

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
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

from ..jobs.jobdir import user_uid, write_atomic
from ..runtime.parts import AUTH_SCHEME, JOBS_PATH, TORCHFT_RUST_LOG
from ..slurm import SlurmError, backend, munge_socket
from ..slurm.records import ENDED_STATES
from .bounded_http import BoundedHandler, BoundedServer

# Measured (docs/results-archive.md, "Elastic in place"): the heartbeat timeout is what the parts
# that stay lose when others leave (about the timeout itself, torchft's default 5 s); a part
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
CREDENTIAL = re.compile(r"^MUNGE:[A-Za-z0-9+/=]{1,1000}:$")  # base64 between MUNGE's own marks
UNMUNGE_SECONDS = 5.0
# unmunge's exit statuses (MUNGE's munge_err_t) that refuse the credential itself: a bad,
# forged, expired, rewound, replayed or restricted one; the others are the service's trouble
CREDENTIAL_REFUSED = {8: "malformed", 9: "of another MUNGE version", 10: "of an unknown cipher",
                      11: "of an unknown MAC", 12: "of an unknown compression", 13: "of another realm",
                      14: "invalid (another MUNGE key?)", 15: "expired", 16: "rewound (its host's clock is ahead)",
                      17: "replayed", 18: "not for this service"}
WILDCARDS = ("", "0.0.0.0", "::")
log = logging.getLogger("hai-lighthouse")


class LighthouseError(Exception):
    """The service cannot do what was asked; the message says what to do."""


class Refused(LighthouseError):
    """Who asked may not have the answer (HTTP 403); the message says why."""


def credential_of(authorization: list[str]) -> str:
    """The MUNGE credential of a request's Authorization headers (`Munge <credential>`);
    Refused, in one line, when there is none, more than one, or not a credential."""
    if not authorization:
        raise Refused(f"no credential: ask with 'Authorization: {AUTH_SCHEME} <munge -s TARGET>' "
                      "(slurm_hai.runtime.parts.ask does)")
    scheme, _, credential = authorization[0].strip().partition(" ")
    if len(authorization) > 1 or scheme != AUTH_SCHEME or not CREDENTIAL.match(credential.strip()):
        raise Refused(f"not a MUNGE credential: ask with 'Authorization: {AUTH_SCHEME} <munge -s TARGET>'")
    return credential.strip()


def uid_of_unmunged(rc: int, out: str, err: str, target: str) -> int:
    """The uid that `unmunge --numeric --keys=UID` (exit `rc`, output `out`, errors `err`)
    found in a credential, which must have been made for `target`. Refused for a credential
    munged refuses or that was made for another request; LighthouseError for the service's
    own trouble (munged not running, ...)."""
    if rc in CREDENTIAL_REFUSED:
        raise Refused(f"the MUNGE credential is {CREDENTIAL_REFUSED[rc]}: ask again with a fresh one")
    if rc != 0:
        why = (err.strip().splitlines() or [f"exit {rc}"])[-1].removeprefix("unmunge: Error: ")
        raise LighthouseError(f"cannot check MUNGE credentials: {why}")
    meta, _, payload = out.partition("\n\n")
    m = re.fullmatch(r"UID:\s+([0-9]+)\s*", meta)
    if not m:
        raise LighthouseError(f"cannot check MUNGE credentials: unmunge said {meta[:80]!r}")
    if payload != target:
        raise Refused("the MUNGE credential was made for another request: munge the request's own target")
    return int(m.group(1))


class Munge:
    """Who asks: the uid of the request's MUNGE credential, decoded by munged on Slurm's own
    socket (`munge_socket`: AuthInfo, else MUNGE's default)."""

    def __init__(self) -> None:
        if shutil.which("unmunge") is None:
            raise LighthouseError("the lighthouse service checks who asks with MUNGE's unmunge: install munge "
                                  "(apt install munge), as Slurm's auth/munge has it")

    def __call__(self, authorization: list[str], target: str) -> int:
        credential = credential_of(authorization)
        socket_path = munge_socket()  # at each ask: the service may start before slurmctld answers
        argv = ["unmunge", "--numeric", "--keys=UID", *(["--socket", socket_path] if socket_path else [])]
        try:
            p = subprocess.run(argv, input=credential, capture_output=True, text=True,
                               timeout=UNMUNGE_SECONDS, env={"PATH": os.environ.get("PATH", os.defpath)})
        except subprocess.TimeoutExpired:
            raise LighthouseError(f"cannot check MUNGE credentials: unmunge took over {UNMUNGE_SECONDS:g} s") \
                from None
        except OSError as e:
            raise LighthouseError(f"cannot check MUNGE credentials: unmunge: {e.strerror}") from None
        return uid_of_unmunged(p.returncode, p.stdout, p.stderr, target)


def allowed(job: int, owner: int, asker: int) -> None:
    """Refused unless `asker` is the job's owner, root or the user this service runs as."""
    if asker not in (owner, 0, os.geteuid()):
        raise Refused(f"job {job} is not yours (you are uid {asker}): only its owner and root may ask "
                      "for its lighthouse")


def slurm_owner(job: int) -> int | None:
    """The uid of the job's owner while Slurm runs or holds it (a job array: any task of
    it), None once it ended or Slurm no longer knows it; LighthouseError when Slurm cannot
    be asked or names an owner this host does not know."""
    try:
        live = [info for info in backend().jobs([job]) if info.state not in ENDED_STATES]
    except SlurmError as e:
        raise LighthouseError(f"cannot ask Slurm about job {job}: {e}") from None
    if not live:
        return None
    user = live[0].user
    uid = int(user) if user.isdigit() else user_uid(user)
    if uid is None:
        raise LighthouseError(f"job {job}: its owner {user!r} is not a user this host knows")
    return uid


def own_state_dir(path: Path) -> Path:
    """`path`, made if missing (0700), once it is a directory of this service's user that no
    other user can change or replace: no link, no other owner, no group or other write, and
    every directory above it root's or ours, writable by no one else unless sticky (/tmp).
    LighthouseError, one line, otherwise: a foreign entry there is never used."""
    path = Path(os.path.realpath(path.parent)) / path.name  # links above are followed; one at `path` is not
    me = os.geteuid()

    def foreign(p: Path, st: os.stat_result) -> str | None:
        if st.st_uid not in (0, me):
            return f"owned by uid {st.st_uid}"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return "writable by other users"
        return None

    for above in reversed(path.parents):
        why = foreign(above, os.stat(above))
        if why:
            raise LighthouseError(f"{above}: {why}, so another user could replace the lighthouses' state "
                                  f"directory {path}; give a --state-dir under a directory only root writes")
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    why = ("a link, not a directory" if stat.S_ISLNK(st.st_mode) else
           "not a directory" if not stat.S_ISDIR(st.st_mode) else
           f"owned by uid {st.st_uid}, not this service's user (uid {me})" if st.st_uid != me else
           "writable by other users" if st.st_mode & 0o022 else None)
    if why:
        raise LighthouseError(f"{path}: {why}; remove it or give another --state-dir (the service will not use it)")
    return path


def bind_address(listen: str) -> str:
    """Where a lighthouse binds under the service's --listen: that address, any port."""
    return f"[{listen}]:0" if ":" in listen else f"{listen or '0.0.0.0'}:0"


def reported_address(listen: str, torchft_address: str) -> str:
    """The address a lighthouse's parts use: torchft's (this host's name) under a wildcard
    --listen, else the address it was told to listen on (the host's name may resolve to
    another one)."""
    if listen in WILDCARDS:
        return torchft_address
    host = f"[{listen}]" if ":" in listen else listen
    return f"http://{host}:{urllib.parse.urlsplit(torchft_address).port}"


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
    uid: int | None = None  # the job's owner; None in a record of before owners were kept (asked of Slurm)

    def alive(self) -> bool:
        """The process is this lighthouse (its command line names the module and the job),
        not an exited one or a pid reused by another process."""
        try:
            argv = Path(f"/proc/{self.pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return MODULE.encode() in argv and str(self.job).encode() in argv


class Service:
    """The jobs' lighthouses: started on the first ask of the job's owner, found again after
    a restart, ended when their job ends. `ended(ids)` says which of the jobs Slurm no longer
    runs or holds, `owner(job)` the uid of its owner while Slurm runs or holds it, else None
    (both: LighthouseError when they cannot tell). The lighthouses listen on `listen` (serve()
    sets it to the service's own)."""

    def __init__(self, state_dir: Path, ended: Callable[[list[int]], set[int]],
                 heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS,
                 owner: Callable[[int], int | None] = slurm_owner, listen: str = "127.0.0.1"):
        self.state_dir = own_state_dir(state_dir)
        self.ended = ended
        self.owner = owner
        self.listen = listen
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self.lock = threading.Lock()
        self.children: dict[int, subprocess.Popen] = {}  # job -> the lighthouses this service started
        self.lighthouses: dict[int, Lighthouse] = {}
        for path in sorted(self.state_dir.glob("*.json")):
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

    def address(self, job: int, min_parts: int, asker: int) -> str | None:
        """The job's lighthouse address, started now if it has none (its quorums of at least
        `min_parts` parts), for user `asker`; None if the job ended; Refused unless `asker`
        is its owner or root (`allowed`)."""
        with self.lock:
            known = self.lighthouses.get(job)
            if known and known.alive():
                owner = known.uid if known.uid is not None else self.owner(job)  # a record of before owners
                allowed(job, -1 if owner is None else owner, asker)
                return known.address
            if known:
                log.warning("job %d: its lighthouse (pid %d) is gone", job, known.pid)
                self._forget(job)
            owner = self.owner(job)
            if owner is None:
                return None
            allowed(job, owner, asker)
            started = self._start(job, min_parts, owner)
            self.lighthouses[job] = started
            return started.address

    def _start(self, job: int, min_parts: int, owner: int) -> Lighthouse:
        argv = [sys.executable, "-m", MODULE, "--job", str(job), "--min-parts", str(min_parts), "--heartbeat-timeout-ms",
                str(self.heartbeat_timeout_ms), "--listen", self.listen, "--extension", str(torchft_extension())]
        # torchft logs each quorum at INFO: its warnings and errors go to <job>.log
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", TORCHFT_RUST_LOG)}
        with open(self._path(job).with_suffix(".log"), "ab") as errors:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors,
                                    text=True, env=env, start_new_session=True)  # outlives this service
        line = proc.stdout.readline().strip() if proc.stdout else ""
        if not line.startswith("http://"):
            proc.kill()
            proc.wait()
            raise LighthouseError(f"job {job}: its lighthouse did not start (exit {proc.returncode})")
        found = Lighthouse(job=job, pid=proc.pid, address=line, started=time.time(), uid=owner)
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


class _Server(BoundedServer, ThreadingHTTPServer):
    """A thread per connection, each bounded (bounded_http.py)."""


def serve(service: Service, listen: str, port: int, sweep_every: float,
          ready: Callable[[int], None] | None = None, stop: threading.Event | None = None,
          identify: Callable[[list[str], str], int] | None = None) -> None:
    """Answer the parts' asks on listen:port and sweep every `sweep_every` seconds until
    `stop` is set (or SIGTERM/SIGINT); the lighthouses stay, and listen on `listen` too.
    `identify(authorization headers, target)`: the uid that asks (Refused, LighthouseError);
    MUNGE on Slurm's socket by default."""
    who = identify or Munge()
    service.listen = listen

    class Handler(BoundedHandler, BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            m = JOB_PATH.match(self.path)
            if not m:
                return self._reply(400, {"error": f"ask GET {JOBS_PATH}<job id>[?min=<parts>]"})
            job = int(m.group(1))
            try:
                address = service.address(job, int(m.group(2) or 1),
                                          who(self.headers.get_all("Authorization") or [], self.path))
            except Refused as e:
                return self._reply(403, {"error": str(e)})
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
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

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


def run_one(extension: Path, min_parts: int, heartbeat_timeout_ms: int, listen: str) -> None:
    """One lighthouse, torch-free, on `listen` (the service's --listen): print its address,
    serve until SIGTERM."""
    loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", str(extension))
    spec = importlib.util.spec_from_file_location("torchft._torchft", str(extension), loader=loader)
    if spec is None:
        raise LighthouseError(f"{extension}: not a loadable extension")
    ext = importlib.util.module_from_spec(spec)
    loader.exec_module(ext)
    server = ext.LighthouseServer(bind=bind_address(listen), min_replicas=min_parts, join_timeout_ms=JOIN_TIMEOUT_MS,
                                  quorum_tick_ms=QUORUM_TICK_MS, heartbeat_timeout_ms=heartbeat_timeout_ms)
    print(reported_address(listen, server.address()), flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description="one job's torchft lighthouse "
                                 "(started by hai-admin lighthouse)")
    ap.add_argument("--job", type=int, required=True)
    ap.add_argument("--extension", type=Path, required=True)
    ap.add_argument("--min-parts", type=int, default=1)
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=HEARTBEAT_TIMEOUT_MS)
    ap.add_argument("--listen", required=True)
    args = ap.parse_args(argv)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # for sigwait
    run_one(args.extension, args.min_parts, args.heartbeat_timeout_ms, args.listen)


if __name__ == "__main__":
    main()
