"""Suspend saves into node memory and the persist agent (memory.py, agent.py).

The nodes are simulated: each rank is told its node (SLURMD_NODENAME) and gets that node's
memory directory and agent spool. The live proof, with real nodes that each have their own
/dev/shm, is tests/cluster/test_suspend_memory.py."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from test_checkpoint_sharded import STEP, expected_values, init_gloo, make_state, train_two_steps
from test_checkpoint_sharded_async import spawn

from slurm_hai.checkpoint import CheckpointManager, verify_checkpoint
from slurm_hai.checkpoint import memory
from slurm_hai.checkpoint.agent import Agent, prepare_spool
from slurm_hai.checkpoint.errors import CheckpointError
from slurm_hai.checkpoint.manifest import list_step_dirs, step_dir_name


def node_of(rank: int) -> str:
    return f"n{rank // 2 + 1}"  # two ranks per node


def on_node(base: Path, node: str) -> Path:
    """Point this process at node `node`: its name, its agent's spool. Returns its memory."""
    os.environ["SLURMD_NODENAME"] = node
    os.environ["HAI_PERSIST_SPOOL"] = str(base / node / "spool")
    return base / node / "shm"


def start_agent(base: Path, node: str) -> Agent:
    spool = base / node / "spool"
    prepare_spool(spool)
    memory.write_agent_pidfile(spool)  # this test process stands in for the node's agent
    return Agent(spool)


def run_agent(base: Path, node: str) -> None:
    start_agent(base, node).serve(poll=0.02, once=True)


def single_state(value: float) -> dict:
    return {"w": torch.full((1000,), value), "b": torch.arange(7, dtype=torch.int64) * int(value), "step": int(value)}


@pytest.fixture(autouse=True)
def short_peer_grace(monkeypatch):
    """An agent holding a peer copy waits this long for the share's own agent (10 s in
    production); the agents' children inherit it."""
    monkeypatch.setenv("HAI_PEER_GRACE_S", "0.5")


@pytest.fixture
def one_node(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    monkeypatch.setenv("HAI_PERSIST_SPOOL", str(tmp_path / "n1" / "spool"))
    return tmp_path


def test_a_suspend_save_lands_in_node_memory_and_the_agent_commits_it_durably(one_node):
    durable, fast = one_node / "durable", one_node / "n1" / "shm"
    agent = start_agent(one_node, "n1")
    mgr = CheckpointManager(durable, fast_dir=fast)
    mgr.save(1, single_state(1.0))
    handle = mgr.suspend_save(2, single_state(2.0))
    assert handle.done() and not handle.skipped
    assert list_step_dirs(durable) == [(1, durable / step_dir_name(1))]  # not durable yet
    assert (durable / ".persisting-000000000002.json").exists()
    # a restart on the same node loads it from memory, before the agent ran
    again = CheckpointManager(durable, fast_dir=fast)
    assert again.load()["step"] == 2 and again.loaded_step == 2
    agent.serve(poll=0.02, once=True)
    assert verify_checkpoint(durable / step_dir_name(2)).ok
    assert not (durable / ".persisting-000000000002.json").exists()
    assert not list(durable.glob(".persist-*")) and not list((one_node / "n1" / "spool").glob("*-*.json"))
    # a restart on another node (empty memory) loads the durable copy, equal to what was saved
    elsewhere = CheckpointManager(durable, fast_dir=one_node / "n2" / "shm")
    state = elsewhere.load()
    assert elsewhere.loaded_step == 2 and torch.equal(state["b"], single_state(2.0)["b"])


def test_a_restart_elsewhere_waits_for_the_agent_instead_of_loading_an_older_step(one_node):
    durable = one_node / "durable"
    agent = start_agent(one_node, "n1")
    mgr = CheckpointManager(durable, fast_dir=one_node / "n1" / "shm")
    mgr.save(1, single_state(1.0))
    mgr.suspend_save(2, single_state(2.0))
    late = threading.Timer(1.0, lambda: agent.serve(poll=0.02, once=True))
    late.start()
    start = time.monotonic()
    elsewhere = CheckpointManager(durable, fast_dir=one_node / "n2" / "shm")
    assert elsewhere.load()["step"] == 2
    assert time.monotonic() - start >= 0.9
    late.join()


def test_when_the_agent_never_commits_the_restart_falls_back_to_the_newest_durable_step(one_node, monkeypatch, caplog):
    durable = one_node / "durable"
    start_agent(one_node, "n1")
    mgr = CheckpointManager(durable, fast_dir=one_node / "n1" / "shm")
    mgr.save(1, single_state(1.0))
    mgr.suspend_save(2, single_state(2.0))
    monkeypatch.setattr(memory, "PENDING_WAIT_S", 0.5)
    monkeypatch.setattr(memory.wait_for_pending, "__defaults__", (0.5,))
    with caplog.at_level(logging.WARNING):
        assert CheckpointManager(durable, fast_dir=one_node / "n2" / "shm").load()["step"] == 1
    assert "step 2 was saved to node memory but has not reached" in caplog.text
    assert not list(durable.glob(".persisting-*"))  # given up once: the next restart does not wait again


def test_without_an_agent_a_suspend_save_is_a_blocking_durable_save(one_node, caplog):
    durable = one_node / "durable"
    mgr = CheckpointManager(durable, fast_dir=one_node / "n1" / "shm")
    with caplog.at_level(logging.WARNING):
        mgr.suspend_save(3, single_state(3.0))
    assert "no persist agent on n1: saving step 3" in caplog.text
    assert verify_checkpoint(durable / step_dir_name(3)).ok
    assert not list((one_node / "n1" / "shm" / "parts").glob("step-*"))


def test_a_single_process_suspend_writes_over_the_memory_reserved_for_it(one_node):
    durable, fast = one_node / "durable", one_node / "n1" / "shm"
    start_agent(one_node, "n1")
    state = {"w": torch.randn(3, 1 << 18), "b": torch.arange(5)}
    mgr = CheckpointManager(durable, fast_dir=fast)
    mgr.reserve_node_memory(state, wait=True)
    spare = fast / "spares" / "own-0"
    assert spare.stat().st_size > state["w"].nbytes  # reserved ahead, with room for the header
    inode = spare.stat().st_ino
    assert mgr.suspend_save(4, state).where == "node memory"
    part = fast / "parts" / step_dir_name(4)
    written = part / "state.safetensors"
    assert written.stat().st_ino == inode and not spare.exists()  # the spare's pages, written over
    manifest = memory.read_part(part).manifest
    assert written.stat().st_size == manifest.files["state.safetensors"].size  # cut after the data
    loaded = CheckpointManager(durable, fast_dir=fast).load()
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])


def suspended_after_one_durable_save(base: Path) -> tuple[Path, Path]:
    """Step 1 saved durably, step 2 suspended into n1's memory (its agent not run yet):
    (the durable directory, step 2's part)."""
    durable = base / "durable"
    start_agent(base, "n1")
    mgr = CheckpointManager(durable, fast_dir=base / "n1" / "shm")
    mgr.save(1, single_state(1.0))
    mgr.suspend_save(2, single_state(2.0))
    (part,) = (base / "n1" / "shm" / "parts").glob("step-*")
    return durable, part


def test_a_request_done_between_the_agents_listing_and_its_look_is_forgotten(one_node, monkeypatch):
    # the persist child removes its request once committed; the agent's next scan may list
    # the file and find it gone a moment later (seen under load: the agent died of it)
    agent = start_agent(one_node, "n1")
    request = agent.spool / "0-000000000002-d558a316-0.json"
    request.write_text("{}")
    listing = os.scandir

    def listed_then_done(path):
        entries = list(listing(path))
        request.unlink()
        return iter(entries)

    monkeypatch.setattr(os, "scandir", listed_then_done)
    agent.scan()
    assert agent.requests == {}


def test_an_agent_killed_while_copying_leaves_the_previous_checkpoint_and_finishes_on_restart(one_node, monkeypatch):
    durable, part = suspended_after_one_durable_save(one_node)
    real = memory._copy_checked

    def dies_after_the_copy(source, dest, entry, name):
        real(source, dest, entry, name)
        raise KeyboardInterrupt  # stands in for SIGKILL: the file is there, the commit is not

    monkeypatch.setattr(memory, "_copy_checked", dies_after_the_copy)
    with pytest.raises(KeyboardInterrupt):
        memory.persist_part(part)
    assert list(durable.glob(".persist-*")) and not (durable / step_dir_name(2)).exists()
    assert CheckpointManager(durable).load()["step"] == 1  # the previous one, whole
    monkeypatch.setattr(memory, "_copy_checked", real)
    run_agent(one_node, "n1")  # the request is still in the spool
    assert verify_checkpoint(durable / step_dir_name(2)).ok
    assert CheckpointManager(durable).load()["step"] == 2


def test_a_part_corrupted_in_memory_is_never_committed(one_node):
    durable, part = suspended_after_one_durable_save(one_node)
    with open(part / "state.safetensors", "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xfe\xfd")
    with pytest.raises(memory.CorruptCheckpointError, match="checksum mismatch in node memory"):
        memory.persist_part(part)
    assert not (durable / step_dir_name(2)).exists()
    # the restart on this node does not load it either: it falls back to the durable step 1
    assert CheckpointManager(durable, fast_dir=one_node / "n1" / "shm").load()["step"] == 1


# --- several ranks on two nodes -----------------------------------------------------------


def _suspend_rank(rank: int, world_size: int, port: int, base: str) -> None:
    fast = on_node(Path(base), node_of(rank))
    init_gloo(rank, world_size, port)
    try:
        state = train_two_steps(rank, world_size)
        torch.manual_seed(100 + rank)
        mgr = CheckpointManager(Path(base) / "durable", fast_dir=fast)
        handle = mgr.suspend_save(STEP, state)
        assert handle.done() and not handle.skipped
        expected = expected_values(state)
        expected["next_random"] = torch.rand(4)
        save_file(expected, str(Path(base) / f"expected-rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


def _resume_rank(rank: int, world_size: int, port: int, base: str, where: str) -> None:
    fast = on_node(Path(base), node_of(rank))
    init_gloo(rank, world_size, port)
    try:
        state = make_state(seed=1234 + rank)
        torch.manual_seed(555)
        mgr = CheckpointManager(Path(base) / "durable", fast_dir=fast)
        mgr.load(into=state)
        assert mgr.loaded_step == STEP and state.step == STEP
        expected = load_file(str(Path(base) / "expected-rank0.safetensors"))
        for name, value in expected_values(state).items():
            assert torch.equal(value, expected[name]), (rank, name)
        mine = load_file(str(Path(base) / f"expected-rank{rank}.safetensors"))
        assert torch.equal(torch.rand(4), mine["next_random"]), rank
        Path(base, f"{where}-{rank}.ok").write_text("")
    finally:
        dist.destroy_process_group()


def test_four_ranks_on_two_nodes_suspend_to_memory_resume_from_it_and_the_agents_commit_it(tmp_path, caplog):
    base = tmp_path
    for node in ("n1", "n2"):
        start_agent(base, node)
    durable = base / "durable"
    spawn(_suspend_rank, 4, base)
    for node, ranks in (("n1", (0, 1)), ("n2", (2, 3))):
        (part,) = (base / node / "shm" / "parts").glob("step-*")
        info = memory.read_part(part)
        assert info.nodes == 2 and info.node == node
        assert {f"rank-{r:05d}.safetensors" for r in ranks} <= set(info.owned)
        assert all(f"__{r}_" not in name for name in info.owned for r in range(4) if r not in ranks)
        assert (part / "tree.json").exists() and (part / "dcp" / ".metadata").exists()  # on every node
    assert not (durable / step_dir_name(STEP)).exists()
    assert (durable / f".persisting-{STEP:012d}.json").exists()

    # the same nodes: loaded from memory (nothing durable exists yet), bitwise, RNG per rank
    spawn(_resume_rank, 4, base, "memory")
    assert len(list(base.glob("memory-*.ok"))) == 4

    # each node also holds the other's share (the peer copy): n2's agent alone commits the step
    assert memory.read_part(base / "n2" / "shm" / "parts" / memory.peer_dir_name(STEP, 0)).owned == \
        memory.read_part(next((base / "n1" / "shm" / "parts").glob("step-*"))).owned
    run_agent(base, "n2")
    assert verify_checkpoint(durable / step_dir_name(STEP)).ok
    run_agent(base, "n1")  # finds it committed
    assert not list(durable.glob(".persist-*")) and not list(durable.glob(".persisting-*"))
    assert not list((base / "n1" / "spool").glob("*-*.json"))

    # other nodes (empty memory): the durable copy, bitwise
    for node in ("n1", "n2"):
        shutil.rmtree(base / node / "shm")
    spawn(_resume_rank, 4, base, "durable")
    assert len(list(base.glob("durable-*.ok"))) == 4


def _lost_node_resume_rank(rank: int, world_size: int, port: int, base: str) -> None:
    fast = on_node(Path(base), node_of(rank))
    memory.wait_for_pending.__defaults__ = (1.0,)
    init_gloo(rank, world_size, port)
    try:
        mgr = CheckpointManager(Path(base) / "durable", fast_dir=fast)
        state = mgr.load()
        Path(base, f"lost-{rank}.step").write_text(str(mgr.loaded_step))
        assert state is not None
    finally:
        dist.destroy_process_group()


def test_a_node_lost_before_the_durable_commit_is_covered_by_its_peer_copy(tmp_path):
    base, durable = tmp_path, tmp_path / "durable"
    for node in ("n1", "n2"):
        start_agent(base, node)
    CheckpointManager(durable).save(3, single_state(3.0))  # an older durable checkpoint
    spawn(_suspend_rank, 4, base)  # step 5 in memory only
    shutil.rmtree(base / "n2")  # n2 lost: its memory and its agent's requests with it
    run_agent(base, "n1")  # n1's own share, and n2's from the peer copy n1 holds
    assert verify_checkpoint(durable / step_dir_name(STEP)).ok
    for node in ("n1", "n2"):  # the restart lands elsewhere: the durable copy, bitwise
        shutil.rmtree(base / node, ignore_errors=True)
    spawn(_resume_rank, 4, base, "after-loss")
    assert len(list(base.glob("after-loss-*.ok"))) == 4


def test_losing_both_copies_of_a_share_falls_back_to_the_newest_durable_checkpoint(tmp_path):
    base, durable = tmp_path, tmp_path / "durable"
    for node in ("n1", "n2"):
        start_agent(base, node)
    CheckpointManager(durable).save(3, single_state(3.0))
    spawn(_suspend_rank, 4, base)
    shutil.rmtree(base / "n2")  # n2 lost, and with it the peer copy of n1's share...
    for path in (base / "n1" / "shm" / "parts").glob("peer-*"):  # ...and n2's copy on n1 too
        shutil.rmtree(path)
    for request in (base / "n1" / "spool").glob("*-*.json"):
        if request.name.endswith("-1.json"):
            request.unlink()
    run_agent(base, "n1")
    assert not (durable / step_dir_name(STEP)).exists()
    spawn(_lost_node_resume_rank, 4, base)
    assert {Path(base, f"lost-{r}.step").read_text() for r in range(4)} == {"3"}


def _outcomes_rank(rank: int, world_size: int, port: int, base: str) -> None:
    from slurm_hai.checkpoint import node_memory  # lazy: DCP

    fast = on_node(Path(base), f"n{rank + 1}")
    init_gloo(rank, world_size, port)
    try:
        durable = Path(base) / "durable"
        state = train_two_steps(rank, world_size)
        mgr = CheckpointManager(durable, fast_dir=fast)
        # no persist agent on n2: a durable save, on every rank
        assert mgr.suspend_save(1, state).where != "node memory"
        if rank == 1:
            start_agent(Path(base), "n2")  # this rank stands in for n2's agent from now on
        dist.barrier()
        assert mgr.suspend_save(1, state).skipped  # committed durably already
        with pytest.raises(CheckpointError, match=r"of step [23] failed: the ranks save different steps"):
            mgr.suspend_save(2 + rank, state)

        def no_room(*args: object) -> None:
            raise OSError(28, "No space left on device")

        commit_part = node_memory.commit_part
        if rank == 1:
            node_memory.commit_part = no_room  # type: ignore[assignment]
        with pytest.raises(CheckpointError, match=r"of step 4 failed: node n2: \[Errno 28\] No space left on device"):
            mgr.suspend_save(4, state)
        node_memory.commit_part = commit_part
        handle = mgr.suspend_save(5, state)
        assert handle.where == "node memory" and not handle.skipped
        part = memory.read_part(fast / "parts" / step_dir_name(5))
        assert (part.node, part.node_index, part.nodes) == (f"n{rank + 1}", rank, 2)
        Path(base, f"token-{rank}").write_text(part.token)
        mgr.close()
    finally:
        dist.destroy_process_group()


def test_every_rank_of_a_suspend_save_has_the_same_outcome(tmp_path):
    """Durable without an agent on some node, skipped when committed already, the same
    error for all when the ranks disagree or one node fails to commit, else in memory."""
    start_agent(tmp_path, "n1")
    spawn(_outcomes_rank, 2, tmp_path)
    durable = tmp_path / "durable"
    assert [step for step, _ in list_step_dirs(durable)] == [1]
    assert not (durable / f".persisting-{4:012d}.json").exists()
    assert (durable / f".persisting-{5:012d}.json").exists()
    assert (tmp_path / "token-0").read_text() == (tmp_path / "token-1").read_text()
    for node, ranks, other in (("n1", [0], "n2"), ("n2", [1], "n1")):
        parts = tmp_path / node / "shm" / "parts"
        own = memory.read_part(parts / step_dir_name(5))
        assert own.owned == sorted(own.owned) and {f"rank-{r:05d}.safetensors" for r in ranks} <= set(own.owned)
        assert all((parts / step_dir_name(5) / name).exists() for name in ("tree.json", "dcp/.metadata"))  # on every node
        peer = memory.read_part(parts / memory.peer_dir_name(5, 1 - ranks[0]))  # the other node's share
        assert peer.node == other and peer.owned == memory.read_part(
            tmp_path / other / "shm" / "parts" / step_dir_name(5)).owned
        assert not list(parts.glob(".staging-*"))


# --- DTensor shards: spares reserved ahead, read back in place --------------------------


def _sharded_state(rank: int, world_size: int, fill: float | None = None) -> dict:
    """A 2-node FSDP-like state: two DTensor weights sharded by rows, and a plain tensor
    (replicated, as an optimizer's step count is)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    generator = torch.Generator().manual_seed(rank)
    shards = [torch.randn(1024, 512, generator=generator), torch.randn(3, 5, generator=generator).to(torch.bfloat16)]
    if fill is not None:
        for shard in shards:
            shard.fill_(fill)
    state = {f"w{i}": DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for i, t in enumerate(shards)}
    state["count"] = torch.tensor([7 if fill is None else 0], dtype=torch.int64)
    return state


def _sharded_suspend_rank(rank: int, world_size: int, port: int, base: str) -> None:
    fast = on_node(Path(base), f"n{rank + 1}")
    init_gloo(rank, world_size, port)
    try:
        state = _sharded_state(rank, world_size)
        mgr = CheckpointManager(Path(base) / "durable", fast_dir=fast)
        mgr.reserve_node_memory(state, wait=True)
        spares = {p.name: p.stat().st_ino for p in (fast / "spares").iterdir()}
        assert set(spares) == {f"own-{rank}", f"peer-{rank}"}, spares
        assert mgr.suspend_save(STEP, state).where == "node memory"
        part = next((fast / "parts").glob("step-*"))
        # the part's data file is the spare, overwritten in place (its pages were reserved)
        assert (part / "dcp" / f"__{rank}_0.distcp").stat().st_ino == spares[f"own-{rank}"]
        peer = next((fast / "parts").glob("peer-*"))
        assert (peer / "dcp" / f"__{1 - rank}_0.distcp").stat().st_ino == spares[f"peer-{rank}"]
        assert not list((fast / "spares").iterdir())
        save_file({k: (v.to_local() if k != "count" else v).clone() for k, v in state.items()},
                  str(Path(base) / f"sharded-rank{rank}.safetensors"))
        mgr.close()
    finally:
        dist.destroy_process_group()


def _sharded_resume_rank(rank: int, world_size: int, port: int, base: str, where: str) -> None:
    fast = on_node(Path(base), f"n{rank + 1}")
    init_gloo(rank, world_size, port)
    try:
        state = _sharded_state(rank, world_size, fill=0.0)
        mgr = CheckpointManager(Path(base) / "durable", fast_dir=fast)
        mgr.load(into=state)
        assert mgr.loaded_step == STEP and (mgr.loaded_from == "node memory") == (where == "memory"), mgr.loaded_from
        expected = load_file(str(Path(base) / f"sharded-rank{rank}.safetensors"))
        for name, value in state.items():
            got = value if name == "count" else value.to_local()
            assert torch.equal(got, expected[name]) and got.dtype == expected[name].dtype, (rank, name)
        mgr.close()
        Path(base, f"{where}-{rank}.ok").write_text("")
    finally:
        dist.destroy_process_group()


def test_dtensor_shards_are_saved_into_reserved_memory_and_read_back_in_place_bitwise(tmp_path):
    for node in ("n1", "n2"):
        start_agent(tmp_path, node)
    spawn(_sharded_suspend_rank, 2, tmp_path)
    spawn(_sharded_resume_rank, 2, tmp_path, "memory")
    assert len(list(tmp_path.glob("memory-*.ok"))) == 2
    for node in ("n1", "n2"):
        run_agent(tmp_path, node)
    assert verify_checkpoint(tmp_path / "durable" / step_dir_name(STEP)).ok
    # a part whose bytes do not parse as torch.save's archive is not read in place: the
    # restart loads the durable copy instead (and nothing wrong)
    for node in ("n1", "n2"):
        data = next((tmp_path / node / "shm" / "parts").glob("step-*")) / "dcp" / f"__{int(node[1]) - 1}_0.distcp"
        raw = bytearray(data.read_bytes())
        raw[0:4] = b"XXXX"
        data.write_bytes(bytes(raw))
    spawn(_sharded_resume_rank, 2, tmp_path, "durable")
    assert len(list(tmp_path.glob("durable-*.ok"))) == 2


def test_reserving_memory_recycles_parts_already_committed_durably(tmp_path):
    durable_dir, fast = tmp_path / "durable", tmp_path / "n1" / "shm"
    mgr = CheckpointManager(durable_dir, fast_dir=fast)
    parts, spares = mgr.parts, fast / "spares"
    for step, committed in ((4, True), (5, False)):
        part = parts.root / step_dir_name(step)
        (part / "dcp").mkdir(parents=True)
        (part / "dcp" / "__0_0.distcp").write_bytes(b"x" * (2 << 20))
        if committed:
            CheckpointManager(durable_dir).save(step, single_state(float(step)))
    recycled_ino = (parts.root / step_dir_name(4) / "dcp" / "__0_0.distcp").stat().st_ino
    memory.reserve_spares(parts, mgr.durable, {"own-0": 3 << 20}, wait_s=0.0)
    assert (spares / "own-0").stat().st_ino == recycled_ino  # step 4's pages, grown to the size asked
    assert (spares / "own-0").stat().st_size == 3 << 20 and (spares / "own-0").read_bytes()[-1:] == b"\0"
    assert not (parts.root / step_dir_name(4)).exists()
    assert (parts.root / step_dir_name(5)).exists()  # not durable yet: the agent may still need it
    assert {p.name for p in spares.iterdir()} == {"own-0"}


def test_a_data_file_is_checksummed_as_written_and_cut_after_its_last_byte(tmp_path):
    import io

    from slurm_hai.checkpoint.manifest import hash_file
    from slurm_hai.checkpoint.sharded import _ChecksummedFile

    path = tmp_path / "spare"
    path.write_bytes(b"old" * 1000)  # a spare: longer than what is written over it
    with _ChecksummedFile(io.FileIO(path, "r+")) as f:
        f.write(b"abc")
        f.write(memoryview(torch.arange(4, dtype=torch.float32).numpy()))
    assert path.stat().st_size == 19 and f.entry is not None
    assert (f.entry.size, f.entry.checksum) == hash_file(path)
    with _ChecksummedFile(io.FileIO(path, "r+")) as f:  # written out of order: not trusted, hashed again later
        f.write(b"abcdef")
        f.seek(0)
        f.write(b"X")
    assert f.entry is None and path.read_bytes() == b"Xbcdef"


def test_the_agent_sweeps_the_memory_of_jobs_seen_over_twice_and_never_with_a_request_waiting(tmp_path):
    shm, spool = tmp_path / "shm", tmp_path / "spool"
    prepare_spool(spool)
    for name in ("slurm-hai-11-memory-abc", "slurm-hai-11.0-xyz", "slurm-hai-12-memory-def",
                 "slurm-hai-13-memory-ghi", "slurm-hai-persist", "other"):
        (shm / name).mkdir(parents=True)
    asked: list[list[int]] = []

    def jobs_over(ids):
        asked.append(ids)
        return {11, 13}

    agent = Agent(spool, jobs_over=jobs_over, memory_root=shm)
    (spool / f"{os.getuid()}-000000000001-tok-0.json").write_text('{"part": "/nowhere"}')
    agent.scan()  # a request of job 13's owner (this uid) waits: nothing of theirs goes
    assert agent.sweep() == [] and agent.sweep() == []
    agent.requests.clear()
    assert agent.sweep() == []  # over once: a requeue in flight could look like that
    assert agent.sweep() == ["slurm-hai-11-memory-abc", "slurm-hai-11.0-xyz", "slurm-hai-13-memory-ghi"]
    assert sorted(p.name for p in shm.iterdir()) == ["other", "slurm-hai-12-memory-def", "slurm-hai-persist"]
    assert agent.sweep() == [] and asked[-1] == [12]

    def slurm_away(ids):
        raise RuntimeError("slurmctld not responding")

    agent.jobs_over = slurm_away
    assert agent.sweep() == [] and (shm / "slurm-hai-12-memory-def").exists()


def test_the_agent_holding_a_peer_copy_leaves_the_share_to_its_own_agent_unless_it_goes_silent(
        tmp_path, monkeypatch):
    for node in ("n1", "n2"):
        start_agent(tmp_path, node)
    spawn(_suspend_rank, 4, tmp_path)
    copied: list[str] = []
    real_copy = memory._copy_share
    def recorded_copy(part_dir, *args):
        copied.append(part_dir.name)
        real_copy(part_dir, *args)

    monkeypatch.setattr(memory, "_copy_share", recorded_copy)
    part = {node: next((tmp_path / node / "shm" / "parts").glob("step-*")) for node in ("n1", "n2")}
    peer_of = {node: next((tmp_path / node / "shm" / "parts").glob("peer-*")) for node in ("n1", "n2")}
    # n1's own agent copies n1's share while n2's agent (holding n1's peer copy) looks: one copy
    owner = threading.Thread(target=memory.persist_part, args=(part["n1"],))
    owner.start()
    assert memory.persist_part(peer_of["n2"]) in ("copied", "committed")
    owner.join()
    assert copied == [part["n1"].name]
    # n2's share: its agent went silent mid-copy (a claim that stopped beating): n1 copies it
    token = memory.read_part(part["n2"]).token
    claim = tmp_path / "durable" / f".persist-{STEP:012d}-{token}" / ".part-1.copying"
    claim.touch()
    os.utime(claim, (time.time() - 60, time.time() - 60))
    assert memory.persist_part(peer_of["n1"]) == "committed"
    assert copied == [part["n1"].name, peer_of["n1"].name]
    step_dir = tmp_path / "durable" / step_dir_name(STEP)
    assert verify_checkpoint(step_dir).ok and not list(step_dir.glob(".part-*"))


def test_a_request_whose_part_is_gone_is_done(tmp_path, capsys):
    from slurm_hai.checkpoint.agent import handle

    request = tmp_path / "0-000000000005-tok-1.json"
    request.write_text(json.dumps({"part": str(tmp_path / "shm" / "parts" / "peer-000000000005-1")}))
    assert handle(request) == 0 and not request.exists()
    assert "gone" in capsys.readouterr().out
