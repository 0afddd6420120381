"""`hai` and `hai-submit` through a login node's warm-start service, from each front: the
installed console scripts (slurm_hai/cli/front.py) and the C program `hai-admin front build`
compiles (contrib/front/hai_front.c); the real `hai-admin warm-start` preloading the commands,
as root. A command run warm says and exits exactly what it says and exits run here, with the
caller's environment (a policy file the service never saw) and the caller's ids; where no
service listens it runs here and says nothing more."""

from __future__ import annotations

import json
import os
import pwd
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from warm_helpers import shared, start_service  # noqa: F401  (shared: a fixture)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the service takes other users' ids: root only")
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SITE_POLICY = REPO / "tests" / "fixtures" / "site_policy.toml"
LOCAL_POLICY = REPO / "contrib" / "localcluster" / "policy.toml"
NOBODY = pwd.getpwnam("nobody")


@pytest.fixture(scope="module")
def c_front():
    """hai and hai-submit in C, built for this installation, in a directory every user may read."""
    d = Path(tempfile.mkdtemp(prefix="hai-front-"))
    d.chmod(0o755)
    p = subprocess.run([str(BIN / "hai-admin"), "front", "build", "--out", str(d)], capture_output=True, text=True)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


@pytest.fixture(params=["python", "c"])
def front(request) -> Path:
    """The directory of the hai and hai-submit a test runs: the console scripts, or the C front."""
    return BIN if request.param == "python" else request.getfixturevalue("c_front")


@pytest.fixture
def commands(shared):  # noqa: F811
    """A service preloading the commands, started with the local cluster's policy."""
    sock = shared / "commands.sock"
    proc = start_service(sock, "slurm_hai.cli.preload", env={"HAI_POLICY": str(LOCAL_POLICY)})
    yield sock
    proc.terminate()
    assert proc.wait(10) == 0, sock.with_suffix(".log").read_text()


def command(tool: str, *argv: str, sock: Path, front: Path = BIN, user: int | None = None, stdout=subprocess.PIPE,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    run_env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    run_env.update(HAI_COMMANDS_SOCKET=str(sock), HAI_POLICY=str(SITE_POLICY),
                   HOME="/tmp" if user is not None else run_env.get("HOME", "/root"))
    run_env.update(env or {})
    prefix = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", "--"] if user is not None else []
    return subprocess.run([*prefix, str(front / tool), *argv], env=run_env, stdout=stdout, stderr=subprocess.PIPE,
                          text=True, cwd=REPO, timeout=120)


def started(sock: Path) -> list[str]:
    return re.findall(r"uid (\d+) pid \d+: started \['-m', 'slurm_hai.cli'\]", sock.with_suffix(".log").read_text())


def without_token(text: str) -> str:
    return re.sub(r"HAI_SUBMIT_TOKEN=\w+", "HAI_SUBMIT_TOKEN=...", text)


@pytest.mark.parametrize("user", [None, NOBODY.pw_uid], ids=["root", "nobody"])
def test_a_command_run_warm_says_and_exits_what_it_does_run_here(commands, front, user):
    nowhere = commands.with_name("none.sock")
    for tool, argv, code in [
        ("hai-submit", ["--dry-run", "--gpus-per-node", "0", "examples/train.py"], 0),
        ("hai-submit", ["-n", "x", "examples/train.py"], 2),
        ("hai", ["status", "x"], 2),
        ("hai", ["lsit"], 2),
    ]:
        here = command(tool, *argv, sock=nowhere, front=front, user=user)
        warm = command(tool, *argv, sock=commands, front=front, user=user)
        assert here.returncode == warm.returncode == code, (tool, argv, here.stderr, warm.stderr)
        assert without_token(warm.stdout) == without_token(here.stdout), (tool, argv)
        assert warm.stderr == here.stderr, (tool, argv)
    # the policy the caller names, not the service's (HAI's LOW): the site's default level's
    # QOS; the caller's home
    dry = command("hai-submit", "--dry-run", "--gpus-per-node", "0", "examples/train.py", sock=commands, front=front,
                  user=user)
    assert "#SBATCH --qos=bronze\n" in dry.stdout and ("/tmp/.hai/jobs" in dry.stdout) == (user is not None)
    # every warm run was the service's child, as the caller's uid; the runs here never asked;
    # one child ran the five, each after the other (the same caller, environment and directory)
    assert started(commands) == [str(user or 0)] * 5
    assert "(its command 5)" in commands.with_suffix(".log").read_text()
    assert not nowhere.exists()


def test_output_cut_short_ends_warm_as_here_with_the_status_of_sigpipe(commands, front):
    read, write = os.pipe()
    os.close(read)
    try:
        for sock in (commands, commands.with_name("none.sock")):
            p = command("hai", "--help", sock=sock, front=front, stdout=write)
            assert (p.returncode, p.stderr) == (141, "")
    finally:
        os.close(write)
    assert started(commands) == ["0"]


def test_hai_warm_0_runs_the_command_here(commands, front):
    env_off = command("hai", "--help", sock=commands, front=front)
    assert env_off.returncode == 0 and started(commands) == ["0"]
    off = command("hai", "--help", sock=commands, front=front, env={"HAI_WARM": "0"})
    assert off.returncode == 0 and off.stdout == env_off.stdout and started(commands) == ["0"]


def test_the_c_front_hands_the_service_any_text_as_the_python_front_would(commands, c_front):
    """Quotes, backslashes, control characters, any UTF-8, and bytes that are not UTF-8, in the
    arguments and the environment, reach the command as they would run here."""
    for odd in ['a "quoted" \\ back\tslash\x01 é 漢 \U0001F600'.encode(), b"not \xff\xfe \xe6\x97 utf-8 \xed\xa0\x80"]:
        warm = command_bytes(c_front, [b"hai", b"status", odd], commands)
        here = command_bytes(c_front, [b"hai", b"status", odd], commands.with_name("none.sock"))
        assert (warm.returncode, warm.stdout, warm.stderr) == (2, b"", here.stderr) and b"not a job id" in here.stderr
        policy = bytes(commands.parent) + b"/" + odd.replace(b"/", b"") + b"/policy.toml"  # the site's policy there
        os.makedirs(os.path.dirname(policy))
        with open(policy, "wb") as f:
            f.write(SITE_POLICY.read_bytes())
        dry = command_bytes(c_front, [b"hai-submit", b"--dry-run", b"--gpus-per-node", b"0", b"examples/train.py"],
                            commands, {b"HAI_POLICY": policy})
        assert dry.returncode == 0 and b"#SBATCH --qos=bronze\n" in dry.stdout, dry.stderr
    assert started(commands) == ["0"] * 4
    assert "WARNING" not in commands.with_suffix(".log").read_text()  # every request was read whole


def command_bytes(front: Path, argv: list[bytes], sock: Path, env: dict[bytes, bytes] | None = None
                  ) -> subprocess.CompletedProcess:
    run_env = {**os.environb, b"HAI_COMMANDS_SOCKET": bytes(sock), b"HAI_POLICY": bytes(SITE_POLICY), **(env or {})}
    run_env.pop(b"SLURM_CONF", None)
    return subprocess.run([bytes(front) + b"/" + argv[0], *argv[1:]], capture_output=True, env=run_env, cwd=REPO,
                          timeout=120)


def test_the_c_front_is_hai_or_hai_submit_by_its_name_and_is_built_for_one_installation(c_front, tmp_path):
    other = tmp_path / "haix"
    other.symlink_to(c_front / "hai")
    p = subprocess.run([str(other), "--help"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and p.stdout == "" and len(p.stderr.splitlines()) == 1 and "hai-admin front" in p.stderr
    p = subprocess.run([str(BIN / "hai-admin"), "front", "install", "--bin-dir", str(BIN)], capture_output=True,
                       text=True)
    assert p.returncode != 0 and len(p.stderr.splitlines()) == 1 and "another directory" in p.stderr
    assert (BIN / "hai").read_bytes().startswith(b"#!")  # the console script is still there


def test_the_commands_preload_leaves_a_command_nothing_to_import_or_compile():
    """What `--preload slurm_hai.cli.preload` loads is all a command loads: a child of the
    service imports no module of slurm-hai, click or jinja2 and compiles no template."""
    code = textwrap.dedent('''
        import contextlib, io, json, sys
        import jinja2
        import slurm_hai.cli.preload
        from slurm_hai.cli.front import run_here
        compiled, compile_ = [], jinja2.Environment.compile
        jinja2.Environment.compile = lambda self, *a, **k: compiled.append(1) or compile_(self, *a, **k)
        before = set(sys.modules)
        for command, args in [("hai-submit", ["--dry-run", "--gpus-per-node", "0", "examples/train.py"]),
                              ("hai-submit", ["--dry-run", "--in-place", "-n", "1:2", "--gpus-per-node", "0",
                                              "examples/train.py"]),
                              ("hai-submit", ["-n", "x", "examples/train.py"]), ("hai", ["status", "x"]),
                              ("hai", ["list"]), ("hai", ["--help"])]:
            try:
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    run_here(command, args)
            except SystemExit:
                pass
        new = sorted(m for m in set(sys.modules) - before if m.split(".")[0] in ("slurm_hai", "jinja2", "click",
                                                                                 "markupsafe"))
        print(json.dumps({"new": new, "compiled": len(compiled)}))
    ''')
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={**os.environ, "HAI_POLICY": str(LOCAL_POLICY)})
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.splitlines()[-1]) == {"new": [], "compiled": 0}


def test_a_command_that_runs_here_after_all_keeps_its_own_signal_handlers(tmp_path):
    """The client's relay of signals, set up for a warm start, is taken down when none is
    made: Ctrl-C in a command that runs here is Python's KeyboardInterrupt again (`hai logs
    -f` says the job goes on), not the signal's default death."""
    import signal

    from slurm_hai.runtime.warm import RELAYED, run_if_warm

    earlier = signal.signal(signal.SIGINT, signal.default_int_handler)  # as a command starts (another test set one)
    try:
        before = {sig: signal.getsignal(sig) for sig in RELAYED}
        assert run_if_warm([sys.executable, "-m", "slurm_hai.cli", "hai", "--help"], str(tmp_path / "none.sock")) is None
        assert {sig: signal.getsignal(sig) for sig in RELAYED} == before
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, earlier)
