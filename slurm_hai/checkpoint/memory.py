"""The node memory tier of suspend saves, and the hand-off to the node's persist agent.

A suspend save (``CheckpointManager.suspend_save``) commits each node's share of the
checkpoint to that node's memory (``fast_dir``, e.g. under /dev/shm) and returns; the job
then calls go_suspend(). The durable copy is finished by the persist agent of each node
(agent.py), a process that outlives the job:

    FAST/parts/.staging-<step>-...      a part being written (never read)
    FAST/parts/step-<N>/                one node's committed part (renamed into place)
        part.json                       PartInfo: the step, which node of how many, the
                                        durable directory, the files this node owns and
                                        the whole checkpoint's manifest
        <the checkpoint's files>        those this node's ranks wrote, plus copies of the
                                        small shared ones (tree.json, dcp/.metadata)
    FAST/spares/own-<rank>, peer-<rank> pre-faulted files (reserve_spares): a suspend save
                                        renames them into its part and overwrites them
    SPOOL/<uid>-<step>-<token>-<k>.json one request per node and save: {"part": path}
                                        (SPOOL: /run/slurm-hai/persist, root 1733)
    DIR/.persisting-<N>.json            rank 0 wrote it once every node's part committed:
                                        a restart elsewhere waits for step N
    DIR/.persist-<N>-<token>/           the agents' shared staging dir; .part-<k>.done

Spares: a new tmpfs file costs a page fault and a zeroed page per 4 KiB written, several
times the cost of the copy itself (docs/results-archive.md). So the job reserves its
suspend save's memory ahead, in the background (``posix_fallocate``), and the save
overwrites pages that are already there: its own file (``own-<rank>``) and, for a peer copy,
what the previous node sends (``peer-<rank>``). Without spares the save is the same, slower.

Every node's agent copies the files its node owns into the shared staging dir, checking
each against the manifest's checksum, fsyncs them and drops its ``.part-<k>.done``; the one
that finds every node's marker (holding DIR/.lock) writes the manifest and renames the dir
to ``step-<N>``, the same commit as any save. A crash of an agent leaves the request in the
spool (a restarted agent does it again) and the durable tier with the new checkpoint or
without it, never a part of it.

Torch-free: the agent imports this module.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import secrets
import shutil
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .commit import CheckpointStore, process_start_ticks, writer_alive
from .errors import CheckpointError, CorruptCheckpointError, Problem
from .fileio import describe_os_error, fsync_dir, write_hashed_file
from .manifest import (DELETING_PREFIX, MANIFEST_NAME, PERSIST_PREFIX, STEP_DIR_PREFIX, FileEntry, Manifest, check_file,
                       hasher_like, mismatch, parse_manifest)

log = logging.getLogger(__name__)

PARTS_DIR = "parts"
SPARES_DIR = "spares"
SPARE_TMP_PREFIX = ".tmp-"
PEER_PREFIX = "peer-"
PART_FILE = "part.json"
PART_FORMAT = "slurm-hai-memory-part"
PENDING_PREFIX = ".persisting-"
AGENT_PIDFILE = "agent.pid"
FAILED_PREFIX = "failed-"  # a request given up on, kept in the spool for the admin
# In a directory only root can write to: nobody can take the spool's name while the agent is down.
DEFAULT_SPOOL = "/run/slurm-hai/persist"
PENDING_WAIT_S = 120.0  # how long a restart elsewhere waits for the agents' durable commit


def spool_dir() -> Path:
    """Where this node's persist agent takes requests ($HAI_PERSIST_SPOOL overrides)."""
    return Path(os.environ.get("HAI_PERSIST_SPOOL") or DEFAULT_SPOOL)


def node_name() -> str:
    """Which node's memory this process sees: Slurm's name for the node, else the host's."""
    return os.environ.get("SLURMD_NODENAME") or os.uname().nodename


class UnsafeFile(CheckpointError):
    """A file a user named is a link, a FIFO, a device or a socket (or a request is not one):
    refused for good, never retried."""


def open_regular(path: Path) -> int:
    """Open a file a user may have put there for reading: without following a link, without
    blocking (a FIFO's open waits for a writer), and only if it is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(f"{path} is a symbolic link") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UnsafeFile(f"{path} is {file_kind(mode)}, not a regular file")
    return fd


def file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return kind
    return "a regular file" if stat.S_ISREG(mode) else "not a file"


def agent_alive(spool: Path | None = None) -> bool:
    """Does a persist agent run on this node? (its pid file, written by the spool's owner:
    pid and start time; anyone else's is not believed)"""
    spool = spool or spool_dir()
    try:
        fd = open_regular(spool / AGENT_PIDFILE)
        with open(fd, "rb") as f:
            written_by, text = os.fstat(f.fileno()).st_uid, f.read(64)
        if written_by != os.stat(spool).st_uid:
            return False
        pid, ticks = (int(x) for x in text.split())
    except (OSError, ValueError, CheckpointError):
        return False
    return writer_alive(pid, ticks)


def write_agent_pidfile(spool: Path) -> None:
    """Anyone may create entries in the spool: the pid file is written under a new random
    name (never through a link someone left) and renamed over whatever holds its name."""
    pid = os.getpid()
    tmp = spool / f".{AGENT_PIDFILE}.{pid}.{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, f"{pid} {process_start_ticks(pid)}\n".encode())
    finally:
        os.close(fd)
    try:
        os.replace(tmp, spool / AGENT_PIDFILE)
    except OSError:  # a directory was left there while no agent ran: set it aside
        os.rename(spool / AGENT_PIDFILE, spool / f"{FAILED_PREFIX}{AGENT_PIDFILE}-{secrets.token_hex(4)}")
        os.replace(tmp, spool / AGENT_PIDFILE)


@dataclass
class PartInfo:
    """part.json: one node's share of a checkpoint in its memory tier."""

    step: int
    token: str  # names the agents' shared staging dir of this save
    node: str
    node_index: int
    nodes: int
    durable: str  # the durable checkpoint directory the agents commit to
    owned: list[str]  # files this node's agent copies (each file has exactly one owner)
    manifest: Manifest  # the whole checkpoint's

    def to_json_bytes(self) -> bytes:
        return json.dumps({
            "format": PART_FORMAT, "format_version": 1, "step": self.step, "token": self.token, "node": self.node,
            "node_index": self.node_index, "nodes": self.nodes, "durable": self.durable, "owned": self.owned,
            "manifest": json.loads(self.manifest.to_json_bytes()),
        }, indent=1).encode()


def read_part(part_dir: Path) -> PartInfo:
    try:
        with open(open_regular(part_dir / PART_FILE), "rb") as f:
            raw = json.loads(f.read())
        if raw.get("format") != PART_FORMAT:
            raise ValueError(f"not a {PART_FORMAT}")
        manifest = parse_manifest(json.dumps(raw["manifest"]).encode())
        return PartInfo(int(raw["step"]), str(raw["token"]), str(raw["node"]), int(raw["node_index"]),
                        int(raw["nodes"]), str(raw["durable"]), [str(n) for n in raw["owned"]], manifest)
    except FileNotFoundError:
        raise CorruptCheckpointError(str(part_dir), [Problem(PART_FILE, "missing")]) from None
    except PermissionError:
        raise CheckpointError(f"cannot read {part_dir / PART_FILE}: permission denied") from None
    except UnsafeFile:
        raise
    except (OSError, ValueError, KeyError, TypeError, CheckpointError) as exc:
        raise CorruptCheckpointError(str(part_dir), [Problem(PART_FILE, str(exc))]) from None


def check_part_files(part_dir: Path, part: PartInfo, names: list[str]) -> list[Problem]:
    """Size and checksum of the named files of a part against the checkpoint's manifest."""
    problems = []
    for name in names:
        entry = part.manifest.files.get(name)
        if entry is None:
            problems.append(Problem(name, "not in the checkpoint's manifest"))
        else:
            problems += check_file(part_dir, name, entry, check_data=True, mapped=True)
    return problems


def parts_store(fast_root: Path, *, lock_timeout: float, stale_staging_age_s: float) -> CheckpointStore:
    return CheckpointStore(fast_root / PARTS_DIR, lock_timeout=lock_timeout, stale_staging_age_s=stale_staging_age_s)


def newest_part(parts: CheckpointStore) -> tuple[int, Path] | None:
    steps = parts.steps()
    return max(steps.items()) if steps else None


def commit_part(parts: CheckpointStore, staging: Path, part: PartInfo) -> Path:
    """Write part.json into a fully written staging dir and rename it to step-<N>. A part of
    the same step that is already there (an earlier run's) is replaced: the durable commit
    of that step, if any, was made from identical files, and a pending one reads the new."""
    try:
        (staging / PART_FILE).write_bytes(part.to_json_bytes())
        target = parts.step_path(part.step)
        with parts.locked():
            if target.exists():
                shutil.rmtree(target)
            os.rename(staging, target)
        return target
    except OSError as exc:
        raise describe_os_error(exc, f"committing step {part.step} to node memory {parts.root}") from exc


def spares_dir(parts: CheckpointStore) -> Path:
    return parts.root.parent / SPARES_DIR


def _spare_tmp(spares: Path) -> Path:
    """A temporary name in spares/ that names its process (reserve_spares cleans up after
    dead ones)."""
    return spares / f"{SPARE_TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"


def _recycle(parts: CheckpointStore, durable: CheckpointStore, spares: Path) -> list[Path]:
    """Retire this node's parts and peer copies whose step is committed durably (they only
    spare a restart the durable read) and return their big files, moved into spares/ as
    spare candidates, largest first. Each dir is renamed away first, so that nothing reads
    it half emptied (another rank of the node recycling at the same time gets the others)."""
    taken = []
    for path in sorted(parts.root.glob("*")):
        step = _part_step(path.name)
        if step is None or not durable.step_path(step).exists():
            continue
        retired = parts.root / f"{DELETING_PREFIX}{path.name}-{os.getpid()}-{secrets.token_hex(2)}"
        try:
            os.rename(path, retired)
        except OSError:
            continue
        for file in retired.rglob("*"):
            try:
                if file.is_file() and not file.is_symlink() and file.stat().st_size >= 1 << 20:
                    os.rename(file, dest := _spare_tmp(spares))
                    taken.append((dest.stat().st_size, dest))
            except OSError:
                continue
        shutil.rmtree(retired, ignore_errors=True)
    return [dest for _, dest in sorted(taken, reverse=True)]


def _part_step(name: str) -> int | None:
    """The step of a committed part (step-<N>) or peer copy (peer-<N>-<k>) dir name."""
    for prefix in (STEP_DIR_PREFIX, PEER_PREFIX):
        if name.startswith(prefix):
            try:
                return int(name[len(prefix):].split("-")[0])
            except ValueError:
                return None
    return None


def reserve_spares(parts: CheckpointStore, durable: CheckpointStore, sizes: dict[str, int], *,
                   wait_s: float = PENDING_WAIT_S, stop: threading.Event | None = None) -> None:
    """Make sure each spares/<name> has at least its size in node memory, written once (run
    in the background: it writes every page once). Parts whose durable copy is committed are
    recycled first, so that the memory tier holds about one save's worth of pages; a part
    still on its way to the durable tier is waited for (up to wait_s, or until `stop` is
    set) rather than doubled. Best effort: with too little memory the save goes without
    (logged)."""
    spares = spares_dir(parts)
    stop = stop or threading.Event()
    mine: list[Path] = []
    try:
        spares.mkdir(mode=0o700, exist_ok=True)
        for tmp in spares.glob(f"{SPARE_TMP_PREFIX}*"):  # of processes that died reserving
            with contextlib.suppress(ValueError, OSError):
                if not Path(f"/proc/{int(tmp.name[len(SPARE_TMP_PREFIX):].split('-')[0])}").exists():
                    tmp.unlink()
        missing = {name: size for name, size in sizes.items()
                   if not ((spares / name).exists() and (spares / name).stat().st_size >= size)}

        def on_its_way() -> bool:
            return any(step is not None and not durable.step_path(step).exists()
                       for step in (_part_step(p.name) for p in parts.root.glob("*")))

        deadline = time.monotonic() + wait_s
        while missing and on_its_way() and time.monotonic() < deadline:
            if stop.wait(1.0):
                return
        mine = _recycle(parts, durable, spares) if missing else []
        for name, size in sorted(missing.items(), key=lambda item: item[1], reverse=True):
            tmp = mine[0] if mine else _spare_tmp(spares)
            if not mine:
                mine.append(tmp)
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                have = os.fstat(fd).st_size
                os.posix_fallocate(fd, 0, size)  # all or nothing when memory is short
                _zero(fd, have, size)
            finally:
                os.close(fd)
            os.replace(tmp, spares / name)
            mine.pop(0)
    except OSError as exc:
        log.warning("could not reserve node memory in %s for a suspend save (%s): it will be slower", spares,
                    exc.strerror or exc)
    finally:
        for left in mine:
            left.unlink(missing_ok=True)


def _zero(fd: int, start: int, end: int) -> None:
    """Write zeros over [start, end): tmpfs hands out fallocated pages unwritten and clears
    each on its first touch, which makes mapping a spare much slower than one written once."""
    zeros = bytes(min(64 << 20, max(end - start, 0)))
    while start < end:
        start += os.pwrite(fd, memoryview(zeros)[:end - start], start)


def take_spare(spares: Path, name: str, dest: Path) -> bool:
    """Move spares/<name> to `dest` (a new name on the same file system). False when it is
    not there: the caller writes a new file."""
    try:
        os.rename(spares / name, dest)
        return True
    except OSError:
        return False


def spare_names(spares: Path, prefix: str) -> list[tuple[int, str]]:
    """(size, name) of the spares whose name starts with `prefix`, largest first."""
    found = []
    for path in spares.glob(f"{prefix}*"):
        try:
            found.append((path.stat().st_size, path.name))
        except OSError:
            continue
    return sorted(found, reverse=True)


def peer_dir_name(step: int, node_index: int) -> str:
    """Where a node keeps the peer copy of node `node_index`'s part (sharded.py)."""
    return f"{PEER_PREFIX}{step:012d}-{node_index}"


def forget_parts(parts: CheckpointStore, older_than: int) -> None:
    """Remove this node's parts and peer copies older than a step that is loaded or
    committed; their durable copies are done or no longer needed."""
    for path in parts.root.glob("*"):
        step = _part_step(path.name)
        if step is not None and step < older_than:
            shutil.rmtree(path, ignore_errors=True)


def file_request(part_dir: Path, part: PartInfo, spool: Path | None = None) -> Path:
    """Hand a committed part to this node's persist agent."""
    spool = spool or spool_dir()
    name = f"{os.getuid()}-{part.step:012d}-{part.token}-{part.node_index}.json"
    tmp = spool / f".{name}.{secrets.token_hex(4)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, json.dumps({"part": str(part_dir)}).encode())
        finally:
            os.close(fd)
        os.rename(tmp, spool / name)
    except OSError as exc:
        raise describe_os_error(exc, f"handing step {part.step} to the persist agent in {spool}") from exc
    return spool / name


def pending_path(durable: CheckpointStore, step: int) -> Path:
    return durable.root / f"{PENDING_PREFIX}{step:012d}.json"


def mark_pending(durable: CheckpointStore, step: int, nodes: list[str]) -> None:
    """Rank 0, once every node's part is committed: step N is on its way to the durable tier."""
    path = pending_path(durable, step)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    try:
        tmp.write_text(json.dumps({"step": step, "nodes": nodes, "created_unix": time.time()}))
        os.replace(tmp, path)
    except OSError as exc:  # only a hint for a restart on other nodes: the save itself is done
        tmp.unlink(missing_ok=True)
        log.warning("could not mark step %d pending in %s (%s): a restart on other nodes will not wait for it",
                    step, durable.root, exc.strerror or exc)


def pending_steps(durable: CheckpointStore) -> list[int]:
    out = []
    for path in durable.root.glob(f"{PENDING_PREFIX}*.json"):
        try:
            out.append(int(path.name[len(PENDING_PREFIX):-len(".json")]))
        except ValueError:
            continue
    return sorted(out, reverse=True)


def wait_for_pending(durable: CheckpointStore, timeout: float = PENDING_WAIT_S) -> None:
    """Before loading from the durable tier: if a suspend checkpoint newer than its newest
    one is still being persisted by the agents, wait for it (up to `timeout`). Markers of
    steps already committed, or older, are removed."""
    deadline = time.monotonic() + timeout
    while True:
        committed = max(durable.steps(), default=-1)
        pending = pending_steps(durable)
        waiting = [s for s in pending if s > committed]
        for step in pending:
            if step <= committed:
                pending_path(durable, step).unlink(missing_ok=True)
        if not waiting:
            return
        if time.monotonic() >= deadline:
            log.warning("step %d was saved to node memory but has not reached %s after %.0f s (a node lost, or "
                        "no persist agent running?): loading the newest durable checkpoint instead",
                        waiting[0], durable.root, timeout)
            for step in waiting:  # given up: the next restart must not wait for it again
                pending_path(durable, step).unlink(missing_ok=True)
            return
        time.sleep(0.2)


# --- the agent's side: runs as the job's user ------------------------------------------


def _copy_checked(source: Path, dest: Path, entry: FileEntry, name: str) -> None:
    """Copy one file of a part to `dest`, a new name in the copier's own directory (written
    and fsynced with write_hashed_file), refusing it unless its checksum is the manifest's."""
    dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(open_regular(source), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != entry.size:
            raise CorruptCheckpointError(str(source.parent), [Problem(name, f"size {size}, manifest says {entry.size}")])
        if size == 0:
            written = write_hashed_file(dest, b"", hasher=hasher_like(entry))
        else:
            mapped = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
            try:
                written = write_hashed_file(dest, memoryview(mapped), hasher=hasher_like(entry))
            finally:
                # A failed write's traceback may still hold a view of it (a full disk): then the
                # mapping goes when that is collected, and the write's error is what is reported.
                with contextlib.suppress(BufferError):
                    mapped.close()
    if why := mismatch(entry, written):
        dest.unlink(missing_ok=True)
        raise CorruptCheckpointError(str(source.parent), [Problem(name, f"checksum mismatch in node memory ({why})")])


def _copy_share(part_dir: Path, part: PartInfo, staging: Path) -> None:
    """Copy the files a node owns into the shared staging dir. Two agents may copy the same
    share at once (the node's own and the one holding its peer copy): each writes into a
    directory of its own first and renames every file into place, so that a name in the
    staging dir is always a whole, fsynced, verified file."""
    mine = staging.with_name(f"{staging.name}.tmp-{part.node_index}-{os.getpid()}-{secrets.token_hex(2)}")
    try:
        mine.mkdir(mode=0o700)
        for name in part.owned:
            entry = part.manifest.files.get(name)
            if entry is None:
                raise CorruptCheckpointError(str(part_dir), [Problem(name, "not in the checkpoint's manifest")])
            _copy_checked(part_dir / name, mine / name, entry, name)
            (staging / name).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.rename(mine / name, staging / name)
        # A rename between two directories is durable once both are fsynced (POSIX does not
        # say which one holds it): without mine's, a power loss could leave a file out of
        # the staging dir, and so out of the step that commits it.
        for sub in [p for top in (mine, staging) for p in top.rglob("*") if p.is_dir()] + [mine, staging]:
            fsync_dir(sub)
    finally:
        shutil.rmtree(mine, ignore_errors=True)


def _peer_grace_s() -> float:
    """How long the agent holding a peer copy gives the share's own agent to start, and to
    show progress, before it copies the share itself ($HAI_PEER_GRACE_S, for tests)."""
    return float(os.environ.get("HAI_PEER_GRACE_S", "10"))


@contextlib.contextmanager
def _copying(staging: Path, node_index: int, peer: bool) -> Any:
    """While the share's own agent copies it, .part-<k>.copying exists and is touched every
    second: the agent holding the peer copy waits while it is fresh (one copy of each share,
    not two), and takes over when it goes stale (the node was lost mid-copy)."""
    claim = staging / f".part-{node_index}.copying"
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(1.0):
            with contextlib.suppress(OSError):
                os.utime(claim)

    if peer:
        yield
        return
    claim.touch(mode=0o600)
    beating = threading.Thread(target=heartbeat, daemon=True)
    beating.start()
    try:
        yield
    finally:
        stop.set()
        beating.join()


def _owner_copies(staging: Path, node_index: int) -> bool:
    """For the agent holding a peer copy: wait while the share's own agent copies it (its
    claim fresh, or not there yet within the grace). True once that agent marked the share
    done; False when it never started or went silent (lost): then copy it from here."""
    done, claim = staging / f".part-{node_index}.done", staging / f".part-{node_index}.copying"
    grace, started = _peer_grace_s(), time.time()
    while True:
        if done.exists():
            return True
        try:
            fresh = time.time() - claim.stat().st_mtime < grace
        except FileNotFoundError:
            fresh = time.time() - started < grace
        if not fresh:
            return False
        time.sleep(0.2)


def persist_part(part_dir: Path) -> str:
    """Copy one node's part to the durable tier; commit the checkpoint if every node's part
    is there. Returns what happened: 'committed', 'copied' (waiting for other nodes) or
    'already' (the step was committed before)."""
    part = read_part(part_dir)
    durable = CheckpointStore(part.durable, lock_timeout=300.0, stale_staging_age_s=6 * 3600.0)
    step = part.step
    if durable.step_path(step).exists():
        return "already"
    staging = durable.root / f"{PERSIST_PREFIX}{step:012d}-{part.token}"
    done = staging / f".part-{part.node_index}.done"
    try:
        staging.mkdir(mode=0o700, exist_ok=True)
        if staging.is_symlink() or staging.stat().st_uid != os.geteuid():
            raise CheckpointError(f"{staging} is not this user's directory")
        peer = part_dir.name.startswith(PEER_PREFIX)
        if peer and _owner_copies(staging, part.node_index):
            pass  # the share's own node copied it: the peer copy was not needed
        elif not done.exists():  # else the node's share is there already (its own agent, or its peer's)
            with _copying(staging, part.node_index, peer):
                _copy_share(part_dir, part, staging)
            fd = os.open(done, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            os.fsync(fd)
            os.close(fd)
            fsync_dir(staging)
        with durable.locked():
            if durable.step_path(step).exists():  # another save of the same step (a second suspend) won
                shutil.rmtree(staging, ignore_errors=True)
                return "already"
            markers = [f".part-{k}.done" for k in range(part.nodes)]
            if not all((staging / m).exists() for m in markers):
                return "copied"
            (staging / MANIFEST_NAME).unlink(missing_ok=True)  # an agent killed while committing
            for claim in staging.glob(".part-*.copying"):  # not part of the checkpoint
                claim.unlink(missing_ok=True)
            target = durable.commit(staging, part.manifest)
            if target is None:
                return "already"
        for marker in markers:  # not part of the checkpoint (the manifest does not list them)
            (target / marker).unlink(missing_ok=True)
        pending_path(durable, step).unlink(missing_ok=True)
        return "committed"
    except OSError as exc:
        raise describe_os_error(exc, f"persisting step {step} from {part_dir} to {durable.root}") from exc
