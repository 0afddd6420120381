"""Crash campaign: every fault a checkpoint save can meet, and what a restarted job loads.

    nice -n 10 .venv/bin/python benchmarks/crash_campaign.py --kills 1000 --seed 1

Three kinds of fault, in every save path (PATHS: a blocking save, async saves, two tiers,
a blocking "suspend" save while an async one is in flight, 2-rank sharded saves, blocking
and async; for kills and power loss also "persist-agent": suspend_save() into node memory
and the persist agent's copy and durable commit, in one process):

* kill: the writer (every rank of a sharded job) is SIGKILLed at a random moment of a
  loop of saves (`--kills N`, spread evenly over the paths);
* injected errors: ENOSPC and EIO at every os.write, os.fsync and os.rename call of one
  save on a file under the checkpoint directory (the calls fileio.py and commit.py make,
  and DCP's fsyncs and renames), one call per trial; the save must fail with one line
  saying why (or commit), the next save must work;
* power loss: the file operations of a few saves are recorded (create, write, fsync,
  mkdir, rename, unlink, rmdir, fsync of a directory), from before the manager creates
  the checkpoint directory and its parent for the first save, and every crash state the model
  below allows is built in a scratch directory and loaded, in the manner of ALICE
  (Pillai et al., OSDI 2014). The model (see docs/reliability.md): after a crash at any
  point of the sequence, a file holds the data of its last fsync plus, of the later
  writes, nothing, all, half, or all of the size but zeros; a directory holds the entry
  operations (create, mkdir, rename, unlink, rmdir) of its last fsync plus ANY subset of
  the later ones (applied in order; a rename between two directories once both are
  fsynced). That is POSIX's promise and no more: weaker than
  ext4 (data=ordered persists metadata in order and never exposes unwritten blocks).

After each fault a fresh process loads the newest checkpoint: it must verify, hold exactly
the values of its step, and be no older than the last save reported committed before
the fault. It prints a table: faults tried, consistent, lost (older than the last
committed, or none), torn loads (wrong values, a step that never started, or the loader
failed). Exit status 1 when anything was lost or torn.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import itertools
import json
import logging
import multiprocessing
import os
import pickle
import random
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout too

from slurm_hai.checkpoint import CheckpointError, CheckpointManager, verify_checkpoint  # noqa: E402
from slurm_hai.checkpoint.manifest import step_dir_name  # noqa: E402

FORK = multiprocessing.get_context("fork")  # torch is already imported: a fork starts in ms
PATHS = ("sync", "async", "fast+durable", "suspend", "sharded", "sharded-async", "persist-agent")
NOT_INJECTED = ("persist-agent",)  # its writes and renames are the store's, injected on the other paths
SHARDED_WORLD = 2
KEEP_LAST = 2


# --- the state and the save loop every fault runs against ---------------------------------

def state_for(step: int) -> dict:
    """Every value encodes the step, so a mixed-up or torn load cannot pass as valid."""
    return {
        "big": torch.full((128 * 1024,), float(step)),
        "nested": {"ids": torch.arange(100, dtype=torch.int64) + step, "rng": torch.full((7,), step % 256, dtype=torch.uint8)},
        "step": step,
        "label": f"step {step}",
    }


def holds_step(state: Any, step: int) -> bool:
    """state holds exactly the values state_for(step) saved."""
    expected = state_for(step)
    return (
        state["step"] == step
        and state["label"] == expected["label"]
        and torch.equal(state["big"], expected["big"])
        and all(torch.equal(state["nested"][k], v) for k, v in expected["nested"].items())
    )


def blocking_for(path: str, step: int) -> bool:
    """Which saves of a path block: the suspend path saves asynchronously and blocks every
    third step (the suspend's save, while the previous async save may still be in flight)."""
    return {
        "sync": True, "async": False, "fast+durable": step % 2 == 0, "suspend": step % 3 == 0,
        "sharded": True, "sharded-async": False,
    }[path]


def run_saves(mgr: CheckpointManager, path: str, steps: Iterator[int], report: Callable[[str, int], None]) -> None:
    """Save each step; report('S', step) before a save and ('C', step) once it is known
    to be committed (a save returns only after the previous one committed)."""
    pending: list[int] = []
    for step in steps:
        report("S", step)
        blocking = blocking_for(path, step)
        mgr.save(step, state_for(step), blocking=blocking)
        for done in pending:
            report("C", done)
        pending = []
        if blocking:
            report("C", step)
        else:
            pending.append(step)
    mgr.wait()
    for done in pending:
        report("C", done)


def run_suspends(root: Path, steps: Iterator[int], report: Callable[[str, int], None],
                 memory: Path | None = None) -> None:
    """The persist-agent path: suspend_save() each step into node memory (memory/node,
    memory defaulting to root), then do what the node's agent does with the request
    (agent.handle, in this process; its spool is memory/spool). ('C', step) once the
    durable commit is done. Requests a killed run left are finished first, as a restarted
    agent does."""
    from slurm_hai.checkpoint.agent import handle, prepare_spool
    from slurm_hai.checkpoint.memory import write_agent_pidfile

    memory = memory or root
    spool = memory / "spool"
    os.environ["HAI_PERSIST_SPOOL"] = str(spool)
    prepare_spool(spool)
    write_agent_pidfile(spool)  # this process stands in for the node's agent

    def agent() -> None:
        for request in sorted(spool.glob("*-*.json")):
            with contextlib.redirect_stdout(io.StringIO()):  # its "committed" line per request
                failed = handle(request)
            if failed:
                raise SystemExit(f"the agent failed on {request.name}")

    agent()
    mgr = CheckpointManager(root / "durable", keep_last=KEEP_LAST, fast_dir=memory / "node")
    for step in steps:
        report("S", step)
        mgr.suspend_save(step, state_for(step))
        agent()
        report("C", step)


def manager_for(root: Path, path: str, memory: Path | None = None) -> CheckpointManager:
    """The durable tier in root/durable; the fast one (fast+durable) in memory/fast, memory
    defaulting to root."""
    fast = (memory or root) / "fast" if path == "fast+durable" else None
    return CheckpointManager(root / "durable", keep_last=KEEP_LAST, fast_dir=fast)


def pipe_reporter(fd: int) -> Callable[[str, int], None]:
    return lambda kind, step: os.write(fd, f"{kind}{step}\n".encode())


# --- processes: writers (one, or one per rank) and a fresh reader ----------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_gloo(rank: int, world_size: int, port: int) -> None:
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )


def _quiet() -> None:
    torch.set_num_threads(1)
    logging.getLogger("slurm_hai").setLevel(logging.CRITICAL)  # quarantines of torn states are expected


def _writer(root: str, path: str, first_step: int, rank: int, port: int, report_fd: int) -> None:
    """Save forever (one rank of SHARDED_WORLD for the sharded paths)."""
    _quiet()
    if path.startswith("sharded"):
        init_gloo(rank, SHARDED_WORLD, port)
    report = pipe_reporter(report_fd) if rank == 0 else (lambda kind, step: None)
    try:
        if path == "persist-agent":
            return run_suspends(Path(root), itertools.count(first_step), report)
        run_saves(manager_for(Path(root), path), path, itertools.count(first_step), report)
    except (CheckpointError, RuntimeError):
        os._exit(1)  # the other rank was killed first: its peer's collectives fail, as they should


def _reader(root: str, path: str, report_fd: int) -> None:
    """A fresh process: find the newest checkpoint, check every value and that it verifies."""
    _quiet()
    try:
        # persist-agent: what a restart on another node finds, the durable directory alone
        mgr = CheckpointManager(Path(root) / "durable") if path == "persist-agent" else manager_for(Path(root), path)
        latest = mgr.latest_step()
        state = mgr.load()
        copies = [store.step_path(latest) for store in mgr.stores] if latest is not None else []
        ok = state is None if latest is None else (
            holds_step(state, latest) and mgr.loaded_step == latest
            and any(copy.exists() and verify_checkpoint(copy).ok for copy in copies)
        )
        view = {"latest": latest, "ok": bool(ok)}
    except Exception as exc:  # noqa: BLE001 - a loader that fails is a torn load, reported
        view = {"latest": None, "ok": False, "error": repr(exc)}
    os.write(report_fd, json.dumps(view).encode())


def start(target: Callable[..., None], *args: Any) -> tuple[Any, int]:
    read_fd, write_fd = os.pipe()
    child = FORK.Process(target=target, args=(*args, write_fd))
    child.start()
    os.close(write_fd)
    return child, read_fd


def read_all(read_fd: int) -> str:
    chunks = []
    while chunk := os.read(read_fd, 65536):
        chunks.append(chunk)
    os.close(read_fd)
    return b"".join(chunks).decode()


def fresh_process_view(root: Path, path: str) -> dict:
    child, read_fd = start(_reader, str(root), path)
    out = read_all(read_fd)
    child.join(120)
    return json.loads(out) if child.exitcode == 0 and out else {"latest": None, "ok": False, "error": f"exit {child.exitcode}"}


# --- tallies --------------------------------------------------------------------------------

@dataclass
class Tally:
    fault: str
    path: str
    tried: int = 0
    consistent: int = 0
    lost: int = 0
    torn: int = 0
    unclear: int = 0  # injected errors: the save failed without saying why, or the next save failed
    notes: list[str] = field(default_factory=list)

    def judge(self, latest: int | None, ok: bool, committed: int | None, started: set[int], detail: str = "") -> None:
        """One fault's outcome: the loaded step must hold its values, have been started,
        and be no older than the last step reported committed before the fault."""
        self.tried += 1
        if not ok or (latest is not None and latest not in started):
            self.torn += 1
            self.notes.append(f"torn: loaded {latest}, started {sorted(started)[-3:]} {detail}")
        elif committed is not None and (latest is None or latest < committed):
            self.lost += 1
            self.notes.append(f"lost: loaded {latest}, committed {committed} {detail}")
        else:
            self.consistent += 1


# --- fault 1: SIGKILL at random moments -----------------------------------------------------

@dataclass
class KillRun:
    """One path's sequence of kills, on one checkpoint directory."""

    path: str
    root: Path
    tally: Tally
    started: set[int] = field(default_factory=set)
    newest_committed: int | None = None
    ever_committed: bool = False


def kill_once(run: KillRun, rng: random.Random) -> None:
    """Start the writer(s), SIGKILL at a random moment, then load in a fresh process."""
    next_step = max(run.started, default=0) + 1
    read_fd, write_fd = os.pipe()
    sharded = run.path.startswith("sharded")
    port = free_port() if sharded else 0
    ranks = [
        FORK.Process(target=_writer, args=(str(run.root), run.path, next_step, rank, port, write_fd))
        for rank in range(SHARDED_WORLD if sharded else 1)
    ]
    for process in ranks:
        process.start()
    os.close(write_fd)
    time.sleep(rng.uniform(0.5, 3.0) if sharded else rng.uniform(0.0, 0.3))
    order = list(ranks)
    rng.shuffle(order)
    for i, process in enumerate(order):
        if i:
            time.sleep(rng.uniform(0.0, 0.1))  # the other rank goes a moment later (a node dies)
        with_pid = process.pid
        if with_pid is not None:
            try:
                os.kill(with_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for process in ranks:
        process.join()
    lines = read_all(read_fd).split()
    run.started |= {int(line[1:]) for line in lines if line.startswith("S")}
    committed = [int(line[1:]) for line in lines if line.startswith("C")]
    if committed:
        run.newest_committed = max(committed)
        run.ever_committed = True
    view = fresh_process_view(run.root, run.path)
    run.tally.judge(view["latest"], view["ok"], run.newest_committed, run.started, view.get("error", ""))
    if view["latest"] is not None and view["ok"]:
        run.newest_committed = max(view["latest"], run.newest_committed or 0)  # what a restarted job resumes from


def kill_campaign(kills: int, paths: tuple[str, ...], workdir: Path, rng: random.Random) -> list[Tally]:
    runs = [KillRun(path, workdir / f"kill-{i}", Tally("SIGKILL at a random moment", path)) for i, path in enumerate(paths)]
    for i in range(kills):
        kill_once(runs[i % len(runs)], rng)
    for run in runs:
        if run.tally.tried and not run.ever_committed:
            run.tally.notes.append("no save committed before any kill: raise the kill delay")
    return [run.tally for run in runs if run.tally.tried]


# --- fault 2: ENOSPC / EIO injected at one write, fsync or rename ---------------------------

INJECTED_OPS = ("write", "fsync", "rename")


class FaultInjector:
    """Counts (and with `fail`, fails one of) the os.write / os.fsync / os.rename calls on
    files under `root`, in this process. Production code is not changed: the os functions
    are wrapped while installed."""

    def __init__(self, root: Path, fail: tuple[str, int, int] | None = None) -> None:
        self.root = str(root.resolve())
        self.fail = fail  # (op, index of the call, errno)
        self.counts = dict.fromkeys(INJECTED_OPS, 0)
        self.fired = False
        self._saved: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _under_root_fd(self, fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(self.root)
        except OSError:
            return False

    def _maybe_fail(self, op: str) -> None:
        with self._lock:
            index = self.counts[op]
            self.counts[op] += 1
            if self.fail is not None and self.fail[:2] == (op, index):
                self.fired = True
                code = self.fail[2]
                raise OSError(code, os.strerror(code))

    def install(self) -> None:
        real = self._saved = {"write": os.write, "fsync": os.fsync, "rename": os.rename, "replace": os.replace}

        def write(fd, data):
            if self._under_root_fd(fd):
                self._maybe_fail("write")
            return real["write"](fd, data)

        def fsync(fd):
            fd_number = fd if isinstance(fd, int) else fd.fileno()
            if self._under_root_fd(fd_number):
                self._maybe_fail("fsync")
            return real["fsync"](fd)

        def renamer(name):
            def rename(src, dst, *args, **kwargs):
                if os.path.abspath(src).startswith(self.root):
                    self._maybe_fail("rename")
                return real[name](src, dst, *args, **kwargs)
            return rename

        os.write, os.fsync, os.rename, os.replace = write, fsync, renamer("rename"), renamer("replace")

    def uninstall(self) -> None:
        os.write, os.fsync = self._saved["write"], self._saved["fsync"]
        os.rename, os.replace = self._saved["rename"], self._saved["replace"]


def _injected_writer(root: str, path: str, fail: tuple[str, int, int] | None, victim: int, rank: int, port: int,
                     report_fd: int) -> None:
    """Commit steps 1 and 2, save step 3 with the fault (on rank `victim`), then step 4."""
    _quiet()
    if path.startswith("sharded"):
        init_gloo(rank, SHARDED_WORLD, port)
    mgr = manager_for(Path(root), path)
    run_saves(mgr, path, iter([1, 2]), lambda kind, step: None)
    injector = FaultInjector(Path(root), fail if rank == victim else None)
    injector.install()
    try:
        mgr.save(3, state_for(3), blocking=blocking_for(path, 3))
        mgr.wait()
        outcome = "committed"
    except CheckpointError as exc:
        outcome = f"error: {exc}"
    finally:
        injector.uninstall()
    staging_left = sorted(p.name for p in (Path(root) / "durable").glob(".staging-*"))
    try:
        mgr.save(4, state_for(4))
        after = "committed"
    except CheckpointError as exc:
        after = f"error: {exc}"
    report = {"rank": rank, "outcome": outcome, "after": after, "fired": injector.fired,
              "counts": injector.counts, "staging_left": staging_left}
    os.write(report_fd, (json.dumps(report) + "\n").encode())
    if path.startswith("sharded"):
        mgr.close()
        import torch.distributed as dist

        dist.destroy_process_group()


def run_injected(root: Path, path: str, fail: tuple[str, int, int] | None, victim: int) -> list[dict]:
    read_fd, write_fd = os.pipe()
    sharded = path.startswith("sharded")
    port = free_port() if sharded else 0
    ranks = [
        FORK.Process(target=_injected_writer, args=(str(root), path, fail, victim, rank, port, write_fd))
        for rank in range(SHARDED_WORLD if sharded else 1)
    ]
    for process in ranks:
        process.start()
    os.close(write_fd)
    out = read_all(read_fd)
    for process in ranks:
        process.join(120)
        if process.is_alive():
            process.kill()
            process.join()
    reports = [json.loads(line) for line in out.splitlines()]
    return sorted(reports, key=lambda r: r["rank"])


CLEAR_REASON = {errno.ENOSPC: "no space left", errno.EIO: os.strerror(errno.EIO)}


def injection_campaign(paths: tuple[str, ...], workdir: Path, rng: random.Random, sample: int | None) -> list[Tally]:
    """Every (rank, op, call, errno) of step 3's save, or `sample` of them at random."""
    tallies = []
    for path in paths:
        sharded = path.startswith("sharded")
        plans = []
        for victim in range(SHARDED_WORLD if sharded else 1):
            dry = run_injected(workdir / f"count-{path.replace('+', '-')}-{victim}", path, None, victim)
            counts = dry[victim]["counts"]
            plans += [(op, i, code, victim) for op in INJECTED_OPS for i in range(counts[op])
                      for code in CLEAR_REASON]
        if sample is not None and len(plans) > sample:
            plans = rng.sample(plans, sample)
        tally = {code: Tally(f"{errno.errorcode[code]} injected (write, fsync, rename)", path) for code in CLEAR_REASON}
        for n, (op, index, code, victim) in enumerate(plans):
            root = workdir / f"inject-{path.replace('+', '-')}-{n}"
            reports = run_injected(root, path, (op, index, code), victim)
            t = tally[code]
            detail = f"({op} #{index} on rank {victim})"
            if len(reports) != (SHARDED_WORLD if sharded else 1):
                t.judge(None, False, 2, {1, 2, 3, 4}, f"{detail}: a writer died")
                continue
            if not any(r["fired"] for r in reports):
                t.notes.append(f"{detail}: not reached in this run (the call count varies)")
                continue
            mine = reports[0]
            fails = [r for r in reports if r["outcome"] != "committed"]
            clear = all(CLEAR_REASON[code] in r["outcome"] and "\n" not in r["outcome"] for r in fails)
            if not clear or any(r["after"] != "committed" or r["staging_left"] for r in reports):
                t.tried += 1
                t.unclear += 1
                t.notes.append(f"unclear: {detail}: {mine}")
                continue
            view = fresh_process_view(root, path)
            t.judge(view["latest"], view["ok"], 4, {1, 2, 3, 4}, detail)
        tallies += [t for t in tally.values() if t.tried]
    return tallies


# --- fault 3: power loss, every crash state of the recorded file operations -----------------

class OpRecorder:
    """Records, in this process, the file operations on `root` and on paths under it in
    the order they happen: ('creat'|'mkdir', parent ino, name, ino), ('write', ino, offset,
    bytes), ('fsync', ino), ('fsyncdir', ino), ('rename', src parent, src name, dst parent,
    dst name, ino), ('unlink'|'rmdir', parent, name, ino), ('mark', 'S'|'C', step), each
    with a monotonic timestamp (to merge the ranks of a sharded save). `root` is the
    nearest existing ancestor of the checkpoint directory, so the mkdirs of a first save
    are recorded too. Files written through Python file objects (DCP's shards and
    .metadata, the pending marker of a suspend save) are seen at their first fsync or
    rename (created there), and what was written to them since is recorded as one write
    before the next operation on the directory (or the end)."""

    def __init__(self, root: Path) -> None:
        self.root = str(root.resolve())
        self.root_ino = os.stat(self.root).st_ino
        self.ops: list[tuple[int, tuple]] = []
        self.sizes: dict[int, int] = {}  # bytes recorded per file inode
        self.fds: dict[int, int] = {}  # fd -> inode, files opened through os.open
        self.lazy: dict[int, str] = {}  # inode -> path: files written through Python file objects
        self._lock = threading.RLock()
        self._saved: dict[str, Any] = {}

    def _add(self, op: tuple) -> None:
        for ino, path in list(self.lazy.items()):
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            if st.st_ino == ino and st.st_size > self.sizes[ino]:
                self._record_growth(ino, path, st.st_size)
        self.ops.append((time.monotonic_ns(), op))

    def _record_growth(self, ino: int, path: str, size: int) -> None:
        done = self.sizes[ino]
        with open(path, "rb") as fh:
            fh.seek(done)
            data = fh.read(size - done)
        self.ops.append((time.monotonic_ns(), ("write", ino, done, data)))
        self.sizes[ino] = done + len(data)

    def mark(self, kind: str, step: int) -> None:
        with self._lock:
            self._add(("mark", kind, step))

    def _resolve(self, path: Any, dir_fd: int | None) -> str:
        path = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(path):
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        return os.path.abspath(path)

    def _mine(self, path: str) -> bool:
        return path.startswith(self.root + os.sep)

    def _parent(self, path: str) -> tuple[int, str]:
        return os.stat(os.path.dirname(path)).st_ino, os.path.basename(path)

    def _catch_up(self, fd: int, path: str) -> None:
        """Bytes written to fd behind our back (a Python file object): one write op."""
        st = os.fstat(fd)
        if st.st_ino not in self.sizes:
            self._add(("creat", *self._parent(path), st.st_ino))
            self.sizes[st.st_ino] = 0
            self.lazy[st.st_ino] = path
        if st.st_size > self.sizes[st.st_ino]:
            self._record_growth(st.st_ino, path, st.st_size)

    def install(self) -> None:
        real = self._saved = {name: getattr(os, name) for name in
                              ("open", "write", "fsync", "close", "rename", "replace", "mkdir", "unlink", "remove", "rmdir")}

        def open_(path, flags, mode=0o777, *, dir_fd=None):
            full = self._resolve(path, dir_fd)
            if not self._mine(full):
                return real["open"](path, flags, mode, dir_fd=dir_fd)
            with self._lock:
                existed = os.path.lexists(full)
                fd = real["open"](path, flags, mode, dir_fd=dir_fd)
                st = os.fstat(fd)
                if flags & os.O_CREAT and not existed:
                    self._add(("creat", *self._parent(full), st.st_ino))
                    self.sizes[st.st_ino] = 0
                if not os.path.isdir(full):
                    self.fds[fd] = st.st_ino
                return fd

        def write(fd, data):
            ino = self.fds.get(fd)
            if ino is None:
                return real["write"](fd, data)
            with self._lock:
                offset = os.lseek(fd, 0, os.SEEK_CUR)
                written = real["write"](fd, data)
                self._add(("write", ino, offset, bytes(memoryview(data).cast("B")[:written])))
                self.sizes[ino] = max(self.sizes.get(ino, 0), offset + written)
                return written

        def fsync(fd):
            fd_number = fd if isinstance(fd, int) else fd.fileno()
            try:
                path = os.readlink(f"/proc/self/fd/{fd_number}")
            except OSError:
                path = ""
            if not self._mine(path) and path != self.root:
                return real["fsync"](fd)
            with self._lock:
                st = os.fstat(fd_number)
                if os.path.isdir(path):
                    real["fsync"](fd)
                    self._add(("fsyncdir", st.st_ino))
                    return None
                self._catch_up(fd_number, path)
                real["fsync"](fd)
                self._add(("fsync", st.st_ino))
                return None

        def close(fd):
            with self._lock:
                self.fds.pop(fd, None)
                return real["close"](fd)

        def renamer(name):
            def rename(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
                full_src, full_dst = self._resolve(src, src_dir_fd), self._resolve(dst, dst_dir_fd)
                if not self._mine(full_src):
                    return real[name](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
                with self._lock:
                    st = os.lstat(full_src)
                    ino = st.st_ino
                    if stat.S_ISREG(st.st_mode) and ino not in self.sizes:  # a file object's, never fsynced
                        fd = real["open"](full_src, os.O_RDONLY | os.O_CLOEXEC)
                        try:
                            self._catch_up(fd, full_src)
                        finally:
                            real["close"](fd)
                    src_parent, dst_parent = self._parent(full_src), self._parent(full_dst)
                    self._add(("rename", *src_parent, *dst_parent, ino))
                    real[name](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
                    for lazy_ino, path in self.lazy.items():  # the renamed file, or one under the renamed dir
                        if path == full_src or path.startswith(full_src + os.sep):
                            self.lazy[lazy_ino] = full_dst + path[len(full_src):]
            return rename

        def mkdir(path, mode=0o777, *, dir_fd=None):
            full = self._resolve(path, dir_fd)
            if not self._mine(full):
                return real["mkdir"](path, mode, dir_fd=dir_fd)
            with self._lock:
                real["mkdir"](path, mode, dir_fd=dir_fd)
                self._add(("mkdir", *self._parent(full), os.lstat(full).st_ino))

        def remover(name, kind):
            def remove(path, *, dir_fd=None):
                full = self._resolve(path, dir_fd)
                if not self._mine(full):
                    return real[name](path, dir_fd=dir_fd)
                with self._lock:
                    ino, parent = os.lstat(full).st_ino, self._parent(full)
                    real[name](path, dir_fd=dir_fd)
                    self._add((kind, *parent, ino))
                    self.sizes.pop(ino, None)  # the inode number is free: a new file may get it
                    self.lazy.pop(ino, None)
            return remove

        os.open, os.write, os.fsync, os.close = open_, write, fsync, close
        os.rename, os.replace, os.mkdir = renamer("rename"), renamer("replace"), mkdir
        os.unlink, os.remove, os.rmdir = remover("unlink", "unlink"), remover("remove", "unlink"), remover("rmdir", "rmdir")

    def uninstall(self) -> None:
        for name, function in self._saved.items():
            setattr(os, name, function)
        with self._lock:
            self._add(("mark", "end", 0))  # records what file objects wrote since the last operation


FIRST_SAVE_CREATES = ("job", "durable")  # under the recorded directory: the checkpoint directory and its parent


def _recorded_writer(root: str, path: str, steps: list[int], rank: int, port: int, out: str, memory: str,
                     break_protocol: str | None) -> None:
    """Run saves of `steps` under the recorder, from the start: root exists, the
    checkpoint directory root/job/durable and its parent do not (the manager creates
    them). The memory tiers (fast tier, node memory, the agent's spool) are in `memory`,
    outside root: a power loss empties them. Pickle (root ino, ops) to out."""
    _quiet()
    if path.startswith("sharded"):
        init_gloo(rank, SHARDED_WORLD, port)
    recorder = OpRecorder(Path(root))
    recorder.install()
    if break_protocol is not None:
        break_protocol_for_selftest(break_protocol)
    report = recorder.mark if rank == 0 else (lambda kind, step: None)
    job = Path(root, FIRST_SAVE_CREATES[0])
    mgr = None
    try:
        if path == "persist-agent":
            run_suspends(job, iter(steps), report, memory=Path(memory))
        else:
            mgr = manager_for(job, path, memory=Path(memory))
            run_saves(mgr, path, iter(steps), report)
    finally:
        recorder.uninstall()
    with open(out, "wb") as fh:
        pickle.dump((recorder.root_ino, recorder.ops), fh)
    if mgr is not None and path.startswith("sharded"):
        mgr.close()
        import torch.distributed as dist

        dist.destroy_process_group()


def break_protocol_for_selftest(how: str) -> None:
    """Remove one durability step (after the recorder is installed, so that the skipped
    fsyncs are not recorded either), to show that the enumeration catches the bug."""
    from slurm_hai.checkpoint import commit

    if how == "no-dir-fsync":
        commit.fsync_dir = lambda path: None
    elif how == "no-parent-fsync":  # the checkpoint directory made as before the fix
        commit.make_dirs = lambda path, mode: path.mkdir(mode=mode, parents=True, exist_ok=True)
    elif how == "no-file-fsync":
        recorded_fsync = os.fsync

        def fsync_dirs_only(fd: int) -> None:
            if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
                recorded_fsync(fd)

        os.fsync = fsync_dirs_only
    else:
        raise ValueError(how)


def record_saves(workdir: Path, path: str, steps: list[int], break_protocol: str | None = None) -> tuple[int, list[tuple], Path]:
    """Record the file operations of saving `steps` on `path`, starting in a directory
    that holds nothing yet: (root ino, ops in order, the real directory afterwards). The
    ranks of a sharded save are merged by time."""
    name = path.replace('+', '-')
    root = workdir / f"record-{name}"
    root.mkdir()
    world = SHARDED_WORLD if path.startswith("sharded") else 1
    port = free_port() if world > 1 else 0
    outs = [workdir / f"ops-{name}-{rank}.pickle" for rank in range(world)]
    memory = workdir / f"memory-{name}"
    ranks = [FORK.Process(target=_recorded_writer,
                          args=(str(root), path, steps, rank, port, str(outs[rank]), str(memory), break_protocol))
             for rank in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(300)
        if process.exitcode != 0:
            raise RuntimeError(f"recording {path} failed: exit {process.exitcode}")
    merged = []
    for out in outs:
        root_ino, ops = pickle.loads(out.read_bytes())
        merged += ops
    merged.sort(key=lambda item: item[0])
    return root_ino, [op for _, op in merged], root


ENTRY_OPS = ("creat", "mkdir", "rename", "unlink", "rmdir")
MAX_FREE_ENTRY_OPS = 10  # up to 2^10 subsets; beyond, every prefix and every single drop


@dataclass
class Replay:
    """The recorded operations with inode numbers turned into ids that are never reused."""

    ops: list[tuple]
    root: int
    kinds: dict[int, str]  # id -> "file" | "dir"
    checkpoint_dir: tuple[str, ...] = FIRST_SAVE_CREATES  # its path from the root
    most_unsynced: int = 0  # the most un-fsynced directory operations at one crash point

    @classmethod
    def from_recording(cls, root_ino: int, ops: list[tuple]) -> Replay:
        ids: dict[int, int] = {}
        kinds: dict[int, str] = {}
        counter = itertools.count()

        def ident(ino: int) -> int:
            if ino not in ids:
                ids[ino] = next(counter)
                kinds[ids[ino]] = "dir"  # existed before the recording: only directories do
            return ids[ino]

        root = ident(root_ino)
        out = []
        for op in ops:
            kind = op[0]
            if kind in ("creat", "mkdir"):
                parent = ident(op[1])
                ids[op[3]] = next(counter)
                kinds[ids[op[3]]] = "file" if kind == "creat" else "dir"
                out.append((kind, parent, op[2], ids[op[3]]))
            elif kind == "write":
                out.append((kind, ident(op[1]), op[2], op[3]))
            elif kind in ("fsync", "fsyncdir"):
                out.append((kind, ident(op[1])))
            elif kind == "rename":
                out.append((kind, ident(op[1]), op[2], ident(op[3]), op[4], ident(op[5])))
            elif kind in ("unlink", "rmdir"):
                out.append((kind, ident(op[1]), op[2], ident(op[3])))
            else:
                out.append(op)
        return cls(out, root, kinds)

    def crash_states(self, crash_at: int) -> Iterator[tuple[tuple, dict[str, bytes | None]]]:
        """Every state the model allows after a crash once ops[:crash_at] were issued, as
        the loader sees it: (a key, the tree of path relative to the checkpoint directory
        -> bytes, None for a directory; empty when the checkpoint directory itself is not
        there). Only the step-* directories are kept: the loader reads nothing else
        (staging and .deleting dirs it only removes), so states that differ elsewhere
        are one state for it. Equal keys mean equal trees."""
        prefix = self.ops[:crash_at]
        last_fsync: dict[int, int] = {}
        last_dir_fsync: dict[int, int] = {}
        writes: dict[int, list[tuple[int, int, bytes]]] = defaultdict(list)
        for index, op in enumerate(prefix):
            if op[0] == "fsync":
                last_fsync[op[1]] = index
            elif op[0] == "fsyncdir":
                last_dir_fsync[op[1]] = index
            elif op[0] == "write":
                writes[op[1]].append((index, op[2], op[3]))
        entry_ops = [(index, op) for index, op in enumerate(prefix) if op[0] in ENTRY_OPS]

        def forced(index: int, op: tuple) -> bool:
            dirs = (op[1], op[3]) if op[0] == "rename" else (op[1],)
            return all(last_dir_fsync.get(d, -1) > index for d in dirs)

        fixed = [(i, op) for i, op in entry_ops if forced(i, op)]
        free = [(i, op) for i, op in entry_ops if not forced(i, op)]
        self.most_unsynced = max(self.most_unsynced, len(free))
        if len(free) <= MAX_FREE_ENTRY_OPS:
            choices = [[f for f, keep in zip(free, mask) if keep] for mask in itertools.product((True, False), repeat=len(free))]
        else:
            choices = [free[:n] for n in range(len(free), -1, -1)] + [free[:n] + free[n + 1:] for n in range(len(free))]
        data_options: dict[int, list[bytes]] = {}
        for chosen in choices:
            visible = self._visible(sorted(fixed + chosen))
            files = [(rel, ident) for rel, ident in visible if self.kinds[ident] == "file"]
            for ident in {ident for _, ident in files} - data_options.keys():
                data_options[ident] = self._data_options(writes.get(ident, []), last_fsync.get(ident, -1))
            for combo in itertools.product(*(range(len(data_options[ident])) for _, ident in files)):
                picked = {rel: (ident, n) for (rel, ident), n in zip(files, combo)}
                key = tuple((rel, picked.get(rel)) for rel, _ in visible)
                yield key, {rel: None if rel not in picked else data_options[picked[rel][0]][picked[rel][1]]
                            for rel, _ in visible}

    def final_tree(self) -> dict[str, bytes | None]:
        """The whole tree under the root with every operation persisted."""
        visible = self._visible([(i, op) for i, op in enumerate(self.ops) if op[0] in ENTRY_OPS], only_steps=False)
        writes: dict[int, list[tuple[int, int, bytes]]] = defaultdict(list)
        for index, op in enumerate(self.ops):
            if op[0] == "write":
                writes[op[1]].append((index, op[2], op[3]))
        return {rel: None if self.kinds[ident] == "dir" else self._data_options(writes.get(ident, []), -1)[0]
                for rel, ident in visible}

    @staticmethod
    def _data_options(writes: list[tuple[int, int, bytes]], synced_at: int) -> list[bytes]:
        """A file's possible contents, everything persisted first: the data of its last
        fsync plus all, none or half of the later writes, or all of their size but zeros."""

        def image(parts: list[tuple[int, bytes]], size: int = 0) -> bytes:
            buf = bytearray(max([size] + [offset + len(data) for offset, data in parts]))
            for offset, data in parts:
                buf[offset : offset + len(data)] = data
            return bytes(buf)

        durable = [(offset, data) for index, offset, data in writes if index < synced_at]
        later = [(offset, data) for index, offset, data in writes if index > synced_at]
        if not later:
            return [image(durable)]
        full = image(durable + later)
        base = image(durable)
        zeros = image(durable, len(full))
        half = full[: len(base) + (len(full) - len(base)) // 2]
        return list(dict.fromkeys([full, base, half, zeros]))

    def _visible(self, applied: list[tuple[int, tuple]], only_steps: bool = True) -> list[tuple[str, int]]:
        """(relative path, id) of everything reachable once `applied` entry operations
        persisted, in order: under the root, or with only_steps, under the checkpoint
        directory's step-* directories only (relative to it; none if it is not reachable)."""
        entries: dict[int, dict[str, int]] = defaultdict(dict)
        for _, op in applied:
            kind = op[0]
            if kind in ("creat", "mkdir"):
                entries[op[1]][op[2]] = op[3]
            elif kind == "rename":
                if entries[op[1]].get(op[2]) == op[5]:
                    del entries[op[1]][op[2]]
                entries[op[3]][op[4]] = op[5]
            elif entries[op[1]].get(op[2]) == op[3]:  # unlink, rmdir
                del entries[op[1]][op[2]]
        start = self.root
        for name in self.checkpoint_dir if only_steps else ():
            if (found := entries[start].get(name)) is None or self.kinds[found] != "dir":
                return []
            start = found
        visible: list[tuple[str, int]] = []
        seen = {start}
        stack = [(start, "")]
        while stack:
            directory, prefix = stack.pop()
            for name, ident in sorted(entries[directory].items()):
                if only_steps and directory == start and (not name.startswith("step-") or self.kinds[ident] != "dir"):
                    continue
                rel = f"{prefix}{name}"
                if self.kinds[ident] == "dir":
                    if ident in seen:
                        continue
                    seen.add(ident)
                    stack.append((ident, rel + "/"))
                visible.append((rel, ident))
        return sorted(visible)

    def marks_before(self, crash_at: int) -> tuple[set[int], int | None]:
        started = {op[2] for op in self.ops[:crash_at] if op[0] == "mark" and op[1] == "S"}
        committed = [op[2] for op in self.ops[:crash_at] if op[0] == "mark" and op[1] == "C"]
        return started, max(committed, default=None)


def materialize(tree: dict[str, bytes | None], where: Path) -> None:
    where.mkdir(mode=0o700)
    for rel in sorted(tree):
        target = where / rel
        if tree[rel] is None:
            target.mkdir(mode=0o700)
        else:
            target.write_bytes(tree[rel])


def load_crash_state(where: Path, path: str) -> tuple[int | None, bool, int]:
    """(loaded step, whether it holds exactly its values and verifies, how many visible
    step dirs did not verify). The fast tier is memory: lost in a power loss."""
    bad_visible = sum(not verify_checkpoint(p).ok for p in where.glob("step-*"))
    try:
        fast = where.parent / "no-fast-tier" if path == "fast+durable" else None
        mgr = CheckpointManager(where, keep_last=100, fast_dir=fast)
        state = mgr.load()
        if state is None:
            return None, True, bad_visible
        step = mgr.loaded_step
        return step, holds_step(state, step) and verify_checkpoint(where / step_dir_name(step)).ok, bad_visible
    except Exception:  # noqa: BLE001 - a loader that fails is a torn load
        return None, False, bad_visible


def power_loss_campaign(paths: tuple[str, ...], workdir: Path, steps: list[int],
                        break_protocol: str | None = None) -> tuple[list[Tally], dict[str, int]]:
    """Record each path's saves, then load every distinct crash state."""
    tallies, bad_visible = [], {}
    scratch_base = Path("/dev/shm") if Path("/dev/shm").is_dir() else workdir
    with tempfile.TemporaryDirectory(dir=scratch_base, prefix="crash-states-") as scratch:
        for path in paths:
            root_ino, ops, real_dir = record_saves(workdir, path, steps, break_protocol)
            replay = Replay.from_recording(root_ino, ops)
            check_recording(replay.final_tree(), real_dir)
            tally = Tally("power loss: every crash state", path)
            tally.notes.append(f"{len(ops)} operations recorded")
            bad_visible[path] = 0
            outcomes: dict[tuple, tuple[int | None, bool, int]] = {}  # one load per state the loader tells apart
            for crash_at in range(len(replay.ops) + 1):
                started, committed = replay.marks_before(crash_at)
                for state_key, tree in replay.crash_states(crash_at):
                    if state_key not in outcomes:
                        where = Path(scratch) / f"state-{len(outcomes)}"
                        materialize(tree, where)
                        outcomes[state_key] = load_crash_state(where, path)
                        shutil.rmtree(where)
                    loaded, ok, bad = outcomes[state_key]
                    bad_visible[path] += bool(bad)
                    tally.judge(loaded, ok, committed, started, f"(crash after op {crash_at})")
            tally.notes.insert(1, f"{len(outcomes)} distinct states loaded; at most {replay.most_unsynced} "
                                  f"un-fsynced directory operations at one crash point")
            tallies.append(tally)
    return tallies, bad_visible


def check_recording(final: dict[str, bytes | None], real_dir: Path) -> None:
    """With every operation persisted, the replay must rebuild the real directory exactly
    (the recorder missed nothing)."""
    real: dict[str, bytes | None] = {}
    for path in sorted(real_dir.rglob("*")):
        rel = path.relative_to(real_dir).as_posix()
        real[rel] = None if path.is_dir() else path.read_bytes()
    if real != final:
        missing = sorted(set(real) ^ set(final)) or [k for k in real if real[k] != final.get(k)]
        raise RuntimeError(f"the recording does not rebuild {real_dir}: differs in {missing[:5]}")


# --- the report -----------------------------------------------------------------------------

def print_table(tallies: list[Tally], out: Any = sys.stdout) -> None:
    columns = ("tried", "consistent", "lost", "torn", "unclear")
    rows = [("fault", "save path", "faults tried", "consistent", "lost", "torn loads", "unclear errors")]
    rows += [(t.fault, t.path, *(str(getattr(t, c)) for c in columns)) for t in tallies]
    rows.append(("**total**", "", *(str(sum(getattr(t, c) for t in tallies)) for c in columns)))
    for row in rows[:1]:
        print("| " + " | ".join(row) + " |", file=out)
        print("|" + "---|" * len(row), file=out)
    for row in rows[1:]:
        print("| " + " | ".join(row) + " |", file=out)
    for t in tallies:
        for note in t.notes[:5]:
            print(f"  {t.fault} / {t.path}: {note}", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=60, help="random SIGKILLs, spread over the save paths (default 60)")
    parser.add_argument("--inject-sample", type=int, default=None,
                        help="injected errors per path: a random sample of this many (default: every call, both errnos)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated save paths (default: {','.join(PATHS)})")
    parser.add_argument("--power-loss-steps", type=int, default=3, help="saves recorded per path for the power-loss replay")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--skip", default="", help="comma-separated faults to skip: kill, inject, power")
    parser.add_argument("--workdir", type=Path, default=None, help="where the checkpoint directories go (default: a temp dir)")
    args = parser.parse_args(argv)
    paths = tuple(p for p in args.paths.split(",") if p)
    unknown = [p for p in paths if p not in PATHS]
    if unknown or args.kills < 0:
        parser.error(f"unknown save path {unknown[0]!r}; known: {', '.join(PATHS)}" if unknown else "--kills must be >= 0")
    skip = set(filter(None, args.skip.split(",")))
    rng = random.Random(args.seed)
    _quiet()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="crash-campaign-") as tmp:
        workdir = Path(tmp)
        tallies: list[Tally] = []
        if "kill" not in skip and args.kills:
            tallies += kill_campaign(args.kills, paths, workdir, rng)
        if "inject" not in skip:
            injected = tuple(p for p in paths if p not in NOT_INJECTED)
            tallies += injection_campaign(injected, workdir, rng, args.inject_sample)
        if "power" not in skip:
            power, bad_visible = power_loss_campaign(paths, workdir, list(range(1, args.power_loss_steps + 1)))
            tallies += power
    print(f"crash campaign: seed {args.seed}, {time.monotonic() - started:.0f} s, torch {torch.__version__}, "
          f"{os.cpu_count()} cores")
    print_table(tallies)
    if "power" not in skip:
        print("crash states with a visible step dir that does not verify (quarantined on load): "
              + ", ".join(f"{p} {n}" for p, n in bad_visible.items()))
    return 1 if any(t.lost or t.torn or t.unclear for t in tallies) else 0


if __name__ == "__main__":
    sys.exit(main())
