"""Atomic writes (a reader sees the old file or the whole new one), the safetensors + JSON metadata
round trip and its refusals, and content hashes of files and folders."""

import hashlib
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from spec_cli.artifacts import io
from spec_cli.errors import ArtifactError


def half_then_fail(tensors, filename, metadata=None):
    """A serializer that dies midway: it writes the first half of the real file, then raises."""
    save_file(tensors, filename, metadata=metadata)
    with open(filename, "rb") as f:
        data = f.read()
    with open(filename, "wb") as f:
        f.write(data[: len(data) // 2])
    raise OSError("disk full")


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "a.safetensors"
    old = {"x": torch.arange(6.0)}
    io.write_safetensors(path, old, {"kind": "old"})
    before = path.read_bytes()
    monkeypatch.setattr(io, "save_file", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        io.write_safetensors(path, {"x": torch.zeros(1000)}, {"kind": "new"})
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]
    tensors, meta = io.read_safetensors(path, "test file")
    assert torch.equal(tensors["x"], old["x"]) and meta == {"kind": "old"}


def test_a_first_write_that_fails_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(io, "save_file", half_then_fail)
    with pytest.raises(OSError):
        io.write_safetensors(tmp_path / "deep" / "a.safetensors", {"x": torch.ones(3)}, {})
    assert list((tmp_path / "deep").iterdir()) == []


def test_a_failing_json_serializer_keeps_the_old_json(tmp_path):
    path = tmp_path / "run.json"
    io.write_json(path, {"step": 1})
    with pytest.raises(TypeError):
        io.write_json(path, {"step": 2, "bad": object()})
    assert json.loads(path.read_text()) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


def test_written_files_get_normal_permissions(tmp_path):
    previous = os.umask(0o022)
    try:
        io.write_json(tmp_path / "a.json", {})  # mkstemp alone would leave 0600
        with io.atomic_dir(tmp_path / "folder") as tmp:
            (tmp / "f").write_text("x")
            os.chmod(tmp / "f", 0o600)
    finally:
        os.umask(previous)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "folder").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "folder" / "f").stat().st_mode & 0o777 == 0o644


def test_atomic_dir_replaces_the_whole_folder_or_leaves_it_as_it_was(tmp_path):
    out = tmp_path / "export"
    with io.atomic_dir(out) as tmp:
        (tmp / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with io.atomic_dir(out) as tmp:
            (tmp / "new.txt").write_text("half")
            raise RuntimeError("writer bug")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"]
    with io.atomic_dir(out) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]  # replaced, not merged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no .old or .tmp left


def test_safetensors_round_trip_keeps_values_dtypes_and_metadata(tmp_path):
    tensors = {
        "w": torch.randn(3, 4).t(),
        "ids": torch.tensor([1, 2], dtype=torch.int32),
        "b": torch.tensor([True, False]),
        "h": torch.randn(2).bfloat16(),
    }  # w: not contiguous
    meta = {"kind": "thing", "nested": {"a": [1, 2]}}
    io.write_safetensors(tmp_path / "t.safetensors", tensors, meta)
    got, got_meta = io.read_safetensors(tmp_path / "t.safetensors", "thing")
    assert got_meta == meta
    assert sorted(got) == sorted(tensors)
    for name, tensor in tensors.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_reading_refuses_missing_damaged_and_foreign_files(tmp_path):
    with pytest.raises(ArtifactError, match="vocab map not found"):
        io.read_safetensors(tmp_path / "nope.safetensors", "vocab map")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ArtifactError, match="not a readable safetensors file") as err:
        io.read_safetensors(tmp_path / "junk.safetensors", "vocab map")
    assert err.value.hint == "rebuild the vocab map"
    save_file({"x": torch.ones(2)}, str(tmp_path / "foreign.safetensors"))  # no spec_cli metadata
    with pytest.raises(ArtifactError, match="not a spec_cli vocab map"):
        io.read_safetensors(tmp_path / "foreign.safetensors", "vocab map")


def test_content_hashes_of_files_and_folders(tmp_path):
    a = tmp_path / "a"
    (a / "sub").mkdir(parents=True)
    (a / "x.bin").write_bytes(b"hello")
    (a / "sub" / "y.bin").write_bytes(b"world" * 1000)
    assert io.sha256_path(a / "x.bin") == hashlib.sha256(b"hello").hexdigest()
    assert (
        io.sha256_file(a / "sub" / "y.bin", chunk=7) == hashlib.sha256(b"world" * 1000).hexdigest()
    )
    b = tmp_path / "b"  # a copy elsewhere hashes the same
    (b / "sub").mkdir(parents=True)
    (b / "x.bin").write_bytes(b"hello")
    (b / "sub" / "y.bin").write_bytes(b"world" * 1000)
    assert io.sha256_path(a) == io.sha256_path(b)
    (b / "x.bin").rename(b / "z.bin")  # same bytes, another name: another folder
    assert io.sha256_path(a) != io.sha256_path(b)
    (b / "z.bin").rename(b / "x.bin")
    (b / "x.bin").write_bytes(b"hellO")
    assert io.sha256_path(a) != io.sha256_path(b)
