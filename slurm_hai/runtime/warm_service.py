"""The warm-start service (`hai-admin warm-start`, one per node, as root): it imports the
modules it preloads once, then forks each job process a client (slurm_hai.runtime.warm, whose
docstring says what a child takes over and when a start is made cold) asks for.

One thread, one loop: the listening socket, each child's ready pipe, each client's connection
and each child's pidfd. While no client waits, one child is forked ahead (`_fork_spare`): it
waits on a socket pair of its own. A request is read whole (with its three descriptors),
checked (`refusal`), and handed to that child with the client's connection (or, where there
is none, a child is forked for it); the child becomes the client's process (`become`) and says
so before any of the job's code runs, or says why it could not, which the client is told as
a refusal; then a preloaded module's `started(argv)` hook, if it has one, and the command.
The loop takes other requests meanwhile (a burst of users' commands is not queued behind
each child's start). The child tells its client its pid, and its exit status
when its command is done; when a child ends, its client is sent the wait status (again).

A child whose command a preloaded module's `reusable(argv)` hook says may be followed by
another (cli/preload.py: `hai` and `hai-submit`), and that left nothing behind (no thread, no
process, no descriptor, no exit hook, limits as it took them), releases its client's streams,
tells the service it is idle, tells its client the exit status and waits: the next request of
the same user and group with the same command module, directory, umask and environment is
handed to it (`_again`) instead of a new fork, and it checks that its client's limits, groups
and control groups are the ones it took before it renews the rest (`become`). A burst of one
user's commands then pays one fork, not one each (docs/benchmarks.md, issue 32). An idle
child is ended after IDLE_FOR_S (`--keep-idle`), the oldest beyond MOST_IDLE, and each after
COMMANDS_PER_CHILD commands.

When a client's connection closes while its child runs on (Slurm killed the step), the child
is killed, with its process group and every process below it. A service that stops leaves its
children running (they are the jobs' processes); their clients hear each child's status from
the child, and end with exit 1 and a line where the child died of a signal.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import logging
import os
import resource  # a child's, imported here: loading it in each child cost it 1 ms of its start
import selectors
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, NoReturn

from .proctree import descendants
from .warm import START_ONLY, Refused, peer_of, receive_request, reply, same_python, send_request

log = logging.getLogger("slurm_hai.warm")
# How long a child may take to become the client's process before the service refuses.
BECOME_WITHIN_S = 10.0
# A child forked ahead that died before it was given a request is forked again this much later.
SPARE_AGAIN_AFTER_S = 1.0
CODE_CHECK_EVERY_S = 1.0
# A child that told its client its exit status ends at once; its client, gone meanwhile, is
# not a reason to kill it (and its process group) unless it is still there after this long.
EXIT_AFTER_STATUS_S = 0.05
# A child idle after its command (module docstring) is ended after this long without a
# request for it (by default: `hai-admin warm-start --keep-idle`), the oldest beyond MOST_IDLE
# at once, and each after COMMANDS_PER_CHILD.
IDLE_FOR_S = 20.0
MOST_IDLE = 32
COMMANDS_PER_CHILD = 500


def refusal(request: dict, peer_pid: int, python: str = sys.executable) -> str | None:
    """Why the service cannot start `request` warm (None: it can)."""
    if not same_python(request.get("python"), python):
        return f"the command's Python is {request.get('python')!r}, the service's {python!r}"
    env = request.get("env")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        return "no environment"
    for name in START_ONLY:
        if env.get(name) != os.environ.get(name):
            return f"{name} differs from the service's (fixed at a process's start)"
    argv = request.get("argv")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv) or not argv or argv == ["-m"]:
        return "no command"
    if not isinstance(request.get("cwd"), str) or not isinstance(request.get("umask"), int):
        return "no working directory or umask"
    ignored = request.get("ignored", [])
    if not isinstance(ignored, list) or not all(isinstance(n, int) and 0 < n < signal.NSIG for n in ignored):
        return "the signals it ignores are not signal numbers"
    for ns in ("mnt", "net", "pid", "user", "ipc", "uts"):
        try:
            if os.stat(f"/proc/{peer_pid}/ns/{ns}").st_ino != os.stat(f"/proc/self/ns/{ns}").st_ino:
                return f"the step runs in another {ns} namespace than the service"
        except FileNotFoundError:
            continue
    return None


def reuse_key(request: dict, peer: tuple[int, int, int]) -> tuple | None:
    """What a child that ran one command must share with the next request to run it: the
    client's uid and gid (the kernel's word), its supplementary groups, resource limits,
    control groups and nice value (/proc's), the command's module or script, its working
    directory, umask and whole environment (what a command's module-level state may have been
    computed from). None where the client is gone. (Raw reads: 40 us of the service's loop.)"""
    try:
        status, limits, cgroups = (_read(f"/proc/{peer[0]}/{name}") for name in ("status", "limits", "cgroup"))
        nice = os.getpriority(os.PRIO_PROCESS, peer[0])
    except OSError:
        return None
    groups = status[status.find(b"\nGroups:"):].split(b"\n", 2)[1]
    argv = request["argv"]
    return (peer[1], peer[2], groups, limits, cgroups, nice, tuple(argv[:2] if argv[0] == "-m" else argv[:1]),
            request["cwd"], request["umask"], frozenset(request["env"].items()))


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 1 << 16)
    finally:
        os.close(fd)


def loaded_code() -> dict[str, tuple[int, int]]:
    """(mtime, size) of the file of every module this process has loaded: what a warm child
    runs without reading it again (1,178 files with torch and torchft, stat'd in 4 ms)."""
    files = {getattr(m, "__file__", None) for m in list(sys.modules.values())}
    code = {}
    for f in files:
        if isinstance(f, str) and os.path.isabs(f):
            try:
                st = os.stat(f)
            except OSError:
                continue
            code[f] = (st.st_mtime_ns, st.st_size)
    return code


def changed(code: dict[str, tuple[int, int]]) -> str | None:
    """A file of `code` that changed on disk since (None: none did)."""
    for f, (mtime, size) in code.items():
        try:
            st = os.stat(f)
        except OSError:
            return f
        if (st.st_mtime_ns, st.st_size) != (mtime, size):
            return f
    return None


def _proc_status(pid: int) -> dict[str, list[str]]:
    """/proc/PID/status, each field's words."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.split()
    return fields


# /proc/PID/limits' names of the resource limits (prlimit(2) of another user's process needs
# CAP_SYS_PTRACE, which root in a container may lack; the file is readable by all).
LIMIT_NAMES = {"Max cpu time": "RLIMIT_CPU", "Max file size": "RLIMIT_FSIZE", "Max data size": "RLIMIT_DATA",
               "Max stack size": "RLIMIT_STACK", "Max core file size": "RLIMIT_CORE", "Max resident set": "RLIMIT_RSS",
               "Max processes": "RLIMIT_NPROC", "Max open files": "RLIMIT_NOFILE",
               "Max locked memory": "RLIMIT_MEMLOCK", "Max address space": "RLIMIT_AS",
               "Max file locks": "RLIMIT_LOCKS", "Max pending signals": "RLIMIT_SIGPENDING",
               "Max msgqueue size": "RLIMIT_MSGQUEUE", "Max nice priority": "RLIMIT_NICE",
               "Max realtime priority": "RLIMIT_RTPRIO", "Max realtime timeout": "RLIMIT_RTTIME"}


def _limits(pid: int) -> dict[int, tuple[int, int]]:
    """Process `pid`'s resource limits, {RLIMIT_*: (soft, hard)}."""
    out = {}
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines()[1:]:
        name = LIMIT_NAMES.get(line[:25].rstrip())  # fs/proc/base.c: "%-25s %-20s %-20s %-10s"
        if name is None or not hasattr(resource, name):
            continue
        soft, hard = line[25:].split()[:2]
        out[getattr(resource, name)] = (resource.RLIM_INFINITY if soft == "unlimited" else int(soft),
                                        resource.RLIM_INFINITY if hard == "unlimited" else int(hard))
    return out


def _signal_set(status: dict[str, list[str]], field: str) -> set[int]:
    """The signals of a /proc/PID/status mask (SigIgn, SigBlk)."""
    bits = int(status[field][0], 16) if status.get(field) else 0
    return {n for n in range(1, signal.NSIG) if bits & (1 << (n - 1))}


def _join_cgroups(theirs: str) -> None:
    """Move this process into every control group of `theirs` (a client's /proc/PID/cgroup) it
    is not in already (v2: its one path; v1: each hierarchy's, under /sys/fs/cgroup/<controllers>).
    A move costs the kernel a wait for its RCU readers (1-2 ms a hierarchy on this VM's nine v1
    hierarchies, 15 ms in all); a hierarchy where the service's group is the client's is left
    as it is."""
    own = Path("/proc/self/cgroup").read_text()
    if own == theirs:
        return
    mine = set(own.splitlines())
    for line in theirs.splitlines():
        if line in mine:
            continue
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:
            base = Path("/sys/fs/cgroup")
        else:
            name = controllers.replace("name=", "") if controllers else ""
            base = Path("/sys/fs/cgroup") / name
            if not name or not base.is_dir():
                continue
        procs = base / path.lstrip("/") / "cgroup.procs"
        if procs.parent.is_dir():
            procs.write_text("0")


class Identity(NamedTuple):
    """What a child takes of its first client once, as root, and what each later client of
    the child must have too: the ids, the supplementary groups, the resource limits, the
    control groups and the nice value (the kernel's word, from /proc; a process that is no
    longer root cannot lower its nice value again)."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    limits: tuple[tuple[int, tuple[int, int]], ...]
    cgroups: str
    nice: int


def become(request: dict, fds: list[int], peer: tuple[int, int, int], taken: Identity | None = None) -> Identity:
    """In the forked child, as root: become the client's process (module docstring); what it
    took. A child that ran a command already (`taken`: what it took then) takes the next
    request of a client of the same identity: it renews the rest (directory, umask,
    environment, streams, signals). Raises on anything it cannot take over; the service then
    refuses, and the client starts cold."""
    pid, uid, gid = peer
    cgroups = Path(f"/proc/{pid}/cgroup").read_text()
    limits = _limits(pid)
    nice = os.getpriority(os.PRIO_PROCESS, pid)
    status = _proc_status(pid)
    uids, gids = [int(x) for x in status["Uid"]], [int(x) for x in status["Gid"]]
    groups = [int(x) for x in status.get("Groups", [])]
    if uids[0] != uid or gids[0] != gid:  # the pid was reused: not the process that connected
        raise Refused("the client's process is gone")
    identity = Identity(uid, gid, tuple(groups), tuple(sorted(limits.items())), cgroups, nice)
    if taken is None:
        # A session and process group of its own, as a launcher's cold start has: the client
        # relays its signals to the group (the command and the processes it started), and the
        # service ends the group and everything below it when the client goes.
        os.setsid()
        _join_cgroups(cgroups)
        for res, lim in limits.items():
            if resource.getrlimit(res) != lim:
                resource.setrlimit(res, lim)
        # the client's nice value (`nice hai-submit ...`, a niced job step), not the service's
        if os.getpriority(os.PRIO_PROCESS, 0) != nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
        os.setgroups(groups)
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    elif identity != taken:
        raise Refused("the client's groups, limits, control groups or nice value are not those of the child that "
                      "would run it")
    # the CPUs it may run on (Slurm's task/affinity binds a task's with sched_setaffinity, which
    # no control group carries; `taskset`), any subset of its cpuset: its own to set, each time
    cpus = os.sched_getaffinity(pid)
    if os.sched_getaffinity(0) != cpus:
        os.sched_setaffinity(0, cpus)
    # ignored: as /proc says, and those the client ignored before it caught them to relay them
    ignored = _signal_set(status, "SigIgn") | set(request.get("ignored", ()))
    blocked = _signal_set(status, "SigBlk")
    os.umask(request["umask"])
    os.chdir(request["cwd"])
    # the client's environment, each variable changed only where it differs (every change
    # writes to pages the child shares with the service: copied, at a fault each)
    env = request["env"]
    for key in [k for k in os.environ if k not in env]:
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for n in range(1, signal.NSIG):
        if n in (signal.SIGKILL, signal.SIGSTOP):
            continue
        default = (signal.default_int_handler if n == signal.SIGINT else
                   signal.SIG_IGN if n in (signal.SIGPIPE, signal.SIGXFSZ) else signal.SIG_DFL)
        wanted = signal.SIG_IGN if n in ignored else default
        try:
            if signal.getsignal(n) != wanted:
                signal.signal(n, wanted)
        except (OSError, ValueError):
            continue
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    logging.root.handlers.clear()  # the service's logging is not the job's: a fresh root logger
    logging.root.setLevel(logging.WARNING)
    # random reseeds itself in a forked child (its os.register_at_fork); numpy does not
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        threads = os.environ.get("OMP_NUM_THREADS", "")
        sys.modules["torch"].set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0
                                             else len(os.sched_getaffinity(0)))
    return identity


def run_as_main(argv: list[str], base_path: list[str]) -> int:
    """Run argv (a script's path, or -m MODULE, then its arguments) as __main__, as the
    interpreter would, and flush its streams: the exit code (-SIGINT: a KeyboardInterrupt).
    `end_as_interpreter` then does what the interpreter does at its exit."""
    import io
    import runpy
    import traceback

    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.open(0, "rb", closefd=False), errors="strict")
    sys.stdout = io.TextIOWrapper(io.open(1, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                  line_buffering=os.isatty(1), write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.open(2, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                  line_buffering=True, errors="backslashreplace", write_through=unbuffered)
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    module = argv[0] == "-m"
    sys.argv = argv[1:] if module else list(argv)
    sys.path[:] = [os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0])), *extra, *base_path]
    code: int = 0
    try:
        if module:
            sys.argv[0] = argv[1]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - as the interpreter: the traceback, exit 1
        traceback.print_exc()
        code = 1
    _flush()
    return code


def end_as_interpreter(code: int) -> int:
    """What the interpreter does at its exit, after run_as_main's `code`: join the non-daemon
    threads, run the exit hooks, flush; die of SIGINT after a KeyboardInterrupt. The exit
    status."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    _flush()
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code & 0xFF


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


class Service:
    """The loop; `serve()` runs it until SIGTERM or SIGINT."""

    def __init__(self, path: str, preload: list[str], keep_idle: float = IDLE_FOR_S) -> None:
        # A standard stream the service was started without is /dev/null, before it opens
        # anything: its selector, a connection or a descriptor it receives must not take 0-2,
        # which a child closes or makes its client's.
        for fd in (0, 1, 2):
            if not _is_open(fd):
                os.open(os.devnull, os.O_RDWR)  # the lowest free number: fd
        self.path, self.preload, self.keep_idle = path, preload, keep_idle
        self.children: dict[int, _Child] = {}  # pidfd -> a child that took its client's identity
        self.starting: dict[int, _Start] = {}  # a child's ready pipe -> its start, until it says
        self.orphans: dict[int, float] = {}  # pidfd -> when its child is killed, its client gone (monotonic)
        self.idle: list[_Child] = []  # children that wait for their user's next command, the oldest first
        self.sel = selectors.DefaultSelector()
        self.base_path = list(sys.path[1:])  # the interpreter's own path, without the service's script dir
        self.code: dict[str, tuple[int, int]] = {}  # the files of what it loaded, as they were then
        self.code_checked = float("-inf")  # when they were last compared with the disk (monotonic)
        self.stale: str | None = None  # a file of them that changed since
        self.spare: _Spare | None = None  # a child forked ahead, waiting for its request
        self.spare_after = 0.0  # when one may be forked (monotonic): later, where the last one died

    def listen(self) -> socket.socket:
        """Bind the socket, then preload: a step that asks meanwhile waits in the backlog for
        the imports it would otherwise make itself, beside the service's."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o111)  # every user may connect: the service takes each one's own ids
        try:
            server.bind(self.path)
        finally:
            os.umask(old)
        server.listen(64)
        try:
            for name in self.preload:
                t0 = time.monotonic()
                importlib.import_module(name)
                log.info("preloaded %s in %.2f s", name, time.monotonic() - t0)
        except BaseException:
            server.close()
            os.unlink(self.path)
            raise
        self.code = loaded_code()
        # what was preloaded stays out of every later collection, in the service and in its
        # children: a child's collections then touch none of it (no copy of its pages)
        gc.freeze()
        return server

    def serve(self, server: socket.socket) -> None:
        stop: list[int] = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda s, _f: stop.append(s))
        self.sel.register(server, selectors.EVENT_READ, "accept")
        log.info("warm-start service on %s (pid %d)", self.path, os.getpid())
        try:
            while not stop:
                self._round(server, self.sel.select(timeout=self._next_timeout()))
                self._overdue()
                self._kill_orphans()
                self._retire_idle()
                self._fork_spare()
        finally:  # the children are the jobs': they run on, and tell their clients how they ended
            if self.spare is not None:
                self._drop_spare()
            for child in self.children.values():
                for sock in (child.conn, child.chan):  # an idle child ends at its socket's end
                    if sock is not None:
                        sock.close()
            for ready in list(self.starting):
                self._started(ready, b"")
            server.close()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def _round(self, server: socket.socket, events: list[tuple[selectors.SelectorKey, int]]) -> None:
        """Handle one round of the loop's events: a child's word that it started before its word
        that it is idle again (a quick command says both before the loop looks), and requests
        last (a child that said it is idle, before it told its client the status, is idle for
        that client's next). An event of a file the round let go of already (a child that
        failed to start is forgotten with its pidfd and socket pair) is passed by."""
        for key, _ in sorted(events, key=_in_turn):
            if self.sel.get_map().get(key.fd) is not key:
                continue
            try:
                if key.data == "accept":
                    self._accept(server)
                elif key.data[0] == "ready":
                    self._started(key.fd, os.read(key.fd, 4096))
                elif key.data[0] == "child":
                    self._child_ended(key.fd)
                elif key.data[0] == "idle":
                    self._idle(key.data[1])
                elif key.data[0] == "spare":
                    self._spare_died()
                else:
                    self._client_gone(key.data[1], key.fileobj)
            except Exception:  # noqa: BLE001 - one start's fault is not every later start's
                log.exception("while handling %s", key.data)

    def _accept(self, server: socket.socket) -> None:
        """Read a request, check it and start its child: an idle child of the same user and
        key, the child forked ahead, or a child forked for it. The client hears of it once the
        child says it became the client's process (`_started`), meanwhile the loop goes on."""
        conn, _ = server.accept()
        conn.settimeout(1.0)  # a client sends its request at once: one that does not holds up the others
        peer = peer_of(conn)
        try:
            request, fds = receive_request(conn)
        except (Refused, OSError, ValueError) as e:
            log.warning("pid %d: %s", peer[0], e)
            conn.close()
            return
        try:
            why = refusal(request, peer[0]) or self._stale()
            if not why:
                key = reuse_key(request, peer)
                start = (self._again(key, request, fds, peer, conn) or self._hand(request, fds, peer, conn)
                         or self._fork(request, fds, peer, conn))
                self.starting[start.ready] = start._replace(key=key, deadline=time.monotonic() + BECOME_WITHIN_S,
                                                            job=_job_of(request))
                self.sel.register(start.ready, selectors.EVENT_READ, ("ready", start.ready))
                return
        finally:
            for fd in fds:
                os.close(fd)
        self._refuse(conn, peer, why)

    def _refuse(self, conn: socket.socket, peer: tuple[int, int, int], why: str) -> None:
        log.info("uid %d pid %d: refused: %s", peer[1], peer[0], why)
        try:
            reply(conn, {"refused": why})
        except OSError:
            pass
        conn.close()

    def _started(self, ready: int, answer: bytes) -> None:
        """The child's word on `ready` (b"ok": it is the client's process, and tells the client
        so itself; else why not, or nothing when it died or took BECOME_WITHIN_S: the client
        is refused)."""
        start = self.starting.pop(ready)
        self.sel.unregister(ready)
        os.close(ready)
        pid, conn, peer, child = start.pid, start.conn, start.peer, start.child
        if answer != b"ok":
            if child is None or self.children.get(child.pidfd) is child:  # not reaped already (_child_ended)
                if child is None:
                    start.chan.close()
                else:
                    self._forget(child)
                _kill(pid)
                os.waitpid(pid, 0)
            self._refuse(conn, peer, answer.decode(errors="replace").removeprefix("error: ")
                         or "the child did not start")
            return
        conn.settimeout(None)
        if child is None:
            pidfd = os.pidfd_open(pid)
            child = self.children[pidfd] = _Child(pid, pidfd, start.chan, start.key)
            self.sel.register(pidfd, selectors.EVENT_READ, ("child", pidfd))
            self.sel.register(start.chan, selectors.EVENT_READ, ("idle", pidfd))
        child.conn = conn
        child.commands += 1
        self.sel.register(conn, selectors.EVENT_READ, ("client", child.pidfd))
        log.info("uid %d pid %d: started %s as pid %d (its command %d)%s", peer[1], peer[0], start.argv, pid,
                 child.commands, f", job {start.job}" if start.job else "")

    def _overdue(self) -> None:
        """Refuse the starts whose child has not said within BECOME_WITHIN_S."""
        now = time.monotonic()
        for ready in [r for r, start in self.starting.items() if start.deadline <= now]:
            self._started(ready, b"")

    def _stale(self) -> str | None:
        """Why the service's loaded code is not what is installed now (None: it is). A child
        would run the modules the service loaded, not the files an upgrade put there since:
        every start is cold until the service is started again. The files are looked at once
        a second at most (0.7 ms of each warm command's start with the commands preloaded)."""
        now = time.monotonic()
        if self.stale is None and now - self.code_checked < CODE_CHECK_EVERY_S:
            return None
        self.code_checked = now
        f = self.stale = changed(self.code)
        return f"the service's code changed on disk since it started ({f}): restart hai-admin warm-start" if f \
            else None

    def _fork(self, request: dict, fds: list[int], peer: tuple[int, int, int], conn: socket.socket) -> _Start:
        """Fork the child, with the pipe on which it says it became the client's process and
        the socket pair on which it may later say it is idle and take its next request."""
        ours, theirs = socket.socketpair()
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the service's loop
            os.close(ready_r)
            ours.close()
            self.sel.close()
            self._child(request, fds, peer, conn, ready_w, theirs)
        os.close(ready_w)
        theirs.close()
        ours.settimeout(1.0)  # a later request is taken at once: a child that does not is passed by
        return _Start(pid, ready_r, ours, conn, peer, request["argv"][:2])

    def _fork_spare(self) -> None:
        """Fork a child ahead of the next request, where there is none: the fork, the child's
        own start and the pages it touches first are then paid before a client asks, not while
        it waits (`_hand`). The child closes every descriptor it took from the service but its
        end of a socket pair, and waits there for its request."""
        if self.spare is not None or self.stale or time.monotonic() < self.spare_after:
            return
        try:  # out of descriptors, processes or memory: the requests are forked as they come
            ours, theirs = socket.socketpair()
            try:
                pid = os.fork()
            except OSError:
                ours.close()
                theirs.close()
                raise
        except OSError as e:
            log.warning("no child forked ahead: %s", e)
            self.spare_after = time.monotonic() + SPARE_AGAIN_AFTER_S
            return
        if pid == 0:  # the spare: never returns into the service's loop
            try:
                self.sel.close()
                _close_all_but(theirs.fileno())
                _touch_ahead()
                request, peer, conn, ready_w, fds = _next_request(theirs)
            except BaseException:  # noqa: BLE001 - the service gone, or no request: nothing to tell
                os._exit(1)
            self._child(request, fds, peer, conn, ready_w, theirs)
        theirs.close()
        ours.settimeout(1.0)  # a request is handed over at once: a spare that does not take it is passed by
        self.spare = _Spare(pid, ours)
        self.sel.register(ours, selectors.EVENT_READ, ("spare",))

    def _hand(self, request: dict, fds: list[int], peer: tuple[int, int, int], conn: socket.socket
              ) -> _Start | None:
        """Give the request to the child forked ahead; None where there is none, or it is gone."""
        spare = self.spare
        if spare is None:
            return None
        ready = _give(spare.sock, request, fds, peer, conn)
        if ready is None:
            self._drop_spare()
            return None
        self.spare = None
        self.sel.unregister(spare.sock)
        return _Start(spare.pid, ready, spare.sock, conn, peer, request["argv"][:2])

    def _again(self, key: tuple | None, request: dict, fds: list[int], peer: tuple[int, int, int], conn: socket.socket
               ) -> _Start | None:
        """Give the request to an idle child of the same `key` (the latest idle first); None
        where there is none. The child checks that the client's identity is the one it took."""
        child = next((c for c in reversed(self.idle) if c.key == key), None) if key is not None else None
        if child is None:
            return None
        assert child.chan is not None  # an idle child has its socket pair (_retire takes both)
        self.idle.remove(child)
        ready = _give(child.chan, request, fds, peer, conn)
        if ready is None:
            self._retire(child)
            return None
        return _Start(child.pid, ready, child.chan, conn, peer, request["argv"][:2], child=child)

    def _idle(self, pidfd: int) -> None:
        """A child's socket pair is readable: the child ran its command and waits for its
        user's next (its client's connection is closed here, and it joins `idle`), or it ends
        (nothing to read: its pidfd says when it has)."""
        child = self.children[pidfd]
        assert child.chan is not None
        try:
            said = child.chan.recv(64)
        except OSError:
            said = b""
        if not said:
            self._retire(child)
            return
        if child.conn is None:
            return  # said more than once: nothing more
        self._unwatch(child.conn)
        child.conn.close()
        child.conn = None
        self.orphans.pop(pidfd, None)
        if self.stale or child.commands >= COMMANDS_PER_CHILD or self.keep_idle <= 0:
            self._retire(child)
            return
        child.idle_since = time.monotonic()
        self.idle.append(child)
        while len(self.idle) > MOST_IDLE:
            self._retire(self.idle.pop(0))

    def _retire_idle(self) -> None:
        """End the idle children no request took within `keep_idle` s (every one, once the
        service's code is stale)."""
        now = time.monotonic()
        while self.idle and (self.stale or now - self.idle[0].idle_since >= self.keep_idle):
            self._retire(self.idle.pop(0))

    def _retire(self, child: _Child) -> None:
        """End a child that waits for a request, or no longer take one from it: its socket
        pair closed (it exits at its end); its pidfd says when it has ended."""
        if child in self.idle:
            self.idle.remove(child)
        if child.chan is not None:
            self._unwatch(child.chan)
            child.chan.close()
            child.chan = None

    def _forget(self, child: _Child) -> None:
        """Take a child out of the service's books (it is killed and reaped by the caller)."""
        del self.children[child.pidfd]
        self.orphans.pop(child.pidfd, None)
        self._retire(child)
        self._unwatch(child.pidfd)
        if child.conn is not None:
            self._unwatch(child.conn)
            child.conn.close()
        os.close(child.pidfd)

    def _unwatch(self, fileobj: int | socket.socket) -> None:
        """Stop watching `fileobj`, where the loop watches it."""
        try:
            self.sel.unregister(fileobj)
        except (KeyError, ValueError):
            pass

    def _spare_died(self) -> None:
        """The child forked ahead ended before it was given a request (killed, out of memory):
        reaped, and another forked SPARE_AGAIN_AFTER_S later."""
        if self.spare is None:
            return
        pid, status = self._drop_spare()
        log.warning("the child forked ahead (pid %d) ended before its request, wait status %d", pid, status)
        self.spare_after = time.monotonic() + SPARE_AGAIN_AFTER_S

    def _drop_spare(self) -> tuple[int, int]:
        """End the child forked ahead (where it has not ended) and reap it: its pid and wait
        status. It has not setsid(): it is killed alone."""
        assert self.spare is not None
        spare, self.spare = self.spare, None
        self.sel.unregister(spare.sock)
        spare.sock.close()
        os.kill(spare.pid, signal.SIGKILL)
        return os.waitpid(spare.pid, 0)

    def _child(self, request: dict, fds: list[int], peer: tuple[int, int, int], conn: socket.socket,
               ready_w: int, chan: socket.socket) -> NoReturn:
        """In the child: become the client's process, say so on `ready_w`, run the command.
        The child tells the client its pid, and at its end its exit status, itself: before its
        memory is torn down (2 ms of a warm command's 10 with the commands preloaded), the
        client has ended. The service tells the status of a child that ended otherwise (a
        signal), and again of one that told it (a client reads the first). A child whose
        command may be followed by another (`_may_run_again`) says so on `chan` and takes the
        next request the service gives it there (module docstring)."""
        code, said, taken = 1, False, None
        try:
            while True:
                said = False
                taken = become(request, fds, peer, taken)
                _close_all_but(ready_w, conn.fileno(), chan.fileno())  # the service's, other requests'
                os.write(ready_w, b"ok")
                os.close(ready_w)
                said = True
                conn.settimeout(None)
                reply(conn, {"pid": os.getpid()})
                self._started_hooks(request["argv"])
                exit_hooks = atexit._ncallbacks()
                code = run_as_main(request["argv"], self.base_path)
                if not self._may_run_again(request["argv"], code, exit_hooks, taken, conn, chan):
                    break
                _release_streams()
                try:
                    chan.send(b"idle", socket.MSG_NOSIGNAL)
                except OSError:  # the service stopped: this command is the last
                    break
                reply(conn, {"status": (code & 0xFF) << 8})
                conn.close()
                try:
                    request, peer, conn, ready_w, fds = _next_request(chan)
                except (Refused, OSError, ValueError):  # ended by the service
                    os._exit(0)
            code = end_as_interpreter(code)
            reply(conn, {"status": code << 8})  # as waitpid would say it
        except BaseException as e:  # noqa: BLE001 - before it said "ok": told to the service, which refuses
            if not said:
                try:
                    os.write(ready_w, f"error: {type(e).__name__}: {e}".encode()[:4000])
                except OSError:
                    pass
            else:  # after: to the client's stderr (its 2 by now), as a cold start's would be
                import traceback

                traceback.print_exc()
                _flush()
        finally:
            os._exit(code)

    def _may_run_again(self, argv: list[str], code: int, exit_hooks: int, taken: Identity,
                       conn: socket.socket, chan: socket.socket) -> bool:
        """In a child after its command: whether it may run its user's next one. Each preloaded
        module's `reusable(argv)` hook that there is says it may (a command none claims is
        not), and the command left nothing behind: no other thread, no process, no exit hook,
        no descriptor but the client's and the service's, the limits the child took."""
        hooks = [h for h in (getattr(sys.modules.get(name), "reusable", None) for name in self.preload) if callable(h)]
        if code < 0 or not hooks or not all(hook(argv) for hook in hooks):
            return False
        if threading.active_count() != 1 or atexit._ncallbacks() != exit_hooks:
            return False
        try:
            os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            return False  # a process it started is there still (running, or not yet waited for)
        except ChildProcessError:
            pass
        listed = {int(fd) for fd in os.listdir("/proc/self/fd")} - {0, 1, 2, conn.fileno(), chan.fileno()}
        if any(_is_open(fd) for fd in listed):  # (the listing's own is closed by now)
            return False
        return _limits(os.getpid()) == dict(taken.limits)

    def _started_hooks(self, argv: list[str]) -> None:
        """In the child, as the client's process and before its command: each preloaded
        module's `started(argv)`, if it has one (`hai` starts its first queue read there, 2 ms
        ahead of the command's own start: cli/preload.py). A hook's error is the command's to
        meet: it is logged to the client's stderr and the command runs."""
        for name in self.preload:
            hook = getattr(sys.modules.get(name), "started", None)
            if callable(hook):
                try:
                    hook(argv)
                except Exception as e:  # noqa: BLE001 - the command runs all the same
                    print(f"slurm-hai: {name}.started: {type(e).__name__}: {e}", file=sys.stderr)

    def _child_ended(self, pidfd: int) -> None:
        child = self.children[pidfd]
        conn = child.conn
        child.conn = None  # told here, not closed by _forget
        if conn is not None:
            self._unwatch(conn)  # (the loop no longer watches it where its client went first)
        self._forget(child)
        _, status = os.waitpid(child.pid, 0)
        if conn is not None:
            try:
                reply(conn, {"status": status})
            except OSError:
                pass
            conn.close()

    def _client_gone(self, pidfd: int, conn: object) -> None:
        """The client's connection `conn` is readable: it closed (a client sends nothing more).
        A child told its status to its client, which went as the child ended: a child that is
        ending, or ends within EXIT_AFTER_STATUS_S, is left to end (`_kill_orphans`). An event
        of a child handled already in the same round is nothing (its pidfd's number may be
        another child's by now)."""
        child = self.children.get(pidfd)
        if child is None or child.conn is None or child.conn is not conn:
            return
        self.sel.unregister(child.conn)
        if not _exiting(child.pid):
            self.orphans[pidfd] = time.monotonic() + EXIT_AFTER_STATUS_S

    def _kill_orphans(self) -> None:
        """Kill the children whose clients went EXIT_AFTER_STATUS_S ago and that still run,
        with their process groups and every process below them (a child that said it is idle
        meanwhile is not an orphan)."""
        now = time.monotonic()
        for pidfd in [p for p, deadline in self.orphans.items() if deadline <= now]:
            del self.orphans[pidfd]
            if pidfd not in self.children or _exiting(self.children[pidfd].pid):
                continue
            pid = self.children[pidfd].pid
            log.info("pid %d: its client is gone; killed, with its process group and every process below it", pid)
            below = descendants(pid)
            _kill(pid)  # _child_ended follows, and finds the connection closed
            for other in below:
                _kill(other)

    def _next_timeout(self) -> float:
        """How long the loop may wait for its next event: at most 1 s, and no later than the
        next orphan is due."""
        if not self.orphans:
            return 1.0
        return max(0.0, min(1.0, min(self.orphans.values()) - time.monotonic()))


@dataclass(eq=False)
class _Child:
    """A child that took its client's identity: its pid and pidfd, its end of the socket pair
    on which it says it is idle and takes its next request (None once closed), its client's
    connection while it runs a command (None while idle), what a request must share with its
    first to run in it (reuse_key), the commands it started, and since when it is idle."""

    pid: int
    pidfd: int
    chan: socket.socket | None
    key: tuple | None
    conn: socket.socket | None = None
    commands: int = 0
    idle_since: float = 0.0


class _Spare(NamedTuple):
    """A child forked ahead of its request, and the service's end of the socket it waits on."""

    pid: int
    sock: socket.socket


class _Start(NamedTuple):
    """A child given a client's request, until it says it became the client's process: its
    pid, the pipe it says it on, the service's end of its socket pair, the client's
    connection and ids, the command (its first two words, for the log), the request's
    reuse_key, when it is overdue (monotonic), the idle child it is, if it is one, and the
    Slurm job it is of (SLURM_JOB_ID, for the log)."""

    pid: int
    ready: int
    chan: socket.socket
    conn: socket.socket
    peer: tuple[int, int, int]
    argv: list[str]
    key: tuple | None = None
    deadline: float = 0.0
    child: _Child | None = None
    job: str = ""


def _job_of(request: dict) -> str:
    """The Slurm job a request's command is of, as its environment says (a job's step or
    batch script: SLURM_JOB_ID), or ""."""
    job = request["env"].get("SLURM_JOB_ID", "")
    return job if job.isdigit() else ""


def _in_turn(event: tuple[selectors.SelectorKey, int]) -> int:
    """The order the loop handles a round's events in: ready pipes, then the rest, then requests."""
    data = event[0].data
    return 2 if data == "accept" else 0 if data[0] == "ready" else 1


def _give(chan: socket.socket, request: dict, fds: list[int], peer: tuple[int, int, int], conn: socket.socket
          ) -> int | None:
    """Send a request to a child waiting on its socket pair (`_next_request`), with the
    client's connection, the write end of a new ready pipe and the client's streams: the
    pipe's read end, or None where the child is gone."""
    ready_r, ready_w = os.pipe()
    try:
        send_request(chan, {"request": request, "peer": peer}, (conn.fileno(), ready_w, *fds))
    except OSError:
        os.close(ready_r)
        return None
    finally:
        os.close(ready_w)
    return ready_r


def _next_request(chan: socket.socket) -> tuple[dict, tuple[int, int, int], socket.socket, int, list[int]]:
    """In a child waiting on its socket pair: the request `_give` sends, its client's ids,
    connection, the ready pipe's write end and the client's streams."""
    message, fds = receive_request(chan, 5)
    return message["request"], tuple(message["peer"]), socket.socket(fileno=fds[0]), fds[1], fds[2:]


def _release_streams() -> None:
    """In a child that will wait for its next command: /dev/null as its 0-2, so that the
    client's (a pipe's reader waits for every writer) are not held."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _touch_ahead() -> None:
    """In a child forked ahead: read what `become` reads, of this process, so that the pages
    those reads touch are this child's own before a client waits on it."""
    _proc_status(os.getpid())
    _limits(os.getpid())
    Path("/proc/self/cgroup").read_text()


def _kill(pid: int) -> None:
    """SIGKILL to a child and its process group (a child leads one: `become`)."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


PF_EXITING = 0x4  # a task's flag from the start of its exit (linux/sched.h)


def _exiting(pid: int) -> bool:
    """Whether process `pid` has begun to exit (or is a zombie): /proc/PID/stat's flags."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return True
    fields = stat[stat.rindex(b")") + 2:].split()  # after the command's name, which may hold anything
    return fields[0] in (b"Z", b"X") or bool(int(fields[6]) & PF_EXITING)


def _close_all_but(*keep: int) -> None:
    """Close every descriptor from 3 up but `keep`."""
    low = 3
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, _max_fd())


def _max_fd() -> int:
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        return 65536
