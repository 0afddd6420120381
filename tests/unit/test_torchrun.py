"""hai-submit --torchrun and the thread count pinned for a job's whole life, without Slurm.

The torchrun command per node comes from the HAI contract; two "nodes" on this host (two
launchers' NodeRuns with the contracts of node 0 and node 1) run real torchrun agents that
meet on the static rendezvous, and every process of node 0, none of node 1, sees the
suspend notice. The live 2-node preemption is tests/cluster/test_torchrun_live.py.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from slurm_hai.cli import submit as submit_cli
from slurm_hai.jobs.jobdir import JobDir
from slurm_hai.runtime.launcher import NodeRun, flag_path, notice_signals, pinned_threads
from slurm_hai.runtime.torchrun import agent_signals, torchrun_argv

from test_frontdoor_submit import exec_line, fake  # noqa: F401 - hai-submit's fake Slurm, as a fixture here

CONTRACT = {"WORLD_SIZE": "3", "RANK": "2", "NODE_RANK": "2", "MASTER_ADDR": "10.1.2.3", "MASTER_IP": "10.1.2.3",
            "MASTER_PORT": "41234"}


def test_torchrun_gets_nodes_node_rank_and_rank_0s_address_from_the_contract():
    argv = torchrun_argv("/usr/bin/python3", 8, CONTRACT, ["/w/train.py", "--lr", "0.1", "--nnodes=9"])
    assert argv[:3] == ["/usr/bin/python3", "-m", "torch.distributed.run"]
    opts = argv[3:argv.index("/w/train.py")]
    assert set(opts) == {"--nnodes=3", "--node-rank=2", "--nproc-per-node=8", "--rdzv-backend=static",
                         "--master-addr=10.1.2.3", "--master-port=41234", "--max-restarts=0"}
    assert argv[argv.index("/w/train.py"):] == ["/w/train.py", "--lr", "0.1", "--nnodes=9"]  # the script's own


def test_where_sigterm_is_the_notice_torchruns_agent_does_not_stop_its_workers_on_it():
    assert agent_signals(False).split(",") == ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"]
    assert agent_signals(True).split(",") == ["SIGINT", "SIGHUP", "SIGQUIT"]


def test_the_wrapper_becomes_torchrun_and_keeps_the_notice_from_its_agent_where_sigterm_is_the_notice(tmp_path):
    fake_python = tmp_path / "python"  # stands for the job's interpreter: says how it was started
    fake_python.write_text('#!/bin/sh\necho "$PET_SIGNALS_TO_HANDLE" "$TORCHELASTIC_SIGNALS_TO_HANDLE" "$@"\n')
    fake_python.chmod(0o755)
    env = {**os.environ, **CONTRACT}
    argv = [sys.executable, "-m", "slurm_hai.runtime.torchrun", "--nproc-per-node=2", f"--python={fake_python}", "--",
            "/w/train.py", "--x"]
    shown = {}
    for term_is_notice in (False, True):
        # the launcher starts the command with SIGTERM ignored where SIGTERM is the notice
        p = subprocess.run(argv, env=env, text=True, capture_output=True, timeout=30, preexec_fn=(
            (lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN)) if term_is_notice else None))
        assert p.returncode == 0, p.stderr
        shown[term_is_notice] = p.stdout.split()
    assert shown[False][:2] == ["SIGTERM,SIGINT,SIGHUP,SIGQUIT"] * 2 and shown[True][:2] == ["SIGINT,SIGHUP,SIGQUIT"] * 2
    assert shown[True][2:] == torchrun_argv(str(fake_python), 2, CONTRACT, ["/w/train.py", "--x"])[1:]


def test_the_wrapper_outside_a_job_says_what_is_missing():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run([sys.executable, "-m", "slurm_hai.runtime.torchrun", "--nproc-per-node=1", "--", "t.py"],
                       env=env, text=True, capture_output=True, timeout=30)
    assert p.returncode == 2 and "WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT not set" in p.stderr
    assert "Traceback" not in p.stderr


# ----------------------------------------------------------------------------- hai-submit


def submitted_command(out: str) -> list[str]:
    """The user's command, as the batch driver gets it after its own options."""
    line = exec_line(out)
    driver = line[line.index("slurm_hai.runtime.batch"):]
    return driver[driver.index("--") + 1:]


def test_hai_submit_torchrun_runs_torchrun_per_node_with_one_process_per_gpu(fake, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")  # no sign of several processes: torchrun starts them, no warning
    r = CliRunner().invoke(submit_cli.main, ["--dry-run", "--torchrun", "-n", "2", str(script), "--lr", "0.1"])
    assert r.exit_code == 0, r.output
    assert "single-process" not in r.output
    assert "#SBATCH --nodes=2" in r.output and "#SBATCH --ntasks-per-node=1" in r.output
    assert submitted_command(r.output) == [sys.executable, "-m", "slurm_hai.runtime.torchrun", "--nproc-per-node=8",
                                           f"--python={sys.executable}", "--", str(script), "--lr", "0.1"]


def test_hai_submit_torchrun_starts_one_process_on_a_cpu_node(fake, tmp_path):
    fake.gres = "(null)"
    (tmp_path / "policy.toml").write_text("min_gpus = 0\n")  # the fixture's policy file
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    r = CliRunner().invoke(submit_cli.main, ["--dry-run", "--torchrun", "--python", "python3", str(script)])
    assert r.exit_code == 0, r.output
    assert submitted_command(r.output)[3:5] == ["--nproc-per-node=1", "--python=python3"]


def test_hai_submit_torchrun_refuses_a_program_that_is_not_python(fake, tmp_path):
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/bash\necho 1\n")
    script.chmod(0o755)
    r = CliRunner().invoke(submit_cli.main, ["--dry-run", "--torchrun", str(script)])
    assert r.exit_code == 2 and "--torchrun runs a Python script" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- threads


def test_the_first_run_fixes_the_thread_count_and_every_later_run_uses_it(tmp_path, monkeypatch):
    jobdir = JobDir(tmp_path / "job").create()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "2")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert pinned_threads(jobdir) == 8  # 16 CPUs, 2 processes (one per GPU)
    assert (jobdir.path / "threads").read_text() == "8"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))  # requeued onto a smaller node
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "1")
    assert pinned_threads(jobdir) == 8
    assert [p.name for p in jobdir.path.iterdir() if "threads" in p.name] == ["threads"]  # no temporary left


def test_a_thread_count_the_job_sets_is_the_one_pinned(tmp_path, monkeypatch):
    jobdir = JobDir(tmp_path / "job").create()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert pinned_threads(jobdir) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # whatever a later run's environment says
    assert pinned_threads(jobdir) == 3


def test_a_node_that_records_second_takes_the_first_nodes_number(tmp_path, monkeypatch):
    jobdir = JobDir(tmp_path / "job").create()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("SLURM_GPUS_ON_NODE", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
    real_link = os.link

    def other_node_first(src, dst):
        (jobdir.path / "threads").write_text("6")  # node 1 recorded between our read and our link
        real_link(src, dst)

    monkeypatch.setattr(os, "link", other_node_first)
    assert pinned_threads(jobdir) == 6


def child_env(tmp_path: Path, jobdir: JobDir) -> dict[str, str]:
    out = tmp_path / "env.txt"
    cmd = [sys.executable, "-c", f"import os; open({str(out)!r}, 'w').write(os.environ['OMP_NUM_THREADS'] + ' ' "
                                 "+ os.environ['MKL_NUM_THREADS'])"]
    node = NodeRun(cmd, {"PATH": os.environ["PATH"]}, jobdir, 0, 0, 5.0, notice_signals("USR2", False),
                   flag=None)
    node.start()
    assert node.child.wait(30) == 0
    return out.read_text().split()


def test_every_run_of_the_command_gets_the_pinned_count(tmp_path, monkeypatch):
    jobdir = JobDir(tmp_path / "job").create()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("SLURM_GPUS_ON_NODE", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)))
    assert child_env(tmp_path, jobdir) == ["6", "6"]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2)))
    assert child_env(tmp_path, jobdir) == ["6", "6"]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


SESSION_CHILD = """
import os, signal, subprocess, sys, time
worker = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
p = subprocess.Popen([sys.executable, "-c", worker], start_new_session=True)  # as torchrun starts a worker
open(sys.argv[1], "w").write(str(p.pid))
time.sleep(60)
"""


def test_ending_a_run_also_stops_processes_in_sessions_of_their_own(tmp_path, monkeypatch):
    """Where SIGTERM is the notice, the launcher ends a run with SIGKILL: torchrun's workers
    (own sessions, SIGTERM ignored) must go with their agent, not outlive the run."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    jobdir = JobDir(tmp_path / "job").create()
    pid_file = tmp_path / "worker.pid"
    node = NodeRun([sys.executable, "-c", SESSION_CHILD, str(pid_file)], dict(os.environ), jobdir, 0, 0, 5.0,
                   notice_signals("USR2", True), flag=None)
    node.start()
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    worker = int(pid_file.read_text())
    assert os.getsid(worker) == worker != os.getsid(node.child.pid)  # out of the command's group and session
    node.end()
    node.child.wait(10)
    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(worker)


# ----------------------------------------------------------------------------- two nodes, real torchrun

WORKER = """
import os, time
import slurm_hai.runtime.client as hai
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_IP",
        "HAI_RESTART_COUNT", "OMP_NUM_THREADS")
print("worker " + " ".join(f"{k}={os.environ.get(k)}" for k in keys), flush=True)
deadline = time.monotonic() + 60
while os.environ.get("HAI_SUSPEND_FLAG") and not hai.receive_suspend_command() and time.monotonic() < deadline:
    time.sleep(0.05)
print(f"worker RANK={os.environ['RANK']} notice={hai.receive_suspend_command()}", flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_lines(log: Path) -> list[dict[str, str]]:
    text = log.read_text() if log.exists() else ""
    return [dict(kv.split("=", 1) for kv in line.split()[1:]) for line in text.splitlines()
            if line.startswith("worker ")]


def test_two_nodes_of_torchrun_ranks_as_torchrun_users_expect_and_node_0_gets_the_notice(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "2")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    jobdir = JobDir(tmp_path / "job").create()
    port = str(free_port())
    nodes = []
    for rank in (0, 1):
        env = {**os.environ, "WORLD_SIZE": "2", "RANK": str(rank), "NODE_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_IP": "127.0.0.1", "MASTER_PORT": port, "HAI_RESTART_COUNT": "0", "HAI_JOB_DIR": str(jobdir.path)}
        cmd = [sys.executable, "-m", "slurm_hai.runtime.torchrun", "--nproc-per-node=2", "--", str(script)]
        node = NodeRun(cmd, env, jobdir, 0, rank, 5.0, notice_signals("USR2", False),
                       flag=flag_path(f"test{os.getpid()}", 0) if rank == 0 else None)
        node.start()
        nodes.append(node)
    try:
        deadline = time.monotonic() + 120
        while len(worker_lines(jobdir.rank_log(0))) < 2 and time.monotonic() < deadline:
            assert nodes[0].child.poll() is None, jobdir.rank_log(0).read_text()
            time.sleep(0.1)
        nodes[0].notice("test")
        codes = [node.child.wait(max(1.0, deadline - time.monotonic())) for node in nodes]
    finally:
        for node in nodes:
            if node.child.poll() is None:
                node.end()
                node.child.wait(10)
            if node.flag is not None:
                node.flag.unlink(missing_ok=True)
    logs = [jobdir.rank_log(r).read_text() for r in (0, 1)]
    assert codes == [0, 0], logs
    by_rank = {}
    for node_rank in (0, 1):
        for w in worker_lines(jobdir.rank_log(node_rank)):
            by_rank.setdefault(int(w["RANK"]), {}).update(w, node=str(node_rank))
    assert sorted(by_rank) == [0, 1, 2, 3], logs
    for rank, w in by_rank.items():
        # torchrun's meaning: global process rank and count; the contract's node rank kept
        assert (w["WORLD_SIZE"], w["LOCAL_WORLD_SIZE"]) == ("4", "2")
        assert w["LOCAL_RANK"] == str(rank % 2) and w["GROUP_RANK"] == w["NODE_RANK"] == w["node"] == str(rank // 2)
        assert w["MASTER_IP"] == "127.0.0.1" and w["HAI_RESTART_COUNT"] == "0"
        assert w["OMP_NUM_THREADS"] == (jobdir.path / "threads").read_text()
        assert w["notice"] == str(rank < 2), logs  # every process of node 0, none elsewhere
    assert re.search(r"==== slurm-hai run 0 rank 1 on ", logs[1])


def test_init_process_group_joins_torchruns_store_under_torchrun(monkeypatch):
    import torch.distributed as dist

    from slurm_hai.runtime import distributed

    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "hai-1")
    distributed.init_process_group("gloo", timeout_seconds=7)
    assert calls[-1][0] == ("gloo",) and "init_method" not in calls[-1][1]  # env://: torchrun's store
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("MASTER_IP", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "41000")
    distributed.init_process_group("gloo")
    assert calls[-1][1]["init_method"] == "tcp://10.0.0.1:41000"  # HAI-style: the contract's address
