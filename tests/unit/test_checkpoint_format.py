"""The on-disk format: pickle-free tree + tensors, safetensors compatibility, manifests."""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open

from slurm_hai.checkpoint import CheckpointError, CheckpointManager, PerRank
from slurm_hai.checkpoint.manifest import (
    FileEntry,
    Manifest,
    parse_manifest,
    parse_step_dir_name,
    step_dir_name,
    verify_checkpoint,
)
from slurm_hai.checkpoint.serialize import build_header, flatten_state, parse_header, plan_slots, unflatten_state


def roundtrip(state, tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt")
    mgr.save(1, state)
    return CheckpointManager(tmp_path / "ckpt").load()


def test_nested_plain_values_and_tensors_roundtrip_exactly(tmp_path):
    state = {
        "ints": [0, -1, 2**62, True, False],
        "floats": (1.5, -0.0, float("inf"), float("-inf")),
        "text": "ünïcode",
        "none": None,
        "raw": b"\x00\xffbytes",
        3: {"int key": 7},
        "numpy": np.arange(6, dtype=np.int32).reshape(2, 3),
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
    }
    loaded = roundtrip({**state, "nan": float("nan")}, tmp_path)
    assert math.isnan(loaded.pop("nan"))
    assert loaded["ints"] == [0, -1, 2**62, True, False] and loaded["ints"][3] is True
    assert loaded["floats"] == (1.5, -0.0, float("inf"), float("-inf")) and isinstance(loaded["floats"], tuple)
    assert loaded["text"] == state["text"] and loaded["none"] is None and loaded["raw"] == state["raw"]
    assert loaded[3] == {"int key": 7}
    assert isinstance(loaded["numpy"], np.ndarray) and np.array_equal(loaded["numpy"], state["numpy"])
    assert torch.equal(loaded["scalar"], state["scalar"]) and loaded["scalar"].dtype == torch.float64
    assert loaded["empty"].shape == (0, 4)
    assert torch.equal(loaded["strided"], state["strided"])


@pytest.mark.parametrize(
    "dtype",
    [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
     torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn],
)
def test_every_supported_dtype_roundtrips_bitwise(dtype, tmp_path):
    source = (torch.randn(5, 3) * 100).to(dtype)
    loaded = roundtrip({"t": source, "odd": torch.ones(3, dtype=torch.uint8)}, tmp_path)
    assert loaded["t"].dtype == dtype
    assert torch.equal(loaded["t"].view(torch.uint8), source.view(torch.uint8))


def test_stateful_objects_are_saved_through_state_dict(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    loaded = roundtrip({"model": model, "optimizer": optimizer}, tmp_path)
    assert torch.equal(loaded["model"]["weight"], model.weight)
    fresh = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.5, momentum=0.1)
    fresh.load_state_dict(loaded["optimizer"])
    assert fresh.param_groups[0]["lr"] == 0.1 and fresh.param_groups[0]["momentum"] == 0.9


def test_files_open_with_the_safetensors_library(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(7, {"layer": {"w": torch.arange(4.0)}, "b": torch.ones(2, dtype=torch.bfloat16)})
    with safe_open(str(tmp_path / step_dir_name(7) / "state.safetensors"), "pt") as fh:
        assert set(fh.keys()) == {"layer/w", "b"}
        assert torch.equal(fh.get_tensor("layer/w"), torch.arange(4.0))


def test_colliding_tensor_names_stay_distinct():
    flat, _ = flatten_state({"a/b": torch.zeros(1), "a": {"b": torch.ones(1)}})
    assert len(flat.tensors) == 2
    rebuilt = unflatten_state(flat.tree, flat.tensors)
    assert torch.equal(rebuilt["a/b"], torch.zeros(1)) and torch.equal(rebuilt["a"]["b"], torch.ones(1))


def test_per_rank_values_are_split_out_and_come_back_per_rank():
    state = {"w": torch.ones(2), "rng": PerRank({"seed": torch.tensor([1, 2])})}
    global_part, rank_part = flatten_state(state)
    assert rank_part is not None and list(global_part.tensors) == ["w"]
    per_rank = unflatten_state(rank_part.tree, rank_part.tensors)
    assert torch.equal(unflatten_state(global_part.tree, global_part.tensors, per_rank)["rng"]["seed"], torch.tensor([1, 2]))
    assert unflatten_state(global_part.tree, global_part.tensors, None)["rng"] is None


@pytest.mark.parametrize(
    ("value", "message"),
    [(object(), "cannot save a builtins.object"), ({(1, 2): 3}, "only str and int keys"),
     (torch.zeros(2).to_sparse(), "dense tensor"), (np.array([object()]), "numpy array of object")],
)
def test_unsupported_values_fail_with_the_path_and_a_hint(value, message):
    with pytest.raises(CheckpointError, match=message) as info:
        flatten_state({"outer": {"inner": value}})
    assert "outer/inner" in str(info.value)


def test_header_parser_rejects_overlapping_and_out_of_range_tensors():
    tensors = {"a": torch.zeros(4), "b": torch.zeros(4)}
    slots = plan_slots(tensors)
    header = build_header(slots, {"dict": []})[8:]
    parse_header(header, 32)
    with pytest.raises(CheckpointError, match="past the end"):
        parse_header(header, 31)
    fields = json.loads(header)
    fields["b"]["data_offsets"] = [8, 24]
    with pytest.raises(CheckpointError, match="overlaps"):
        parse_header(json.dumps(fields).encode(), 32)


def make_manifest(step=5):
    return Manifest(step=step, layout="single", world_size=1, files={"state.safetensors": FileEntry(10, "ab" * 16)})


def test_manifest_roundtrips_and_detects_any_edit():
    raw = make_manifest().to_json_bytes()
    assert parse_manifest(raw).files["state.safetensors"].size == 10
    edited = raw.replace(b'"step": 5', b'"step": 6')
    assert edited != raw
    with pytest.raises(CheckpointError, match="manifest checksum mismatch"):
        parse_manifest(edited)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        parse_manifest(raw[: len(raw) // 2])


def test_manifest_from_a_newer_format_asks_for_an_upgrade():
    fields = json.loads(make_manifest().to_json_bytes())
    fields["format_version"] = 99
    with pytest.raises(CheckpointError, match="upgrade slurm-hai"):
        parse_manifest(json.dumps(fields).encode())


def test_manifest_paths_cannot_escape_the_checkpoint_dir():
    manifest = make_manifest()
    manifest.files = {"../../etc/passwd": FileEntry(1, "00")}
    with pytest.raises(CheckpointError, match="unsafe path"):
        parse_manifest(manifest.to_json_bytes())


def test_step_dir_names_sort_and_parse():
    assert step_dir_name(42) == "step-000000000042"
    assert parse_step_dir_name("step-000000000042") == 42
    assert parse_step_dir_name("step-12") == 12
    assert parse_step_dir_name(".staging-000000000042-h-1-ab") is None


def test_verify_reports_a_missing_manifest(tmp_path):
    (tmp_path / step_dir_name(3)).mkdir()
    result = verify_checkpoint(tmp_path / step_dir_name(3))
    assert not result.ok and result.problems[0].file == "manifest.json"


def aligned_bytes(size: int) -> memoryview:
    from slurm_hai.checkpoint.staging import HostBuffer

    buffer = HostBuffer().reserve(size)
    buffer.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    return memoryview(buffer.numpy())


@pytest.mark.parametrize("size", [100, 4096, 3 * 8192 + 123])
def test_writer_chunks_direct_io_and_tail_into_the_exact_bytes(tmp_path, monkeypatch, size):
    from slurm_hai.checkpoint import fileio
    from slurm_hai.checkpoint.manifest import hash_file

    monkeypatch.setattr(fileio, "IO_CHUNK", 8192)
    data = aligned_bytes(size)
    entry = fileio.write_hashed_file(tmp_path / "f", data)
    assert (tmp_path / "f").read_bytes() == data.tobytes()
    assert (entry.size, entry.checksum) == hash_file(tmp_path / "f")


def test_writer_falls_back_to_buffered_io_when_direct_io_is_refused(tmp_path, monkeypatch):
    from slurm_hai.checkpoint import fileio
    from slurm_hai.checkpoint.manifest import hash_file

    real_write_all, refused = fileio._write_all, []

    def refuse_direct_io_once(fd, view):
        if not refused and os.O_DIRECT & fcntl.fcntl(fd, fcntl.F_GETFL):
            refused.append(True)
            raise OSError(errno.EINVAL, "Invalid argument")
        real_write_all(fd, view)

    monkeypatch.setattr(fileio, "_write_all", refuse_direct_io_once)
    monkeypatch.setattr(fileio, "IO_CHUNK", 8192)
    data = aligned_bytes(5 * 8192)
    entry = fileio.write_hashed_file(tmp_path / "f", data)
    assert refused, "O_DIRECT was never attempted on this file system"
    assert (tmp_path / "f").read_bytes() == data.tobytes() and entry.checksum == hash_file(tmp_path / "f")[1]


def test_loading_our_format_never_unpickles(tmp_path, monkeypatch):
    import pickle

    model = torch.nn.Linear(3, 2)
    CheckpointManager(tmp_path).save(1, {"model": model, "meta": {"lr": 0.1}})

    def forbidden(*args, **kwargs):
        raise AssertionError("pickle/torch.load used on our own format")

    for module, name in [(pickle, "load"), (pickle, "loads"), (torch, "load")]:
        monkeypatch.setattr(module, name, forbidden)
    loaded = CheckpointManager(tmp_path).load()
    assert torch.equal(loaded["model"]["weight"], model.weight) and loaded["meta"] == {"lr": 0.1}
