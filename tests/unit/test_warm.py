"""Warm starts (slurm_hai.runtime.warm, hai-admin warm-start): the real service, forking real
processes, as root, for root and for `nobody`; the client as a step would run it."""

from __future__ import annotations

import gc
import os
import pwd
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from slurm_hai.runtime.warm import command_form
from slurm_hai.runtime.warm_service import same_python
from warm_helpers import HAI_ADMIN, shared, start_service  # noqa: F401  (shared: a fixture)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the service takes other users' ids: root only")
NOBODY = pwd.getpwnam("nobody")


@pytest.fixture
def service(shared):
    sock = shared / "warm.sock"
    proc = start_service(sock, "json")
    yield sock
    proc.terminate()
    assert proc.wait(10) == 0, sock.with_suffix(".log").read_text()
    assert not sock.exists()


def client(sock: Path, cmd: list[str], user: str | None = None, env: dict[str, str] | None = None, **kw
           ) -> subprocess.Popen:
    env = {**os.environ, "HAI_WARM_SOCKET": str(sock), "HAI_TEST_VAR": "seen", **(env or {})}
    argv = [sys.executable, "-m", "slurm_hai.runtime.warm", "--", *cmd]
    if user:
        argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", "--", *argv]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=kw.pop("cwd", None), **kw)


def script(d: Path, body: str, name: str = "job.py") -> Path:
    p = d / name
    p.write_text(textwrap.dedent(body))
    p.chmod(0o644)
    return p


def test_the_command_forms_a_warm_start_takes():
    assert command_form(["py", "s.py", "a"]) == ("py", ["s.py", "a"])
    assert command_form(["py", "-m", "mod", "a"]) == ("py", ["-m", "mod", "a"])
    assert command_form(["py", "-u", "s.py"]) is None and command_form(["py", "-c", "pass"]) is None
    assert command_form(["py"]) is None


def test_the_python_of_a_warm_start_is_the_services_own_by_any_of_its_names():
    venv_bin = Path(sys.executable).parent
    assert same_python(str(venv_bin / "python3"), sys.executable) and same_python(sys.executable, sys.executable)
    assert not same_python("/usr/bin/python3", sys.executable)  # the same binary, another environment
    assert not same_python(str(venv_bin / "pip"), sys.executable) and not same_python(None, sys.executable)


def test_a_warm_child_is_the_clients_process_its_user_ids_limits_place_and_streams(service, shared):
    job = script(shared, """
        import json, os, resource, sys
        print(json.dumps({"ids": os.getresuid() + os.getresgid(), "groups": os.getgroups(), "cwd": os.getcwd(),
                          "argv": sys.argv, "var": os.environ.get("HAI_TEST_VAR"), "umask": os.umask(0),
                          "nofile": resource.getrlimit(resource.RLIMIT_NOFILE), "path0": sys.path[0],
                          "main": __name__, "warm": "json" in sys.modules}))
        print("to stderr", file=sys.stderr)
        sys.exit(7)
    """)
    p = subprocess.run(["sh", "-c", "ulimit -n 321; umask 027; exec \"$@\"", "sh", "setpriv",
                        f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", "--clear-groups", "--",
                        sys.executable, "-m", "slurm_hai.runtime.warm", "--", sys.executable, str(job), "x", "y z"],
                       env={**os.environ, "HAI_WARM_SOCKET": str(service), "HAI_TEST_VAR": "seen"}, cwd=shared,
                       capture_output=True, text=True, timeout=60)
    import json

    seen = json.loads(p.stdout)
    assert p.returncode == 7 and p.stderr == "to stderr\n"
    assert seen["ids"] == [NOBODY.pw_uid] * 3 + [NOBODY.pw_gid] * 3 and seen["groups"] == []
    assert seen["cwd"] == str(shared) and seen["argv"] == [str(job), "x", "y z"] and seen["var"] == "seen"
    assert seen["umask"] == 0o027 and seen["nofile"] == [321, 321] and seen["path0"] == str(shared)
    assert seen["main"] == "__main__" and seen["warm"]  # json came preloaded: the child is the service's fork


def test_a_warm_child_runs_at_its_clients_nice_value_on_its_clients_cpus(service, shared):
    """`nice` and `taskset` (Slurm's task/affinity binds a task's CPUs so, not by a control
    group) before the client: the child runs as niced and on the CPUs it was given, and torch
    would count those CPUs (its thread count is computed after); not at the service's."""
    job = script(shared, """
        import json, os, sys
        print(json.dumps({"nice": os.getpriority(os.PRIO_PROCESS, 0), "cpus": sorted(os.sched_getaffinity(0)),
                          "warm": "json" in sys.modules}))
    """)
    cpu = max(os.sched_getaffinity(0))
    p = subprocess.run(["nice", "-n", "7", "taskset", "-c", str(cpu), "setpriv", f"--reuid={NOBODY.pw_uid}",
                        f"--regid={NOBODY.pw_gid}", "--clear-groups", "--", sys.executable, "-m", "slurm_hai.runtime.warm",
                        "--", sys.executable, str(job)],
                       env={**os.environ, "HAI_WARM_SOCKET": str(service)}, cwd=shared, capture_output=True, text=True,
                       timeout=60)
    import json

    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert json.loads(p.stdout) == {"nice": 7, "cpus": [cpu], "warm": True}
    assert os.getpriority(os.PRIO_PROCESS, 0) == 0  # (the service's own: nice 0, every CPU)


def test_a_warm_childs_environment_and_signals_are_the_clients_not_the_services(shared):
    """become() changes only what differs from the service's: a variable the service has and
    the client not is gone, one both have takes the client's value; a signal the service
    handles is the default again, one the client ignores is ignored, as a cold start has them;
    and no two children draw the same random numbers."""
    sock = shared / "env.sock"
    proc = start_service(sock, "json", env={"HAI_TEST_SERVICE_ONLY": "1", "HAI_TEST_VAR": "the service's"})
    try:
        job = script(shared, """
            import json, os, random, signal
            def name(h):
                return {signal.SIG_DFL: "default", signal.SIG_IGN: "ignored",
                        signal.default_int_handler: "interrupt"}.get(h, repr(h))
            print(json.dumps({"var": os.environ.get("HAI_TEST_VAR"), "only": os.environ.get("HAI_TEST_SERVICE_ONLY"),
                              "env": dict(os.environ), "random": random.getrandbits(64),
                              "sig": {s: name(signal.getsignal(getattr(signal, s)))
                                      for s in ("SIGTERM", "SIGINT", "SIGUSR2", "SIGPIPE", "SIGHUP")}}))
        """)
        env = {k: v for k, v in os.environ.items() if k != "HAI_TEST_SERVICE_ONLY"}
        env.update(HAI_WARM_SOCKET=str(sock), HAI_TEST_VAR="seen")
        runs = [subprocess.run(["sh", "-c", "trap '' USR2; exec \"$@\"", "sh", sys.executable, "-m",
                                "slurm_hai.runtime.warm", "--", sys.executable, str(job)], env=env,
                               capture_output=True, text=True, timeout=60) for _ in range(2)]
        import json

        p, seen = runs[0], json.loads(runs[0].stdout)
        assert seen["random"] != json.loads(runs[1].stdout)["random"]  # each child reseeded after its fork
        assert p.returncode == 0 and (seen["var"], seen["only"]) == ("seen", None), p.stderr
        assert {k: v for k, v in seen["env"].items() if k != "PWD"} == {k: v for k, v in env.items() if k != "PWD"}
        assert seen["sig"] == {"SIGTERM": "default", "SIGINT": "interrupt", "SIGUSR2": "ignored",
                               "SIGPIPE": "ignored", "SIGHUP": "default"}
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_warm_child_takes_the_control_groups_of_its_client_where_they_differ_from_the_services(service, shared):
    """The client in a control group of its own (a step's, or a login session's): the child is
    moved there; in every other hierarchy it stays where the service is, as the client is."""
    base = _a_cgroup_hierarchy()
    group = base / f"hai-test-{os.getpid()}"
    group.mkdir()
    try:
        job = script(shared, "print(open('/proc/self/cgroup').read(), end='')\n")
        p = subprocess.run(["sh", "-c", f'echo $$ > {group}/cgroup.procs; cat /proc/self/cgroup > {shared}/client; '
                                        'exec "$@"', "sh", sys.executable, "-m", "slurm_hai.runtime.warm", "--",
                            sys.executable, str(job)],
                           env={**os.environ, "HAI_WARM_SOCKET": str(service)}, capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 0 and p.stderr == "", p.stderr  # warm: a cold start says why on stderr
        client = (shared / "client").read_text()
        assert f"/hai-test-{os.getpid()}\n" in client and client != Path("/proc/self/cgroup").read_text()
        assert p.stdout == client  # the child's groups, in every hierarchy
    finally:
        _remove_cgroup(group)


def _a_cgroup_hierarchy() -> Path:
    """The directory of this process's group in a hierarchy where a group may be made: a v1
    controller's, or v2 mounted at /sys/fs/cgroup."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        name = controllers.replace("name=", "")
        base = Path("/sys/fs/cgroup") / name if name else Path("/sys/fs/cgroup")
        if (base / path.lstrip("/") / "cgroup.procs").is_file() and os.access(base / path.lstrip("/"), os.W_OK):
            return base / path.lstrip("/")
    pytest.fail("no control group hierarchy this test can make a group in")


def _remove_cgroup(group: Path) -> None:
    parent = group.parent / "cgroup.procs"
    for pid in (group / "cgroup.procs").read_text().split():
        try:
            parent.write_text(pid)
        except OSError:
            pass
    group.rmdir()


def test_a_module_runs_as_main_and_an_uncaught_exception_exits_1_with_its_traceback(service, shared):
    script(shared, "import sys\nprint('module', sys.argv)\n", "mod_here.py")
    p = client(service, [sys.executable, "-m", "mod_here", "a"], cwd=shared)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and out == f"module ['{shared / 'mod_here.py'}', 'a']\n", err
    bad = script(shared, "raise ValueError('boom')\n", "bad.py")
    p = client(service, [sys.executable, str(bad)])
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1 and "ValueError: boom" in err and "Traceback" in err


def test_a_childs_collections_leave_what_the_service_preloaded_alone(service, shared):
    """The service freezes what it preloaded (gc.freeze): a child's full collection does not
    walk those objects, so it copies none of their pages (with torch preloaded, 0.16 s and 70
    MiB of private memory in every child otherwise: docs/benchmarks.md)."""
    job = script(shared, """\
        import gc
        frozen = gc.get_freeze_count()
        gc.collect()
        print(frozen, gc.get_freeze_count(), 'json' in __import__('sys').modules)
    """)
    p = client(service, [sys.executable, str(job)])
    out, err = p.communicate(timeout=60)
    frozen, after, preloaded = out.split()
    assert p.returncode == 0 and int(frozen) > 1000 and after == frozen and preloaded == "True", (out, err)


def test_signals_reach_the_child_and_the_client_ends_as_the_child_did(service, shared):
    job = script(shared, """
        import signal, sys, time
        signal.signal(signal.SIGUSR1, lambda *_: print("usr1", flush=True))
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))
        print("ready", flush=True)
        while True:
            time.sleep(0.1)
    """)
    p = client(service, [sys.executable, str(job)], user=str(NOBODY.pw_uid))
    assert p.stdout.readline() == "ready\n"
    p.send_signal(signal.SIGUSR1)
    assert p.stdout.readline() == "usr1\n"
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 42
    dies = script(shared, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", "dies.py")
    p = client(service, [sys.executable, str(dies)])
    assert p.wait(30) == -signal.SIGKILL


def gone(pid: int) -> bool:
    """Whether process `pid` has ended (gone, or a zombie waiting for its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pids, what: str, within: float = 10) -> None:
    deadline = time.monotonic() + within
    while not all(gone(pid) for pid in pids):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# A job's command with processes of its own: one in its process group, one in a session of its
# own (as torchrun starts its workers); each prints its pid
FAMILY = """
    import os, subprocess, sys, time
    same = subprocess.Popen(["sleep", "600"])
    apart = subprocess.Popen(["sleep", "601"], start_new_session=True)
    print(os.getpid(), same.pid, apart.pid, os.getpgid(0) == os.getpid(), flush=True)
    time.sleep(600)
"""


def test_a_client_killed_takes_its_child_and_all_below_it_with_it(service, shared):
    job = script(shared, FAMILY)
    p = client(service, [sys.executable, str(job)], user=str(NOBODY.pw_uid))
    child, same, apart, leads = p.stdout.readline().split()
    assert leads == "True"  # a process group of its own, as a cold start under the launcher
    p.kill()
    p.wait(10)
    wait_gone([int(child), int(same), int(apart)], "a process of the child outlived its client")


def test_a_signal_to_the_client_reaches_the_childs_process_group(service, shared):
    """As the launcher's SIGTERM reaches a cold command's process group: the child and what it
    started in its group; a process in a session of its own is the command's to end."""
    job = script(shared, FAMILY)
    p = client(service, [sys.executable, str(job)], user=str(NOBODY.pw_uid))
    child, same, apart, _ = p.stdout.readline().split()
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == -signal.SIGTERM
    wait_gone([int(child), int(same)], "the child's process group did not get the signal")
    assert not gone(int(apart))
    os.kill(int(apart), signal.SIGKILL)


def test_a_launcher_starts_a_python_command_through_the_service_where_there_is_one(shared):
    from slurm_hai.runtime.warm import through_service

    sock = shared / "there.sock"
    sock.touch()
    py = str(Path(sys.executable).with_name("python3"))
    client_argv = [sys.executable, "-m", "slurm_hai.runtime.warm", "--"]
    assert through_service([py, "train.py", "-x"], str(sock)) == [*client_argv, py, "train.py", "-x"]
    assert through_service([sys.executable, "-m", "mod"], str(sock)) == [*client_argv, sys.executable, "-m", "mod"]
    for cmd in (["/usr/bin/python3", "train.py"], ["./run.sh", "a"], [sys.executable, "-c", "pass"]):
        assert through_service(cmd, str(sock)) == cmd  # another interpreter, not Python, not a script
    assert through_service([py, "train.py"], str(shared / "none.sock")) == [py, "train.py"]  # no service


def test_what_cannot_be_warm_starts_cold_with_one_line(service, shared):
    job = script(shared, "import sys\nprint('ran', 'json' in sys.modules)\n")
    for cmd, env, why in (
            (["/usr/bin/python3", str(job)], {}, "the command's Python is '/usr/bin/python3'"),
            ([sys.executable, str(job)], {"LD_PRELOAD": "libm.so.6"}, "LD_PRELOAD differs from the service's"),
            ([sys.executable, str(job)], {"HAI_WARM_SOCKET": str(shared / "none.sock")}, "no warm-start service"),
    ):
        p = subprocess.run([sys.executable, "-m", "slurm_hai.runtime.warm", "--", *cmd],
                           env={**os.environ, "HAI_WARM_SOCKET": str(service), **env}, capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 0 and p.stdout == "ran False\n", p.stderr  # a cold process: json not loaded
        assert p.stderr.startswith("slurm-hai: starting cold: ") and why in p.stderr and p.stderr.count("\n") == 1


def test_if_there_a_node_without_a_service_starts_cold_and_silent_and_one_with_it_warm(service, shared):
    """`--if-there` (a job's script starting its batch driver): where no service listens the
    command starts cold and the client says nothing; where one does, the command is its child;
    a refusal is still said."""
    job = script(shared, "import sys\nprint('ran', 'json' in sys.modules)\n")
    client = [sys.executable, "-m", "slurm_hai.runtime.warm", "--if-there", "--"]
    for sock, env, out, err in (
            (shared / "none.sock", {}, "ran False\n", ""),
            (service, {}, "ran True\n", ""),
            (service, {"LD_PRELOAD": "libm.so.6"}, "ran False\n", "slurm-hai: starting cold: LD_PRELOAD differs"),
    ):
        p = subprocess.run([*client, sys.executable, str(job)], env={**os.environ, "HAI_WARM_SOCKET": str(sock), **env},
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and p.stdout == out and p.stderr.startswith(err) and p.stderr.count("\n") == bool(err)


@pytest.mark.parametrize("relay", [True, False])
def test_a_signal_the_client_ignores_reaches_the_child_only_where_it_is_relayed_and_the_child_starts_ignoring_it(
        service, shared, relay):
    """The launcher's case: its step ignores the notice signals until its handlers are in
    place. With --relay-ignored the client relays them all the same, and the child starts with
    them ignored, as a cold start would; without it the child never hears them."""
    ready, got = shared / "ready", shared / "got"
    job = script(shared, f"""
        import signal, sys, time
        ignored = signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN
        signal.signal(signal.SIGUSR2, lambda *_: open({str(got)!r}, "w").write("got"))
        open({str(ready)!r}, "w").write(str(ignored))
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not __import__("os").path.exists({str(got)!r}):
            time.sleep(0.01)
    """)
    options = ["--relay-ignored=USR2"] if relay else []
    p = subprocess.Popen(["/bin/sh", "-c", "trap '' USR2; exec \"$@\"", "sh", sys.executable, "-m",
                          "slurm_hai.runtime.warm", *options, "--", sys.executable, str(job)],
                         env={**os.environ, "HAI_WARM_SOCKET": str(service)}, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGUSR2)  # the client, as Slurm signals the step's process
    _, err = p.communicate(timeout=30)
    assert p.returncode == 0 and not err
    assert ready.read_text() == "True" and got.exists() == relay


def test_a_relayed_signal_is_sent_to_the_child_once(monkeypatch):
    """By its process group where it leads one (the child among them), else by its pidfd
    and then to the group it led: never both to the child (a launcher takes a second SIGTERM
    as the end of its run; found live with a TERM notice)."""
    from slurm_hai.runtime import warm

    sent: list[tuple[str, int]] = []
    monkeypatch.setattr(warm.signal, "pidfd_send_signal", lambda fd, sig: sent.append(("pidfd", sig)))
    monkeypatch.setattr(warm.os, "killpg", lambda pgid, sig: sent.append(("group", sig)))
    leader = subprocess.Popen(["sleep", "30"], start_new_session=True)
    member = subprocess.Popen(["sleep", "30"])  # in this process's group, which it does not lead
    try:
        for pid, group, want in ((leader.pid, True, [("group", 15)]), (leader.pid, False, [("pidfd", 15)]),
                                 (member.pid, True, [("pidfd", 15), ("group", 15)])):
            sent.clear()
            warm._relay(-1, pid, signal.SIGTERM, group)
            assert sent == want, (pid, group)
    finally:
        for p in (leader, member):
            p.kill()
            p.wait()


@pytest.mark.parametrize("child_only", [True, False])
def test_child_only_relays_a_signal_to_the_child_and_not_to_the_processes_it_started(service, shared, child_only):
    """A job's batch driver (--child-only): Slurm signals the batch script, not the srun it
    started, which would end the job's step; a command's client relays to the whole group."""
    ready, got = shared / "ready", shared / "got"
    job = script(shared, f"""
        import os, signal, subprocess, sys, time
        below = subprocess.Popen(["sleep", "30"])  # in the child's process group, as srun is
        signal.signal(signal.SIGTERM, lambda *_: open({str(got)!r}, "w").write("got"))
        open({str(ready)!r}, "w").write(str(below.pid))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not os.path.exists({str(got)!r}):
            time.sleep(0.01)
        time.sleep(0.2)
        sys.exit(0 if below.poll() is None else 3)  # 3: what it started got the signal too
    """)
    options = ["--child-only"] if child_only else []
    p = subprocess.Popen([sys.executable, "-m", "slurm_hai.runtime.warm", *options, "--", sys.executable, str(job)],
                         env={**os.environ, "HAI_WARM_SOCKET": str(service)})
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGTERM)
    assert p.wait(30) == (0 if child_only else 3) and got.exists()
    os.kill(int(ready.read_text()), signal.SIGKILL) if child_only else None


def test_a_service_whose_code_changed_on_disk_starts_cold_until_it_is_restarted(shared):
    """An upgrade under a running service: its children would run the code it loaded before.
    The service notices within a second (it looks at its files once a second at most)."""
    module = script(shared, "VERSION = 1\n", name="hai_probe_mod.py")
    job = script(shared, "import sys, hai_probe_mod\nprint('version', hai_probe_mod.VERSION, 'warm' if "
                         "'json' in sys.modules else 'cold')\n")
    sock = shared / "stale.sock"
    proc = start_service(sock, "json,hai_probe_mod", env={"PYTHONPATH": str(shared)})
    try:
        def run() -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "slurm_hai.runtime.warm", "--", sys.executable, str(job)],
                                  env={**os.environ, "HAI_WARM_SOCKET": str(sock), "PYTHONPATH": str(shared)},
                                  capture_output=True, text=True, timeout=60)
        first = run()
        assert (first.stdout, first.stderr) == ("version 1 warm\n", "")
        module.write_text("VERSION = 2  # upgraded\n")
        deadline = time.monotonic() + 30  # the service looks at its files once a second at most
        while (second := run()).stdout == "version 1 warm\n" and time.monotonic() < deadline:
            pass
        assert second.returncode == 0 and second.stdout == "version 2 cold\n"
        assert second.stderr == (f"slurm-hai: starting cold: the service's code changed on disk since it started "
                                 f"({module}): restart hai-admin warm-start\n")
    finally:
        proc.terminate()
        proc.wait(10)
    proc = start_service(sock, "json,hai_probe_mod", env={"PYTHONPATH": str(shared)})
    try:
        assert run().stdout == "version 2 warm\n"
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_child_slow_to_start_holds_up_no_other_start(shared):
    """The service hears each child's word on its ready pipe in its loop: a child slow to
    become its client's process (here: held 20 s) does not queue the next client behind it."""
    forked = shared / "slow-child-forked"
    script(shared, f"""
        import time
        from slurm_hai.runtime import warm_service
        _become = warm_service.become
        def become(request, fds, peer, taken=None):
            if request["env"].get("HAI_TEST_SLOW"):
                open({str(forked)!r}, "w").close()
                time.sleep(20)
            return _become(request, fds, peer, taken)
        warm_service.become = become
    """, name="hai_slow_start.py")
    job = script(shared, "import sys\nprint('warm' if 'json' in sys.modules else 'cold')\n")
    sock = shared / "slow.sock"
    proc = start_service(sock, "json,hai_slow_start", env={"PYTHONPATH": str(shared)})
    slow = subprocess.Popen([sys.executable, "-m", "slurm_hai.runtime.warm", "--", sys.executable, str(job)],
                            env={**os.environ, "HAI_WARM_SOCKET": str(sock), "HAI_TEST_SLOW": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not forked.exists():
            assert slow.poll() is None and time.monotonic() < deadline, slow.communicate()
            time.sleep(0.05)
        t0 = time.monotonic()
        fast = client(sock, [sys.executable, str(job)])
        assert fast.communicate(timeout=15) == ("warm\n", "") and time.monotonic() - t0 < 10
        assert slow.poll() is None  # its child still on its way
    finally:
        slow.kill()
        slow.wait()
        proc.terminate()
        proc.wait(10)


def test_a_service_that_is_not_roots_is_not_trusted(shared):
    (shared / "nobody").mkdir()
    os.chown(shared / "nobody", NOBODY.pw_uid, NOBODY.pw_gid)
    sock = shared / "nobody" / "fake.sock"
    fake = subprocess.Popen(["setpriv", f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", "--clear-groups",
                             sys.executable, "-c", textwrap.dedent(f"""
        import socket, time
        s = socket.socket(socket.AF_UNIX); s.bind({str(sock)!r}); s.listen(); print("up", flush=True)
        while True:
            c, _ = s.accept(); time.sleep(5)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert fake.stdout.readline() == "up\n"
        job = script(shared, "print('ran')\n")
        p = subprocess.run([sys.executable, "-m", "slurm_hai.runtime.warm", "--", sys.executable, str(job)],
                           env={**os.environ, "HAI_WARM_SOCKET": str(sock)}, capture_output=True, text=True, timeout=60)
        assert p.stdout == "ran\n" and f"is served by uid {NOBODY.pw_uid}, not root" in p.stderr
    finally:
        fake.kill()
        fake.wait()


def test_with_torch_preloaded_a_warm_start_computes_as_a_cold_one(shared):
    sock = shared / "torch.sock"
    service = start_service(sock, "torch")
    job = script(shared, """
        import random, torch
        torch.manual_seed(0)
        x = torch.randn(256, 256, dtype=torch.float64)
        print(torch.get_num_threads(), (x @ x).sum().item().hex(), random.random())
    """)
    try:
        runs = {}
        for threads in ("1", None):
            env = {**os.environ, "HAI_WARM_SOCKET": str(sock)}
            env.pop("OMP_NUM_THREADS", None)
            if threads:
                env["OMP_NUM_THREADS"] = threads
            for how, argv in (("cold", [sys.executable, str(job)]),
                              ("warm", [sys.executable, "-m", "slurm_hai.runtime.warm", "--", sys.executable, str(job)]),
                              ("warm again", [sys.executable, "-m", "slurm_hai.runtime.warm", "--", sys.executable,
                                              str(job)])):
                p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
                assert p.returncode == 0 and "starting cold" not in p.stderr, p.stderr
                runs[threads, how] = p.stdout.split()
        for threads in ("1", None):
            cold, warm, again = (runs[threads, how] for how in ("cold", "warm", "warm again"))
            assert warm[:2] == cold[:2] == again[:2]  # the thread count, and the result bit for bit
            assert warm[2] != again[2]  # random's seed is each process's own
        assert runs["1", "cold"][0] == "1" and runs[None, "cold"][0] == str(len(os.sched_getaffinity(0)))
    finally:
        service.terminate()
        service.wait(10)


def test_the_service_refuses_to_run_as_another_user_than_root(shared):
    p = subprocess.run(["setpriv", f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", "--clear-groups",
                        str(HAI_ADMIN), "warm-start", "--socket", str(shared / "x.sock")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stderr.strip().endswith("run it as root") and p.stderr.count("\n") == 1


def test_a_preloaded_modules_started_hook_runs_in_the_child_as_the_client_before_the_command(shared, monkeypatch):
    """A preloaded module's `started(argv)` runs in each child once it is the client's process
    and before the command (`hai` starts its first queue read there); a hook that fails is
    told on the client's stderr and the command runs all the same."""
    script(shared, """
        import os, sys
        seen = []
        def started(argv):
            if os.environ.get("HAI_TEST_HOOK_FAILS"):
                raise OSError("no such thing")
            seen.append((os.getuid(), argv[1:], os.environ["HAI_TEST_VAR"]))
    """, name="hai_hook.py")
    job = script(shared, "import hai_hook\nprint(hai_hook.seen)\n")
    sock = shared / "hook.sock"
    proc = start_service(sock, "json,hai_hook", env={"PYTHONPATH": str(shared)})
    try:
        p = client(sock, [sys.executable, str(job), "an-arg"], user=str(NOBODY.pw_uid))
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0 and out == f"[({NOBODY.pw_uid}, ['an-arg'], 'seen')]\n", (out, err)
        monkeypatch.setenv("HAI_TEST_HOOK_FAILS", "1")
        p = client(sock, [sys.executable, str(job)])
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0 and out == "[]\n" and "hai_hook.started: OSError: no such thing" in err, (out, err)
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_child_tells_its_exit_status_and_what_it_leaves_running_is_not_killed(service, shared):
    """The child tells its client its exit status before it ends (its memory's teardown is no
    longer the client's wait); the client, gone at once, is no reason to kill a process the
    command left running in its group, as when the service told the status."""
    job = script(shared, """
        import subprocess, sys
        p = subprocess.Popen(["sleep", "30"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(p.pid)
        ballast = b"x" * (1 << 30)  # its teardown, 0.1 s: the client has gone before the child has ended
        sys.exit(3)
    """)
    p = client(service, [sys.executable, str(job)], user=str(NOBODY.pw_uid))
    out, err = p.communicate(timeout=30)
    assert p.returncode == 3 and err == "", (out, err)
    time.sleep(0.5)  # what _client_gone would have done by now
    pid = int(out)
    try:
        assert not gone(pid), "the command's background process was killed with its client"
    finally:
        os.kill(pid, signal.SIGKILL)


def test_a_stale_client_event_does_not_touch_the_child_that_took_its_pidfds_number(tmp_path):
    """A child that ended and whose client went in the same round of the loop: the client's
    event names the child's pidfd by number, which the round may have given to a new child
    already; that child and its client are left alone, and a client that did go has its child
    killed only if the child is still there EXIT_AFTER_STATUS_S later."""
    import selectors
    import socket

    from slurm_hai.runtime import warm_service

    service = warm_service.Service(str(tmp_path / "s.sock"), [])
    new_child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    new_client, _peer = socket.socketpair()
    old_client, _old_peer = socket.socketpair()
    pidfd = os.pidfd_open(new_child.pid)
    try:
        service.children[pidfd] = warm_service._Child(new_child.pid, pidfd, None, (), new_client)
        service.sel.register(new_client, selectors.EVENT_READ, ("client", pidfd))
        service._client_gone(pidfd, old_client)  # the ended child's client, by the reused number
        assert new_client in [k.fileobj for k in service.sel.get_map().values()] and not service.orphans
        service._client_gone(pidfd, new_client)  # its own client goes: killed 50 ms on
        assert list(service.orphans) == [pidfd]
        service._kill_orphans()
        assert new_child.poll() is None  # not yet
        time.sleep(warm_service.EXIT_AFTER_STATUS_S)
        service._kill_orphans()
        assert new_child.wait(5) == -signal.SIGKILL
    finally:
        new_child.kill()
        new_child.wait()
        os.close(pidfd)
        for s in (new_client, _peer, old_client, _old_peer):
            s.close()


def test_a_service_stopped_while_its_child_runs_leaves_the_child_to_tell_its_client_how_it_ended(shared):
    started = shared / "stopped-service-child"
    job = script(shared, f"""
        import sys, time
        open({str(started)!r}, "w").close()
        time.sleep(1.5)
        sys.exit(4)
    """)
    sock = shared / "stopping.sock"
    proc = start_service(sock, "json")
    p = client(sock, [sys.executable, str(job)])
    try:
        deadline = time.monotonic() + 30
        while not started.exists():
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.05)
        proc.terminate()
        assert proc.wait(10) == 0
        assert p.wait(30) == 4, p.communicate()
    finally:
        p.kill()
        proc.kill()


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _waited(what, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.02)
    return got


def test_the_service_forks_a_child_ahead_and_the_next_command_runs_in_it(shared):
    """While no client waits, the service keeps one child forked ahead; a request is handed to
    it (the client is told its pid, the command runs there warm, as the client), and another is
    forked. One that died before its request is passed by: the command runs in a child forked
    for it, and a new one is forked ahead. The service that stops ends the one waiting."""
    sock = shared / "ahead.sock"
    proc = start_service(sock, "json")
    job = script(shared, "import json, os, sys\nprint(os.getpid(), os.getuid(), 'json' in sys.modules)\n")
    try:
        (ahead,) = _waited(lambda: _children(proc.pid))
        p = client(sock, [sys.executable, str(job)], user=str(NOBODY.pw_uid))
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0 and out.split() == [str(ahead), str(NOBODY.pw_uid), "True"], (out, err)
        (again,) = _waited(lambda: [c for c in _children(proc.pid) if c != ahead and not gone(c)])
        os.kill(again, signal.SIGKILL)
        _waited(lambda: "ended before its request" in sock.with_suffix(".log").read_text())
        p = client(sock, [sys.executable, str(job)])
        out, err = p.communicate(timeout=60)
        pid, uid, warm = out.split()
        assert p.returncode == 0 and int(pid) not in (ahead, again) and warm == "True", (out, err)
        (last,) = _waited(lambda: [c for c in _children(proc.pid) if not gone(c) and c != int(pid)])
    finally:
        proc.terminate()
        assert proc.wait(10) == 0, sock.with_suffix(".log").read_text()
    assert gone(last)


def test_a_service_that_cannot_fork_ahead_goes_on_and_tries_again_later(monkeypatch, caplog):
    """fork() failing (out of processes or memory) for the child forked ahead is one line in the
    service's log, not its end; the next try is SPARE_AGAIN_AFTER_S later."""
    from slurm_hai.runtime import warm_service

    service = warm_service.Service("/nonexistent.sock", [])

    def no_fork() -> int:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(warm_service.os, "fork", no_fork)
    gc.collect()  # an earlier test's garbage (a Popen's pipes) closed now, not while the descriptors are counted
    gc.disable()
    try:
        before = len(os.listdir("/proc/self/fd"))
        service._fork_spare()
        after = len(os.listdir("/proc/self/fd"))
    finally:
        gc.enable()
    assert service.spare is None and service.spare_after > time.monotonic() + 0.5
    assert "no child forked ahead: [Errno 11]" in caplog.text
    assert after == before  # its socket pair closed
    service._fork_spare()  # too soon: not tried again
    assert caplog.text.count("no child forked ahead") == 1


LEAVES = """
    import atexit, json, os, resource, subprocess, sys, threading, time
    left = sys.argv[1]
    print(os.getpid(), os.getcwd(), os.environ.get("HAI_TEST_VAR"), resource.getrlimit(resource.RLIMIT_NOFILE)[0],
          sys.stdin.read(), flush=True)
    if left == "thread":
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
    elif left == "process":
        subprocess.Popen(["sleep", "30"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    elif left == "file":
        json.kept = open(__file__)  # held by a preloaded module: open after the command
    elif left == "exit hook":
        atexit.register(print, "at exit")
    elif left == "limit":
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    sys.exit(int(sys.argv[2]))
"""


@pytest.fixture
def again(shared):
    """A service whose preloaded module says any command may be followed by another."""
    script(shared, "def reusable(argv):\n    return True\n", name="hai_again.py")
    sock = shared / "again.sock"
    proc = start_service(sock, "json,hai_again", {"PYTHONPATH": str(shared)}, "--keep-idle", "30")
    yield sock, proc
    proc.terminate()
    assert proc.wait(10) == 0, sock.with_suffix(".log").read_text()


def test_a_child_runs_its_users_next_command_where_the_last_left_nothing_behind(again, shared):
    """A child whose command its preloaded module calls reusable, and that left nothing
    behind, runs the next command of the same user, environment, directory, limits and groups:
    with that command's arguments, streams and exit status, its client's pipes closed at the
    end of each (communicate() returns). A thread, a process, an open file, an exit hook or
    lowered limits left by a command: the next runs in another child. Another environment,
    user or limit: another child, warm. The service that stops ends the idle child."""
    sock, proc = again
    job = script(shared, LEAVES)

    def run(*args: str, user: str | None = str(NOBODY.pw_uid), stdin: str = "", env: dict | None = None,
            nofile: int | None = None, nice: int = 0) -> tuple[int, list[str], str]:
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else (
            (lambda: os.nice(nice)) if nice else None)
        p = client(sock, [sys.executable, str(job), *args], user=user, env=env, stdin=subprocess.PIPE, cwd=shared,
                   preexec_fn=limit)
        out, err = p.communicate(stdin, timeout=60)
        return p.returncode, out.split(), err

    code, (first, cwd, var, nofile, read), err = run("nothing", "3", stdin="a")
    assert (code, cwd, var, read, err) == (3, str(shared), "seen", "a", ""), err
    code, (pid, *_, read), err = run("nothing", "0", stdin="b")
    assert (code, pid, read, err) == (0, first, "b", ""), "the next command ran in the same child, with its own stdin"
    for left in ("thread", "process", "file", "exit hook", "limit"):
        code, (ran_in, *_), err = run(left, "0", stdin="x")
        assert code == 0 and ran_in == pid and err == "", (left, err)
        code, (pid, *_), err = run("nothing", "0", stdin="x")
        assert code == 0 and pid != ran_in and err == "", f"a command that left a {left} is the child's last"
    _, (again_pid, *_), _ = run("nothing", "0", stdin="x")
    assert again_pid == pid
    _, (in_other_env, _, var, *_), err = run("nothing", "0", stdin="x", env={"HAI_TEST_VAR": "other"})
    assert in_other_env != pid and var == "other" and err == ""
    _, (as_root, *_), err = run("nothing", "0", stdin="x", user=None)
    assert as_root not in (pid, in_other_env) and err == ""
    _, (lower, _, _, nofile, _), err = run("nothing", "0", stdin="x", nofile=200)
    assert lower not in (pid, in_other_env, as_root) and nofile == "200" and err == "", "warm, not cold"
    _, (niced, *_), err = run("nothing", "0", stdin="x", nice=5)  # a child no longer root cannot go back to 0
    assert niced not in (pid, in_other_env, as_root, lower) and err == "", "another child, warm, not refused"
    _, (after, *_), err = run("nothing", "0", stdin="x")
    assert after == pid and err == ""
    log = sock.with_suffix(".log").read_text()
    assert "(its command 2)" in log and "refused" not in log, log
    proc.terminate()
    assert proc.wait(10) == 0
    wait_gone([int(pid)], "the idle child, once the service stopped")


def test_an_idle_child_ends_after_keep_idle(shared):
    script(shared, "def reusable(argv):\n    return True\n", name="hai_again.py")
    job = script(shared, "import os\nprint(os.getpid())\n")
    sock = shared / "short.sock"
    proc = start_service(sock, "json,hai_again", {"PYTHONPATH": str(shared)}, "--keep-idle", "0.5")
    try:
        out, err = client(sock, [sys.executable, str(job)], cwd=shared).communicate(timeout=60)
        wait_gone([int(out)], "the idle child, after --keep-idle")
        again_out, err = client(sock, [sys.executable, str(job)], cwd=shared).communicate(timeout=60)
        assert again_out != out and err == ""
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


def test_an_idle_child_that_dies_as_it_is_given_a_request_is_let_go_of_once(tmp_path, caplog):
    """An idle child handed a request dies before it says it started: its ready pipe, its
    pidfd and its socket pair all say so in one round of the loop. The client is refused
    (it starts cold), the child is forgotten and reaped once, and the round's other events of
    it are passed by, not errors."""
    import selectors
    import socket

    from slurm_hai.runtime import warm_service

    service = warm_service.Service(str(tmp_path / "s.sock"), [])
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    ours, theirs = socket.socketpair()
    client, client_end = socket.socketpair()
    stream_r, stream_w = os.pipe()
    pidfd = os.pidfd_open(proc.pid)
    child = warm_service._Child(proc.pid, pidfd, ours, ("key",))
    service.children[pidfd] = child
    service.sel.register(pidfd, selectors.EVENT_READ, ("child", pidfd))
    service.sel.register(ours, selectors.EVENT_READ, ("idle", pidfd))
    service.idle.append(child)
    try:
        start = service._again(("key",), {"argv": ["-m", "x"]}, [stream_r, stream_r, stream_w],
                               (os.getpid(), 0, 0), client)
        assert start is not None and start.child is child and not service.idle
        service.starting[start.ready] = start._replace(deadline=time.monotonic() + 10)
        service.sel.register(start.ready, selectors.EVENT_READ, ("ready", start.ready))
        theirs.close()  # the child's end, and the request's descriptors in it, go with the child
        proc.kill()
        events = _waited(lambda: (lambda e: e if len(e) == 3 else None)(service.sel.select(0.1)))
        service._round(None, events)  # type: ignore[arg-type]  # no request among them
        assert "while handling" not in caplog.text
        assert not service.children and not service.starting and child.chan is None
        assert proc.returncode is None and gone(proc.pid)  # reaped by the service, not by Popen
        assert client_end.recv(4096).startswith(b'{"refused": "the child did not start"')
    finally:
        for s in (client, client_end, theirs):
            s.close()
        for fd in (stream_r, stream_w):
            os.close(fd)


def test_a_client_whose_child_ended_before_its_pid_starts_cold(tmp_path):
    """The service's first word is the child's wait status where the child ended before it
    told its pid (so before the command): the client takes it as a refusal, and starts the
    command itself, rather than failing on the missing pid."""
    import socket
    import threading

    from slurm_hai.runtime.warm import receive_request, reply, start

    path = tmp_path / "ended.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def serve() -> None:
        conn, _ = server.accept()
        _request, fds = receive_request(conn)
        for fd in fds:
            os.close(fd)
        reply(conn, {"status": 256})
        conn.close()

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        assert start([sys.executable, "-m", "json.tool"], str(path)) == "the child ended before it started the command"
    finally:
        thread.join(10)
        server.close()


def test_a_service_started_without_standard_streams_gives_each_child_its_clients(shared):
    """A service started with 0-2 closed takes /dev/null for them: a connection or a
    descriptor it receives would otherwise take 0, which its child makes its client's stdin."""
    sock = shared / "closed.sock"
    log = open(sock.with_suffix(".log"), "w")

    def close_streams() -> None:
        os.close(0)

    proc = subprocess.Popen([str(HAI_ADMIN), "warm-start", "--socket", str(sock), "--preload", "json"],
                            stdout=log, stderr=subprocess.STDOUT, preexec_fn=close_streams)
    try:
        _waited(lambda: "warm-start service on" in sock.with_suffix(".log").read_text())
        job = script(shared, "import sys\nprint(sys.stdin.read(), 'json' in sys.modules)\n")
        for _ in range(2):
            p = client(sock, [sys.executable, str(job)], stdin=subprocess.PIPE)
            assert p.communicate("from the client", timeout=60) == ("from the client True\n", "")
    finally:
        proc.terminate()
        assert proc.wait(10) == 0, sock.with_suffix(".log").read_text()
