"""Training across sizes with parts (slurm_hai/runtime/parts.py), real torchft, no Slurm: three
parts of job 7 under the job's lighthouse from the lighthouse service; part 2 leaves and the
other two train on; part 2 starts again, heals from a live peer and the three end together.
Part 2 leaves at its notice (SIGTERM, wherever it is then), or is killed (SIGKILL) right
after it started a step's allreduce. Every part ends bitwise equal to the others, and within
1e-9 of a one-process run of the same global batches (float64). Parts that start from
different weights stop at step 0 (StartedApart). tests/cluster will run parts as tasks."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from munge_fake import Unmunge, fake_munge
from slurm_hai.controller.lighthouse import Service, serve
from squeue_text import fake_squeue, recorded_rows
from slurm_hai.checkpoint import CheckpointError
from slurm_hai.runtime.parts import EXIT_BELOW_MIN, EXIT_LIGHTHOUSE_LOST, EXIT_TIME_LIMIT, LEAVE_AT_ENV, \
    TORCHFT_RUST_LOG, Part, PartError, batch_share, leave_time

STEPS, BATCH, FEATURES = 120, 12, 6

PART = r'''
import json, logging, os, sys, time
from datetime import timedelta
import torch
from torchft.optim import OptimizerWrapper
from slurm_hai.runtime.parts import join, leave_on

out, steps, batch, features = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
index = int(os.environ["SLURM_ARRAY_TASK_ID"])
log = open(os.path.join(out, f"part{index}.log"), "a")
def note(**kw):
    log.write(json.dumps({"part": index, "t": time.time(), **kw}) + "\n"); log.flush()
leave_on()
kill_at = int(os.environ.get("KILL_AT", "-1"))  # the step whose allreduce this part dies in
torch.manual_seed(int(os.environ.get("SEED", "0")))
model = torch.nn.Linear(features, 1, dtype=torch.float64)
inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
data = torch.Generator().manual_seed(1)
X = torch.randn(steps * batch, features, generator=data, dtype=torch.float64)
Y = torch.randn(steps * batch, 1, generator=data, dtype=torch.float64)
def save():
    return {"model": model.state_dict(), "opt": inner.state_dict()}
def load(state):
    model.load_state_dict(state["model"]); inner.load_state_dict(state["opt"]); note(event="healed")
ckpt, save_every = os.environ.get("CKPT"), int(os.environ.get("SAVE_EVERY", "0"))
part = join(save, load, checkpoint_dir=ckpt, quorum_timeout=timedelta(seconds=float(os.environ.get("QUORUM_S", "60"))))
opt = OptimizerWrapper(part.manager, inner)
note(event="joined")
if os.environ.get("USER_LOGS"):  # a user who logs at INFO, and a warning of torchft's own
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
    logging.getLogger("train").info("the user's line")
    logging.getLogger("torchft.manager").warning("a warning of torchft's")
resumed = False
while part.manager.current_step() < steps:
    while os.path.exists(os.path.join(out, "hold")):  # the test's pause: no quorum asked meanwhile
        time.sleep(0.02)
    if os.path.exists(os.path.join(out, "leave_at")):  # the test's: a time to leave, as a task's script gives it
        part.leave_at = float(open(os.path.join(out, "leave_at")).read())
    opt.zero_grad()
    share = part.share(batch)  # after this step's quorum (and a heal): the step is the quorum's
    if part.resumed_at is not None and not resumed:
        resumed = note(event="resumed", step=part.resumed_at) or True
    step = part.manager.current_step()
    x, y = X[step * batch:(step + 1) * batch], Y[step * batch:(step + 1) * batch]
    if share is not None:
        ((model(x[share]) - y[share]).pow(2).sum() / batch).backward()
    if step == kill_at:
        part.manager.allreduce(torch.cat([p.grad.flatten() for p in model.parameters()]))
        os.kill(os.getpid(), 9)
    part.sum_gradients(model.parameters())
    opt.step()
    if save_every and part.save_every(save_every):
        note(event="saved", step=part.manager.current_step())
    note(event="step", step=step, n=part.manager.num_participants(), healing=share is None,
         committed=part.manager.current_step() > step)
    time.sleep(0.02)
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
note(event="end", weights=[w.hex() for w in weights.tolist()])
part.exit()
'''


def reference() -> list[float]:
    """The one-process run of the same global batches."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(1)
    X = torch.randn(STEPS * BATCH, FEATURES, generator=data, dtype=torch.float64)
    Y = torch.randn(STEPS * BATCH, 1, generator=data, dtype=torch.float64)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = X[step * BATCH:(step + 1) * BATCH], Y[step * BATCH:(step + 1) * BATCH]
        ((model(x) - y).pow(2).sum() / BATCH).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def records(out: Path) -> list[dict]:
    rows = []
    for f in sorted(out.glob("part*.log")):
        rows += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return rows


def second_run(rows: list[dict], part: int) -> list[dict]:
    """The records of `part` from its second join on."""
    mine = [r for r in rows if r["part"] == part]
    return mine[[i for i, r in enumerate(mine) if r["event"] == "joined"][1]:]


@contextlib.contextmanager
def stderr_on_failure(out: Path):
    """A failed assertion inside shows the parts' stderr tails."""
    try:
        yield
    except AssertionError as e:
        raise AssertionError(f"{e}\n" + "\n".join(f.read_text()[-3000:] for f in sorted(out.glob("stderr*")))) from None


def wait_for(what, cond, procs, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        dead = [p.args for p in procs if p.poll() not in (None, -signal.SIGTERM, -signal.SIGKILL)]
        if dead or time.monotonic() > deadline:
            raise AssertionError(f"waiting for {what}: {'a part failed' if dead else 'timed out'}")
        time.sleep(0.05)
    return value


@pytest.mark.parametrize("rows, parts", [(12, 3), (12, 2), (7, 3), (2, 3), (1, 1)])
def test_a_batch_is_shared_whole_in_order(rows, parts):
    shares = [batch_share(rows, k, parts) for k in range(parts)]
    assert [i for s in shares for i in range(rows)[s]] == list(range(rows))
    assert max(len(range(rows)[s]) for s in shares) - min(len(range(rows)[s]) for s in shares) <= 1
    with pytest.raises(ValueError):
        batch_share(rows, parts, parts)


@pytest.mark.parametrize("given, leave_at", [(None, math.inf), ("", math.inf), ("1795911820.5", 1795911820.5),
                                              ("soon", None)])
def test_a_part_leaves_for_its_tasks_limit_at_the_time_its_environment_says(given, leave_at):
    env = {} if given is None else {LEAVE_AT_ENV: given}
    if leave_at is None:
        with pytest.raises(PartError, match="HAI_PART_LEAVE_AT='soon': expected seconds since the epoch"):
            leave_time(env)
    else:
        assert leave_time(env) == leave_at


def test_a_part_whose_leaving_commit_fails_says_so_and_leaves_all_the_same(capsys):
    """A full disk as a part leaves below MIN (or with its lighthouse lost): one line, and the
    exit that requeues its task; the job resumes from an earlier commit."""
    class Manager:
        def current_step(self):
            return 5

        def state_dict(self):
            return {}

    class FullDisk:
        def save(self, step, state):
            raise CheckpointError(f"writing step {step}: no space left on device")

    part = Part(7, 1, Manager(), None, checkpoints=FullDisk(), state_dict=lambda: {}, min_parts=2,
                lighthouse="http://h:1")

    def exit(code=0):
        raise SystemExit(code)

    part.exit = exit  # type: ignore[method-assign]
    with pytest.raises(SystemExit) as left:
        part.below_min("(Slurm runs 1 of the job's parts)")
    assert left.value.code == EXIT_BELOW_MIN
    assert capsys.readouterr().err == (
        "slurm-hai: part 1 of job 7: fewer than 2 parts (Slurm runs 1 of the job's parts); step 5 could not be "
        "committed (writing step 5: no space left on device); it leaves, and the job waits for 2 nodes\n")


@pytest.fixture
def parts(tmp_path):
    """start(index, **env): a part of job 7 (this user's) as a process, under the job's
    lighthouse from a lighthouse service in this process, asked with a fake MUNGE credential
    (munge_fake.py); the parts' records are in `start.out`; `start.service(False)` stops the
    service, `start.service(True)` starts it again."""
    state, out, munge_bin = tmp_path / "lighthouses", tmp_path / "out", tmp_path / "munge-bin"
    out.mkdir()
    munge_bin.mkdir()
    fake_munge(munge_bin)
    script = tmp_path / "part.py"
    script.write_text(PART)
    service = Service(state, ended=lambda ids: set(), owner=lambda job: os.geteuid())
    unmunge = Unmunge()
    port: list[int] = []
    stop = [threading.Event()]
    thread: list[threading.Thread] = []

    def serving(on: bool) -> None:
        if not on:  # stopped, and its port closed
            stop[0].set()
            thread.pop().join(10)
            return
        stop[0] = threading.Event()
        ready = threading.Event()
        thread.append(threading.Thread(target=serve, args=(service, "127.0.0.1", port[0] if port else 0, 60.0),
                                       kwargs={"ready": lambda p: (port[:1] or port.append(p), ready.set()),
                                               "stop": stop[0], "identify": unmunge}, daemon=True))
        thread[0].start()
        assert ready.wait(10), "the lighthouse service did not start"

    serving(True)
    env = {**os.environ, "HAI_LIGHTHOUSE_SERVICE": f"http://127.0.0.1:{port[0]}", "SLURM_ARRAY_JOB_ID": "7",
           "PATH": f"{munge_bin}:{os.environ['PATH']}"}
    started: list[subprocess.Popen] = []

    def start(index: int, **more: str) -> subprocess.Popen:
        started.append(subprocess.Popen(
            [sys.executable, str(script), str(out), str(STEPS), str(BATCH), str(FEATURES)],
            env={**env, "SLURM_ARRAY_TASK_ID": str(index), **more}, stderr=(out / f"stderr{index}").open("a")))
        return started[-1]

    start.out = out  # type: ignore[attr-defined]
    start.service = serving  # type: ignore[attr-defined]
    try:
        yield start
    finally:
        stop[0].set()
        for p in started:
            if p.poll() is None:
                p.kill()
        for path in state.glob("*.json"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(json.loads(path.read_text())["pid"], signal.SIGKILL)


@pytest.mark.parametrize("leaves", ["at its notice", "killed in an allreduce"])
def test_a_part_leaves_the_others_train_on_it_heals_and_all_end_as_one_process(parts, leaves):
    out = parts.out
    (out / "hold").touch()  # the three start step 0 together (the first to join would train alone)
    procs = [parts(0), parts(1), parts(2, **({"KILL_AT": "8"} if leaves == "killed in an allreduce" else {}))]
    with stderr_on_failure(out):
        def steps_of(part: int, n: int) -> list[int]:
            return [r["step"] for r in records(out) if r["event"] == "step" and r["part"] == part and r["n"] == n]

        wait_for("the three to join", lambda: sum(r["event"] == "joined" for r in records(out)) == 3, procs)
        (out / "hold").unlink()

        if leaves == "at its notice":
            wait_for("three parts in one quorum", lambda: all(len(steps_of(p, 3)) >= 3 for p in range(3)), procs)
            procs[2].send_signal(signal.SIGTERM)  # the notice: part 2 leaves, dying of it at once
            assert procs[2].wait(30) == -signal.SIGTERM
        else:
            assert procs[2].wait(120) == -signal.SIGKILL
            assert steps_of(2, 3)[-1] == 7  # it had trained with the others up to the step it died in
        gone = time.time()
        wait_for("the other two to train on as two", lambda: all(len(steps_of(p, 2)) >= 5 for p in (0, 1)), procs)
        # within seconds, not the step timeout (30 s): a part whose allreduce failed closes its
        # connections at once, so the other, which may wait on it in gloo's ring, fails too
        for part in (0, 1):
            first = min(r["t"] for r in records(out) if r["event"] == "step" and r["part"] == part and r["n"] == 2)
            assert first - gone < 10, (part, first - gone)
        (out / "hold").touch()  # hold the two between steps until part 2 has joined again
        procs[2] = parts(2)
        wait_for("part 2 to join again", lambda: sum(r["event"] == "joined" and r["part"] == 2
                                                     for r in records(out)) == 2, procs)
        (out / "hold").unlink()
        for p in procs:
            assert p.wait(180) == 0

    rows = records(out)
    assert any(r["event"] == "healed" and r["part"] == 2 for r in rows)  # from a live peer's state
    # part 2's second run: its first step heals (the two compute it), then it is one of three
    again = [r for r in second_run(rows, 2) if r["event"] == "step"]
    assert again[0]["healing"] and again[0]["n"] == 2 and again[0]["step"] == max(steps_of(0, 2))
    assert {(r["n"], r["healing"]) for r in again[1:]} == {(3, False)}
    ends = {r["part"]: [float.fromhex(w) for w in r["weights"]] for r in rows if r["event"] == "end"}
    assert sorted(ends) == [0, 1, 2]
    assert ends[0] == ends[1] == ends[2]  # bitwise
    one = reference()
    assert max(abs(a - b) for a, b in zip(ends[0], one)) < 1e-9
    assert ends[0] != [float(w) for w in torch_init()]  # it trained
    if leaves == "killed in an allreduce":
        # the step it died in: not committed and taken again by the two, or committed by the
        # three if its share had gone out before it died
        tries = [(r["n"], r["committed"]) for r in rows if r["event"] == "step" and r["part"] == 0 and r["step"] == 8]
        assert tries in ([(3, False), (2, True)], [(3, True)]), tries


def test_a_lost_lighthouse_every_part_leaves_and_the_job_resumes_from_its_last_commit_exact(parts, tmp_path):
    """The job's lighthouse dies while the lighthouse service is away too (were it there,
    each task's script would end its part as the service hands out a new lighthouse:
    runtime/part_task.py, tests/cluster/test_parts.py). The parts find it cannot be reached
    as they wait for their next quorum (their quorum timeout is 60 s): each commits the job's
    last committed step and leaves with EXIT_LIGHTHOUSE_LOST (on a cluster its task is
    requeued). Started again with the service back, the parts get a new lighthouse, meet at
    step 0 with nobody ahead, resume from that commit and end as one process would, bitwise
    equal."""
    out, ckpt = parts.out, tmp_path / "ckpt"
    env = {"CKPT": str(ckpt), "SAVE_EVERY": "10"}
    (out / "hold").touch()
    procs = [parts(i, **env) for i in range(3)]
    with stderr_on_failure(out):
        wait_for("the three to join", lambda: sum(r["event"] == "joined" for r in records(out)) == 3, procs)
        (out / "hold").unlink()
        wait_for("two commits", lambda: len([r for r in records(out) if r["event"] == "saved"]) >= 2, procs)
        parts.service(False)
        lighthouse = json.loads(next((tmp_path / "lighthouses").glob("*.json")).read_text())["pid"]
        os.kill(lighthouse, signal.SIGKILL)
        lost = time.monotonic()
        for p in procs:
            assert p.wait(60) == EXIT_LIGHTHOUSE_LOST
        assert time.monotonic() - lost < 20  # not their quorum timeout
        rows = records(out)
        done = max(r["step"] for r in rows if r["event"] == "step" and r["committed"]) + 1
        said = [(out / f"stderr{i}").read_text() for i in range(3)]
        assert all("cannot be reached" in text and "it leaves, and the job comes back under a new one" in text
                   for text in said)
        assert sum(f"committed step {done};" in text for text in said) <= 1  # or the periodic commit had it
        assert not [r for r in rows if r["event"] == "end"]
        parts.service(True)
        rows = resume_all_three(parts, env, done)
    for part in range(3):  # the second run takes up at the commit, not at step 0
        assert [r["step"] for r in second_run(rows, part) if r["event"] == "step"][0] == done


def resume_all_three(parts, env: dict[str, str], done: int) -> list[dict]:
    """Start the three parts again (each waits until all have joined): they meet at step 0
    with nobody ahead, all three resume from the commit of step `done`, and they end bitwise
    equal and within 1e-9 of one process. The parts' records."""
    out = parts.out
    (out / "hold").touch()
    procs = [parts(i, **env) for i in range(3)]
    wait_for("the three to join again", lambda: sum(r["event"] == "joined" for r in records(out)) == 6, procs)
    (out / "hold").unlink()
    for p in procs:
        assert p.wait(180) == 0
    rows = records(out)
    assert sorted(r["part"] for r in rows if r["event"] == "resumed" and r["step"] == done) == [0, 1, 2]
    ends = {r["part"]: [float.fromhex(w) for w in r["weights"]] for r in rows if r["event"] == "end"}
    assert ends[0] == ends[1] == ends[2]  # bitwise
    assert max(abs(a - b) for a, b in zip(ends[0], reference())) < 1e-9
    return rows


def test_at_their_tasks_time_limit_the_parts_commit_and_leave_and_the_job_resumes_from_that_commit(parts, tmp_path):
    """Parts that started together reach their tasks' time limit together: each task's script
    gives its part the time to leave at (runtime/part_task.py). Each part leaves at its next step
    with EXIT_TIME_LIMIT (on a cluster its task is requeued with a whole limit), the job's last
    committed step committed by one of them, between two periodic commits. Started again,
    they meet at step 0 with nobody ahead, resume from that commit and end as one process."""
    out, ckpt = parts.out, tmp_path / "ckpt"
    env = {"CKPT": str(ckpt), "SAVE_EVERY": "50"}
    (out / "hold").touch()
    procs = [parts(i, **env) for i in range(3)]
    with stderr_on_failure(out):
        wait_for("the three to join", lambda: sum(r["event"] == "joined" for r in records(out)) == 3, procs)
        (out / "hold").unlink()
        wait_for("twelve steps", lambda: len([r for r in records(out) if r["event"] == "step" and r["committed"]
                                              and r["part"] == 0]) >= 12, procs)
        (out / "leave_at.new").write_text(str(time.time()))
        (out / "leave_at.new").rename(out / "leave_at")  # whole, as a part may read it at any moment
        for p in procs:
            assert p.wait(60) == EXIT_TIME_LIMIT
        (out / "leave_at").unlink()  # their next runs have a whole time limit
        rows = records(out)
        done = max(r["step"] for r in rows if r["event"] == "step" and r["committed"]) + 1
        assert 12 <= done < 50 and not [r for r in rows if r["event"] == "saved"]  # no periodic commit yet
        said = [(out / f"stderr{i}").read_text() for i in range(3)]
        assert all("its task reaches its time limit" in text and "its task is requeued with a whole time limit"
                   in text for text in said)
        assert sum(f"committed step {done};" in text for text in said) == 1  # one commit of the step
        resume_all_three(parts, env, done)


def in_slurm(bin_dir: Path, running: int, pending: int) -> dict[str, str]:
    """A fake squeue on PATH for the parts, in which Slurm runs job 7's tasks 1007.. (the
    first is the part given SLURM_JOB_ID=1007) and holds the rest pending."""
    (row,) = [r for r in recorded_rows("22.05.8") if r["State"] == "RUNNING"][:1]
    rows = [{**row, "JobId": str(1007 + k), "ArrayJobID": "7", "State": "RUNNING" if k < running else "PENDING"}
            for k in range(running + pending)]
    bin_dir.mkdir()
    fake_squeue(bin_dir, rows)
    fake_munge(bin_dir)  # this PATH replaces the parts fixture's
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "1007", "HAI_SLURM_BACKEND": "cli"}


@pytest.mark.parametrize("found", ["in Slurm", "by its quorum timeout"])
def test_below_min_no_part_trains_and_the_job_resumes_from_the_commit_of_the_part_that_left(parts, tmp_path, found):
    """MIN 2 of 2. Part 0 starts alone and waits: its first step is one of two. After two
    commits part 1 leaves at its notice; part 0, below MIN, commits the job's last committed
    step and exits EXIT_BELOW_MIN (its task would be requeued): at once when Slurm says that
    it runs one of the job's parts (a fake squeue here; its quorum timeout is 60 s), else
    after its quorum timeout (20 s). Both start again, resume from that commit and end as one
    process would."""
    out, ckpt = parts.out, tmp_path / "ckpt"
    env = {"CKPT": str(ckpt), "SAVE_EVERY": "10", "HAI_PARTS_MIN": "2", "QUORUM_S": "20"}
    slurm = in_slurm(tmp_path / "bin", running=1, pending=1) if found == "in Slurm" else {}
    with stderr_on_failure(out):
        procs = [parts(0, **{**env, **slurm, "QUORUM_S": "60" if slurm else "20"})]
        wait_for("part 0 to join", lambda: any(r["event"] == "joined" for r in records(out)), procs)
        procs.append(parts(1, **env))
        wait_for("two commits", lambda: len([r for r in records(out) if r["event"] == "saved"]) >= 2, procs)
        first = [r for r in records(out) if r["event"] == "step" and r["part"] == 0]
        assert first[0]["step"] == 0 and {r["n"] for r in first} == {2}  # never alone
        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(30) == -signal.SIGTERM
        left = time.monotonic()
        assert procs[0].wait(120) == EXIT_BELOW_MIN
        waited = time.monotonic() - left
        done = max(r["step"] for r in records(out) if r["event"] == "step" and r["committed"]) + 1
        said = (out / "stderr0").read_text()
        if slurm:
            assert "slurm-hai: part 0 of job 7: fewer than 2 parts (Slurm runs 1 of the job's parts)" in said
            assert waited < 15, waited  # not its quorum timeout
        else:
            assert "slurm-hai: part 0 of job 7: fewer than 2 parts for 20 s" in said and waited >= 19
        assert not [r for r in records(out) if r["event"] == "end"]
        procs = [parts(0, **env), parts(1, **env)]
        for p in procs:
            assert p.wait(180) == 0
    rows = records(out)
    # the commit of the part that left, or the same step's periodic one: nothing lost, nothing twice
    assert sorted(r["part"] for r in rows if r["event"] == "resumed" and r["step"] == done) == [0, 1]
    ends = {r["part"]: [float.fromhex(w) for w in r["weights"]] for r in rows if r["event"] == "end"}
    assert ends[0] == ends[1]  # bitwise
    assert max(abs(a - b) for a, b in zip(ends[0], reference())) < 1e-9


def test_a_parts_log_holds_the_users_lines_and_torchfts_warnings_not_its_info_nor_an_nccl_warning(parts):
    """A part runs with the environment its task gives its step (RUST_LOG, part_task.py), on
    this machine's CPU build of torch, and its user logs at INFO: torchft's INFO lines (from
    its Rust core and its Manager, several a step) stay out, and so does its warning that it
    cannot reset NCCL's flight recorder (a part's process group is gloo's)."""
    part = parts(0, USER_LOGS="1", RUST_LOG=TORCHFT_RUST_LOG)
    assert part.wait(120) == 0
    lines = (parts.out / "stderr0").read_text().splitlines()
    assert lines == ["INFO train the user's line", "WARNING torchft.manager a warning of torchft's"], lines[:20]


def test_parts_that_start_from_different_weights_stop_at_step_0(parts):
    """(A part that joins after step 0 takes a live peer's state instead: nothing to check.)"""
    (parts.out / "hold").touch()
    procs = [parts(0), parts(1, SEED="1")]
    wait_for("the two to join", lambda: sum(r["event"] == "joined" for r in records(parts.out)) == 2, procs)
    (parts.out / "hold").unlink()
    for p in procs:
        assert p.wait(120) == 1
    for i in (0, 1):
        err = (parts.out / f"stderr{i}").read_text()
        assert "StartedApart: job 7: the parts started from different weights; seed the model's initialization" in err
    assert not [r for r in records(parts.out) if r["event"] == "step"]


def torch_init() -> list[float]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1, dtype=torch.float64)
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


class Joined(Exception):
    """Stands for join(): the example got as far as joining the job's lighthouse."""


def test_the_in_place_example_makes_its_out_directory(tmp_path, monkeypatch):
    """examples/parts_train.py, run as a part with an --out that does not exist yet (as the
    README's `--out ~/parts` on a first run): each part makes it, and its log is there before
    the part joins. Without the mkdir the part fails opening its log."""
    import importlib.util

    import slurm_hai.runtime.parts as parts_module

    spec = importlib.util.spec_from_file_location(
        "parts_train", Path(__file__).resolve().parents[2] / "examples" / "parts_train.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    def join(*args, **kwargs):
        raise Joined

    monkeypatch.setattr(parts_module, "join", join)
    monkeypatch.setattr(parts_module, "leave_on", lambda: None)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    out = tmp_path / "not" / "yet"
    monkeypatch.setattr(sys, "argv", ["parts_train.py", "--steps", "2", "--out", str(out)])
    with pytest.raises(Joined):
        example.main()
    assert (out / "part3.log").is_file()
