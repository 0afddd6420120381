"""Warm starts: a node's service that has imported torch once forks a job's Python process
from itself, so a part that rejoins (or any step that asks) skips Python's start and torch's
import (3-4 s of a part's rejoin on this VM; docs/elastic-in-place.md, "Warm starts").

    hai-admin warm-start [--socket PATH] [--preload slurm_hai.runtime.preload]   # one per node, as root
    python -m slurm_hai.runtime.warm -- PYTHON SCRIPT ARGS...             # in the job's step
    python -m slurm_hai.runtime.warm -- PYTHON -m MODULE ARGS...
    python -m slurm_hai.runtime.warm --if-there -- ...     # cold and silent where no service listens
    python -m slurm_hai.runtime.warm --relay-ignored=USR2,TERM -- ...   # relayed though ignored here
    python -m slurm_hai.runtime.warm --child-only -- ...   # signals to the child, not its process group

The step's process (the client, standard library only) asks the node's service over a Unix
socket, handing it its standard input, output and error, its environment, working directory
and umask. The service (root) forks a child that becomes the job's process as a cold start
would be, before any of the job's code runs:
- it joins the client's control groups (Slurm's step cgroup: its devices, memory and CPUs),
  takes the client's resource limits, nice value, supplementary groups, gid and uid (in that
  order), its CPU affinity (Slurm's task/affinity binding, `taskset`), umask, working
  directory, environment, ignored and blocked signals, and its stdio;
- Python's state that a fresh process would not share is renewed: `random`'s and numpy's
  seeds, sys.argv and sys.path, the standard streams; torch's thread count is what a cold
  process computes (OMP_NUM_THREADS, else the CPUs it may run on);
- then it runs SCRIPT (or MODULE) as __main__, and exits as the interpreter would (atexit,
  non-daemon threads, SystemExit, an uncaught exception's traceback, KeyboardInterrupt).
The client relays every signal it gets to the child and its process group (Slurm signals the
step's processes, the child is not one of them under proctrack/linuxproc; --child-only: to
the child alone, as Slurm signals a batch script but not what it started), ignored ones only
where it is told to (--relay-ignored: the child starts with them ignored all the same), and
exits as the child did: with
its code, or of its signal. A client that dies takes the child with it (the service kills
it when the connection closes).

A start the service cannot make warm is made cold, by the client exec'ing the command as it
stands, with one line on stderr saying why: no service on the node (or one not run by
root), another interpreter than the service's, a dynamic loader's environment other than
the service's (LD_PRELOAD, LD_LIBRARY_PATH: libraries are loaded at a process's start),
PYTHONHASHSEED or PYTHONHOME set (fixed at an interpreter's start), the client in other
namespaces than the service's, a control group that cannot be joined.

The same service on a login node, preloading the commands, runs `hai` and `hai-submit`
(cli/front.py): their entry points ask through `run_if_warm`, which leaves a command it cannot
start warm to its caller, saying nothing.

Modules preloaded by the service were imported with its environment: a job that sets a
variable those modules read at import (TORCH_*, say) sees it only in a cold start; such a
job sets HAI_WARM=0 (the client then starts cold at once).
"""

from __future__ import annotations

import array
import io
import json
import os
import shutil
import signal
import socket
import struct
import sys

SOCKET_ENV = "HAI_WARM_SOCKET"
# Per node: /dev/shm is each node's own (a local cluster's node namespaces too). The client
# checks that the service listening there is root's.
DEFAULT_SOCKET = "/dev/shm/slurm-hai-warm.sock"
OFF_ENV = "HAI_WARM"  # "0": start cold
# Fixed at an interpreter's or a process's start: a job that sets them other than the service
# starts cold.
START_ONLY = ("LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONHASHSEED", "PYTHONHOME")
# The signals a client relays to its child: every one a process may catch that Slurm, srun
# or a user may send to a step.
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
           signal.SIGCONT, signal.SIGALRM, signal.SIGXCPU)
HEADER = struct.Struct("!I")
MAX_REQUEST = 8 << 20


class Refused(Exception):
    """The service cannot start this command warm; the message says why."""


# --- the wire: one request (length-prefixed JSON, the client's fds 0-2 alongside), then
# --- replies of one JSON line each: {"pid": N}, then {"status": WAITSTATUS} (from the child, then
# again from the service once it has reaped it: a client reads the first); or {"refused": WHY}

def send_request(sock: socket.socket, request: dict, fds: tuple[int, ...] = (0, 1, 2)) -> None:
    """The request, with `fds` alongside (the client's 0-2; the service hands a child forked
    ahead the client's connection and those three)."""
    data = HEADER.pack(len(body := json.dumps(request).encode())) + body
    sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    if sent < len(data):
        sock.sendall(data[sent:])


def receive_request(sock: socket.socket, nfds: int = 3) -> tuple[dict, list[int]]:
    """A request and the `nfds` descriptors that came with it (the caller owns them)."""
    fds = array.array("i")
    data, ancdata, _flags, _addr = sock.recvmsg(1 << 16, socket.CMSG_LEN(nfds * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    try:
        if len(data) < HEADER.size or len(fds) != nfds:
            raise Refused(f"a request without its length or its {nfds} descriptors")
        (size,) = HEADER.unpack_from(data)
        if size > MAX_REQUEST:
            raise Refused(f"a request of {size} bytes")
        body = data[HEADER.size:]
        while len(body) < size:
            more = sock.recv(size - len(body))
            if not more:
                raise Refused("the request ended early")
            body += more
        return json.loads(body), list(fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def peer_of(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of `sock`, as the kernel says."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid, gid


def reply(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


# --- the client: in the job's step, standard library only

def command_form(cmd: list[str]) -> tuple[str, list[str]] | None:
    """(python, argv) of `PYTHON SCRIPT ARGS...` or `PYTHON -m MODULE ARGS...` (argv as
    sys.argv gets it: the script's path, or "-m" for a module, then ARGS); None for any other."""
    if len(cmd) >= 2 and not cmd[1].startswith("-"):
        return cmd[0], cmd[1:]
    if len(cmd) >= 3 and cmd[1] == "-m" and not cmd[2].startswith("-"):
        return cmd[0], cmd[1:]
    return None


def through_service(cmd: list[str], socket_path: str | None = None) -> list[str]:
    """`cmd` as a launcher starts it: through this client where the node runs a service (its
    socket is there) and `cmd` runs a script or module with this interpreter (slurm-hai's,
    as the service's is); else as it stands, and nothing is said."""
    path = socket_path or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET
    if (_warm_refusal(cmd) is not None or not os.path.exists(path)
            or not same_python(interpreter_path(cmd[0]), sys.executable)):
        return cmd
    return [sys.executable, "-m", "slurm_hai.runtime.warm", "--", *cmd]


def interpreter_path(name: str) -> str:
    """The interpreter a command names, as PATH finds it, made absolute: what the client asks
    for and the service compares with its own (same_python)."""
    return os.path.abspath(shutil.which(name) or name)


def same_python(asked: object, own: str) -> bool:
    """Whether the interpreter the client names (its path, as PATH found it) is the service's
    own: the same file in the same directory (python and python3 of one virtualenv are; the
    python of another virtualenv, a link to the same binary, is not)."""
    try:
        return (isinstance(asked, str) and os.path.dirname(asked) == os.path.dirname(own)
                and os.path.samefile(asked, own))
    except OSError:
        return False


def run(cmd: list[str], socket_path: str | None = None, if_there: bool = False,
        relay_ignored: frozenset[int] = frozenset(), group: bool = True) -> int:
    """Start `cmd` warm through the node's service and wait for it; cold (exec) when it
    cannot be warm, saying why in one line (`if_there`: not where no service listens on this
    node). `relay_ignored` and `group`: as Relay takes them. Returns the child's exit code,
    or dies of its signal."""
    path = socket_path or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET
    started = start(cmd, path, Relay(relay_ignored, group)) if not if_there or os.path.exists(path) else ""
    if isinstance(started, str):
        if started and os.environ.get(OFF_ENV) != "0":
            print(f"slurm-hai: starting cold: {started}", file=sys.stderr, flush=True)
        try:
            os.execvp(cmd[0], cmd)
        except OSError as e:
            print(f"slurm-hai: cannot start {cmd[0]!r}: {e}", file=sys.stderr, flush=True)
            return 127
    return _supervise(*started)


def run_if_warm(cmd: list[str], socket_path: str | None = None) -> int | None:
    """`run`, but None (and nothing said) where `cmd` cannot start warm: the caller then runs
    it itself (the `hai` commands: cli/front.py)."""
    started = start(cmd, socket_path)
    return None if isinstance(started, str) else _supervise(*started)


def start(cmd: list[str], socket_path: str | None = None, relay: Relay | None = None
          ) -> tuple[io.BufferedReader, int, Relay] | str:
    """Ask the service to start `cmd`: (the reader of its replies, the child's pid, the relay
    of this process's signals: `relay`, made from before the request, so that a signal that
    comes while the child starts waits for it), or why it cannot start warm."""
    why = _warm_refusal(cmd)
    if why is not None:
        if relay is not None:
            relay.stop()
        return why
    sock = None
    relay = relay or Relay()
    try:
        sock = _connect(socket_path or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET)
        python, argv = command_form(cmd)  # type: ignore[misc]  # _warm_refusal checked it
        send_request(sock, {"python": interpreter_path(python), "argv": argv, "env": dict(os.environ),
                            "cwd": os.getcwd(), "umask": _umask(), "ignored": relay.ignored})
        reader = sock.makefile("rb")
        first = _read_reply(reader)
        if "pid" in first:
            return reader, int(first["pid"]), relay
        # a status first: the child ended before it said its pid, so before the command
        why = str(first.get("refused") or "the child ended before it started the command")
    except Refused as e:
        why = str(e)
    except OSError as e:
        why = f"the service did not answer ({e})"
    relay.stop()
    if sock is not None:
        sock.close()
    return why


class Relay:
    """The client's handlers of the RELAYED signals it does not ignore, and of the ignored
    ones in `ignored_too` (`ignored`: the request tells the service, whose child starts with
    them ignored all the same): each goes to the child and its process group (`group`; else
    to the child alone), or waits for it (`to`). A signal that came before a cold start is
    not passed on."""

    def __init__(self, ignored_too: frozenset[int] = frozenset(), group: bool = True) -> None:
        self.pidfd: int | None = None
        self.pid = 0
        self.group = group
        self.pending: list[int] = []
        self.ignored = sorted(s for s in RELAYED if s in ignored_too and signal.getsignal(s) is signal.SIG_IGN)
        self.signals = [s for s in RELAYED if signal.getsignal(s) is not signal.SIG_IGN or s in self.ignored]
        self.before = {sig: signal.getsignal(sig) for sig in self.signals}
        for sig in self.signals:
            signal.signal(sig, self._handle)

    def _handle(self, sig: int, _frame) -> None:
        if self.pidfd is None:
            self.pending.append(sig)
        else:
            _relay(self.pidfd, self.pid, sig, self.group)

    def to(self, pidfd: int, pid: int) -> None:
        self.pidfd, self.pid = pidfd, pid
        while self.pending:
            _relay(pidfd, pid, self.pending.pop(0), self.group)

    def stop(self) -> None:
        """The handlers this process had before (Python's own: Ctrl-C is KeyboardInterrupt
        again for a command that runs here after all)."""
        for sig, handler in self.before.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _warm_refusal(cmd: list[str]) -> str | None:
    if os.environ.get(OFF_ENV) == "0":
        return f"{OFF_ENV}=0"
    if command_form(cmd) is None:
        return "the command is not PYTHON SCRIPT or PYTHON -m MODULE"
    return None


def _connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        _pid, uid, _gid = peer_of(sock)
        if uid != 0:
            raise Refused(f"{path} is served by uid {uid}, not root")
        return sock
    except (OSError, Refused) as e:
        sock.close()
        if isinstance(e, FileNotFoundError | ConnectionRefusedError):
            raise Refused(f"no warm-start service on this node ({path})") from None
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _read_reply(reader) -> dict:
    """The service's next reply, from `reader` (the socket's makefile("rb"))."""
    line = reader.readline()
    if not line.endswith(b"\n"):
        raise Refused("the service closed the connection")
    return json.loads(line)


def _supervise(reader, pid: int, relay: Relay) -> int:
    """Relay signals to the child until the service says how it ended; end as it did."""
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:  # it ended already: its status is on its way
        pidfd = None
    if pidfd is not None:
        relay.to(pidfd, pid)
    try:
        status = _read_reply(reader)["status"]
    except (Refused, OSError, KeyError, ValueError):  # the service went away: the child's end, unknown
        import select

        if pidfd is not None:
            select.select([pidfd], [], [])
        print("slurm-hai: the warm-start service went away; the command's exit status is unknown",
              file=sys.stderr, flush=True)
        return 1
    finally:
        relay.stop()
        if pidfd is not None:
            os.close(pidfd)
    if os.WIFSIGNALED(status):
        died_of = os.WTERMSIG(status)
        if died_of not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(died_of, signal.SIG_DFL)
        os.kill(os.getpid(), died_of)
        return 128 + died_of  # not reached for a deadly signal
    return os.waitstatus_to_exitcode(status)


def _relay(pidfd: int, pid: int, sig: int, group: bool = True) -> None:
    """`sig` once to the child and to each process of its process group (it leads one, as a
    cold start under a launcher does: the command's own processes get the signal too), or to
    the child alone. Never twice to the child: a second SIGTERM is not the first (a launcher
    takes the first as the notice and the next as the end of its run)."""
    try:
        if group and os.getpgid(pid) == pid:
            os.killpg(pid, sig)  # the child among them
        else:
            signal.pidfd_send_signal(pidfd, sig)
            if group:  # the child left the group it led: its processes still get it
                os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the child ended (its status is on its way), or its group did


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    options: dict[str, str] = {}
    while args and args[0].startswith("--") and args[0] != "--":
        name, _, value = args.pop(0).partition("=")
        options[name] = value
    names = {"SIG" + name for name in options.get("--relay-ignored", "").split(",") if name}
    if args[:1] == ["--"]:
        args = args[1:]
    if not args or set(options) - {"--if-there", "--child-only", "--relay-ignored"} or names - set(signal.Signals.__members__):
        print("usage: python -m slurm_hai.runtime.warm [--if-there] [--child-only] [--relay-ignored=SIG,...] -- "
              "PYTHON SCRIPT|-m MODULE [ARGS...]", file=sys.stderr)
        return 2
    return run(args, if_there="--if-there" in options, group="--child-only" not in options,
               relay_ignored=frozenset(signal.Signals[name] for name in names))


if __name__ == "__main__":
    sys.exit(main())
