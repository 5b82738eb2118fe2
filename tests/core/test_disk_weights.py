"""core/disk_weights.py: the records of disk-offloaded tensors and their index file."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from retarget.core.disk_weights import INDEX_NAME, DiskWeight, read_disk_index, write_disk_index


def test_index_round_trips_and_each_record_opens(tmp_path):
    tensor = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    save_file({"layer.weight": tensor}, tmp_path / "w.safetensors")
    record = DiskWeight(
        file=str(tmp_path / "w.safetensors"), key="layer.weight", dtype="bfloat16", shape=(3, 4)
    )
    weights = {"layer.weight": record, "tied.weight": record}
    write_disk_index(tmp_path / "offload", weights)
    assert (tmp_path / "offload" / INDEX_NAME).is_file()
    back = read_disk_index(tmp_path / "offload")
    assert back == weights
    assert back["layer.weight"].torch_dtype == torch.bfloat16
    assert back["layer.weight"].nbytes == 24
    with safe_open(back["tied.weight"].file, framework="pt") as handle:
        assert torch.equal(handle.get_tensor(back["tied.weight"].key), tensor)


def test_a_folder_without_an_index_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an offload folder"):
        read_disk_index(tmp_path)
