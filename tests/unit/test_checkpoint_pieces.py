"""Suspend at memory speed (issue 56): the pieced checksum kind, the write straight into the
mapped spare, and the streaming load from node memory (region.py)."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
from test_checkpoint_memory import start_agent

from slurm_hai.checkpoint import CheckpointManager, memory, verify_checkpoint
from slurm_hai.checkpoint.errors import CorruptCheckpointError
from slurm_hai.checkpoint.manifest import (HASH_NAME, MANIFEST_NAME, PIECES_HASH, FileEntry, Manifest, check_file,
                                           hash_pieces, parse_manifest, step_dir_name)
from slurm_hai.checkpoint.region import MappedRegion, state_file_plan, stream_tensor_file
from slurm_hai.checkpoint.serialize import flatten_state, unflatten_state


@pytest.fixture
def one_node(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    monkeypatch.setenv("HAI_PERSIST_SPOOL", str(tmp_path / "n1" / "spool"))
    return tmp_path


def big_state(value: float) -> dict:
    # > one 8 MiB piece, several tensors of two dtypes
    return {"w": torch.full((3, 1 << 20), value), "b": torch.arange(5, dtype=torch.int64) * int(value),
            "h": torch.full((1 << 20,), value, dtype=torch.float16), "step": int(value)}


def test_a_checkpoint_with_the_old_whole_file_checksum_still_verifies_and_loads(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt")
    mgr.save(1, {"w": torch.arange(10.0)})
    step_dir = tmp_path / "ckpt" / step_dir_name(1)
    raw = json.loads((step_dir / MANIFEST_NAME).read_text())
    assert raw["format_version"] == 1 and all(HASH_NAME in e for e in raw["files"].values())
    assert verify_checkpoint(step_dir).ok
    assert torch.equal(CheckpointManager(tmp_path / "ckpt").load()["w"], torch.arange(10.0))


def test_the_pieced_kind_round_trips_through_the_manifest_as_format_version_2():
    data = memoryview(bytes(range(256)) * (1 << 16))  # 16 MiB: two pieces
    entry = hash_pieces(data, 8 << 20)
    assert entry.kind == PIECES_HASH and len(entry.pieces) == 2
    manifest = Manifest(step=3, layout="single", world_size=1, files={"a": entry, "b": FileEntry(4, "0" * 32)})
    raw = manifest.to_json_bytes()
    assert json.loads(raw)["format_version"] == 2
    assert parse_manifest(raw).files == manifest.files


def test_a_corrupted_piece_is_detected_and_named(tmp_path):
    path = tmp_path / "f"
    data = bytearray(20 << 20)
    path.write_bytes(data)
    entry = hash_pieces(memoryview(data), 8 << 20)
    with open(path, "r+b") as f:
        f.seek((8 << 20) + 5)
        f.write(b"\x01")
    for mapped in (True, False):
        (problem,) = check_file(tmp_path, "f", entry, check_data=True, mapped=mapped)
        assert "piece 1 of 3" in problem.reason


def test_a_suspend_save_writes_into_the_mapped_spare_with_pieced_checksums(one_node):
    durable, fast = one_node / "durable", one_node / "n1" / "shm"
    start_agent(one_node, "n1")
    state = big_state(2.0)
    mgr = CheckpointManager(durable, fast_dir=fast)
    mgr.reserve_node_memory(state, wait=True)
    inode = (fast / "spares" / "own-0").stat().st_ino
    assert mgr.suspend_save(2, state).where == "node memory"
    part = fast / "parts" / step_dir_name(2)
    entry = memory.read_part(part).manifest.files["state.safetensors"]
    assert entry.kind == PIECES_HASH and len(entry.pieces) > 1
    assert (part / "state.safetensors").stat().st_ino == inode
    assert not memory.check_part_files(part, memory.read_part(part), ["state.safetensors"])
    assert memory.persist_part(part) == "committed"  # the agent verifies the pieces as it copies
    assert verify_checkpoint(durable / step_dir_name(2)).ok
    mgr.close()


def test_the_streaming_load_from_node_memory_fills_the_live_tensors_in_place(one_node):
    durable, fast = one_node / "durable", one_node / "n1" / "shm"
    start_agent(one_node, "n1")
    mgr = CheckpointManager(durable, fast_dir=fast)
    mgr.suspend_save(4, big_state(4.0))
    mgr.close()
    live = big_state(0.0)
    pointers = {k: t.data_ptr() for k, t in live.items() if isinstance(t, torch.Tensor)}
    restart = CheckpointManager(durable, fast_dir=fast)
    state = restart.load(into=live)
    restart.close()
    assert restart.loaded_from == "node memory" and state["step"] == 4
    for key, expected in big_state(4.0).items():
        if isinstance(expected, torch.Tensor):
            assert torch.equal(live[key], expected) and live[key].data_ptr() == pointers[key]


def test_a_load_from_the_durable_tier_frees_the_tensors_it_read_once_the_caller_drops_them(tmp_path):
    # not at the cyclic garbage collector's next run: that was during the next suspend save
    CheckpointManager(tmp_path / "ckpt").save(2, big_state(2.0))
    live = big_state(0.0)
    gc.disable()
    try:
        restart = CheckpointManager(tmp_path / "ckpt")
        state = restart.load(into=live)
        restart.close()
        assert torch.equal(live["w"], big_state(2.0)["w"]) and state["w"] is not live["w"]
        read = weakref.ref(state["w"])
        del state
        assert read() is None
    finally:
        gc.enable()


def test_the_streaming_load_stops_at_a_bad_piece_and_an_older_checkpoint_is_loaded_over_it(one_node):
    durable, fast = one_node / "durable", one_node / "n1" / "shm"
    start_agent(one_node, "n1")
    mgr = CheckpointManager(durable, fast_dir=fast)
    mgr.save(1, big_state(1.0))
    mgr.suspend_save(2, big_state(2.0))
    mgr.close()
    state_file = fast / "parts" / step_dir_name(2) / "state.safetensors"
    with open(state_file, "r+b") as f:  # a byte flipped in node memory, in the last piece
        f.seek(-100, 2)
        f.write(b"\xff")
    live = big_state(0.0)
    restart = CheckpointManager(durable, fast_dir=fast)
    assert restart.load(into=live)["step"] == 1
    assert restart.loaded_step == 1 and torch.equal(live["w"], big_state(1.0)["w"])


def test_a_torn_reserved_region_is_never_loaded(one_node, monkeypatch):
    # the save dies after the tensors went into the mapped spare, before the part's commit
    durable, fast = one_node / "durable", one_node / "n1" / "shm"
    start_agent(one_node, "n1")
    mgr = CheckpointManager(durable, fast_dir=fast)
    mgr.save(1, big_state(1.0))
    mgr.reserve_node_memory(big_state(2.0), wait=True)

    def dies(*args, **kwargs):
        raise OSError("killed")

    monkeypatch.setattr("slurm_hai.checkpoint.manager.commit_part", dies)
    with pytest.raises(Exception, match="killed"):
        mgr.suspend_save(2, big_state(2.0))
    monkeypatch.undo()
    assert not list((fast / "parts").glob("step-*"))
    live = big_state(0.0)
    assert CheckpointManager(durable, fast_dir=fast).load(into=live)["step"] == 1
    assert torch.equal(live["w"], big_state(1.0)["w"])


def test_a_failed_streaming_load_with_nothing_to_fall_back_to_says_the_tensors_are_overwritten(one_node):
    durable, fast = one_node / "durable", one_node / "n1" / "shm"
    start_agent(one_node, "n1")
    mgr = CheckpointManager(durable, fast_dir=fast)
    mgr.suspend_save(2, big_state(2.0))
    mgr.close()
    with open(fast / "parts" / step_dir_name(2) / "state.safetensors", "r+b") as f:
        f.seek(-100, 2)
        f.write(b"\xff")
    with pytest.raises(Exception, match="partly overwritten"):
        CheckpointManager(durable, fast_dir=fast).load(into=big_state(0.0))


def small_pieced_file(path, state: dict, piece_size: int) -> FileEntry:
    """`state` written as a suspend save writes its state file (region.py), in small pieces."""
    header, segments, size = state_file_plan(flatten_state(state)[0])
    region = MappedRegion()
    try:
        return region.write(path, header, segments, size, piece_size=piece_size)
    finally:
        region.release()


def small_state(value: int) -> dict:
    return {"w": torch.arange(3000, dtype=torch.float32) * value, "b": torch.arange(700) * value,
            "e": torch.empty(0), "step": value}


def test_the_streaming_load_verifies_pieces_that_split_the_header_and_the_tensors(tmp_path):
    path = tmp_path / "state.safetensors"
    entry = small_pieced_file(path, small_state(3), 1000)  # the header (a page) spans 5 pieces, each tensor several
    assert len(entry.pieces) == 22
    live = small_state(0)
    pointers = {k: t.data_ptr() for k, t in live.items() if isinstance(t, torch.Tensor)}
    flat = stream_tensor_file(path, entry, "state.safetensors", live)
    assert flat is not None and unflatten_state(flat.tree, flat.tensors)["step"] == 3
    for key, expected in small_state(3).items():
        if isinstance(expected, torch.Tensor):
            assert torch.equal(live[key], expected) and flat.tensors[key] is live[key]
            assert live[key].data_ptr() == pointers[key]


def test_the_streaming_load_leaves_tensors_it_cannot_fill_in_place_alone(tmp_path):
    path = tmp_path / "state.safetensors"
    entry = small_pieced_file(path, small_state(3), 1000)
    unfit = [{**small_state(0), "w": torch.zeros(3000, dtype=torch.float64)},  # another dtype
             {**small_state(0), "w": torch.zeros(3001)},  # another shape
             {**small_state(0), "w": torch.zeros(6000)[::2]},  # not contiguous
             {k: v for k, v in small_state(0).items() if k != "b"}]  # none for a tensor of the file
    for live in unfit:
        assert stream_tensor_file(path, entry, "state.safetensors", live) is None
        assert not any(t.any() for t in live.values() if isinstance(t, torch.Tensor))
    whole_file = FileEntry(entry.size, "0" * 32)  # the older whole-file checksum: read the usual way
    assert stream_tensor_file(path, whole_file, "state.safetensors", small_state(0)) is None


@pytest.mark.parametrize(("damage", "reason"), [
    ("header", "checksum mismatch in piece 2 of 22 (bytes 2000-3000)"),
    ("data", "checksum mismatch in piece 17 of 22 (bytes 17000-18000)"),
    ("cut", "size 21695 bytes, manifest says 21696 (truncated or torn)"),
    ("gone", "missing"),
])
def test_the_streaming_load_names_the_damage_of_a_state_file(tmp_path, damage, reason):
    path = tmp_path / "state.safetensors"
    entry = small_pieced_file(path, small_state(3), 1000)
    if damage == "gone":
        path.unlink()
    elif damage == "cut":
        with open(path, "r+b") as f:
            f.truncate(entry.size - 1)
    else:
        with open(path, "r+b") as f:
            f.seek(2500 if damage == "header" else 17500)
            f.write(b"\x7f")
    with pytest.raises(CorruptCheckpointError) as exc:
        stream_tensor_file(path, entry, "state.safetensors", small_state(0))
    (problem,) = exc.value.problems
    assert problem.file == "state.safetensors" and reason in problem.reason and exc.value.path == str(tmp_path)
