"""bigmodel/checkpoint_files.py: finding a checkpoint's tensors from headers; reading one."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from retarget.bigmodel.checkpoint_files import CheckpointError, find_checkpoint, tensor_reader


def _tensors():
    return {
        "a": torch.randn(3, 4),
        "b": torch.arange(5, dtype=torch.int64),
        "c": torch.randn(2, dtype=torch.float64).to(torch.bfloat16),
        "empty": torch.zeros(0, 3),
    }


def test_header_gives_dtype_and_shape_and_reads_match_the_stored_tensors(tmp_path):
    tensors = _tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    files = find_checkpoint(tmp_path)
    assert {k: (t.dtype, t.shape) for k, t in files.tensors.items()} == {
        k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()
    }
    with tensor_reader() as reader:
        for key, value in tensors.items():
            read = reader.read(files.tensors[key])
            assert torch.equal(read, value) and read.dtype == value.dtype
            # The tensor owns its memory (not the file's map): writing it leaves the file alone.
            read.zero_()
    with tensor_reader() as reader:
        assert torch.equal(reader.read(files.tensors["a"]), tensors["a"])


def test_an_index_and_its_tied_aliases(tmp_path):
    save_file({"x": torch.ones(2)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"y": torch.zeros(2)}, tmp_path / "model-00002-of-00002.safetensors")
    index = {
        "metadata": {"tied_weights": {"z": "x"}},
        "weight_map": {
            "x": "model-00001-of-00002.safetensors",
            "y": "model-00002-of-00002.safetensors",
        },
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    files = find_checkpoint(tmp_path)
    assert sorted(files.tensors) == ["x", "y"] and files.aliases == {"z": "x"}
    assert [f.name for f in files.files()] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    index["weight_map"]["w"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="puts 'w' in model-00002-of-00002.safetensors"):
        find_checkpoint(tmp_path)


def test_bad_files_and_folders_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="found no checkpoint file"):
        find_checkpoint(tmp_path)
    save_file({"a": torch.ones(1000)}, tmp_path / "one.safetensors")
    save_file({"a": torch.ones(1)}, tmp_path / "two.safetensors")
    with pytest.raises(CheckpointError, match="found one.safetensors, two.safetensors"):
        find_checkpoint(tmp_path)
    data = (tmp_path / "one.safetensors").read_bytes()
    (tmp_path / "one.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"one.safetensors: 'a' ends past the end"):
        find_checkpoint(tmp_path / "one.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x01")
    with pytest.raises(CheckpointError, match="junk.safetensors is not a safetensors file"):
        find_checkpoint(tmp_path / "junk.safetensors")
