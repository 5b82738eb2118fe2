"""execution/offload: weight sources, unit planning, the hooks and the prefetch order."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from retarget.core.disk_weights import DiskWeight
from retarget.execution.offload.hooks import OffloadRuntime
from retarget.execution.offload.sources import CpuSource, DiskSource, SafetensorsFiles
from retarget.execution.offload.units import UnitPlanner, split_into_units


def rss_anon() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


def disk_record(tmp_path, tensor, key="w", extra=None):
    path = tmp_path / f"{key}.safetensors"
    save_file({key: tensor, **(extra or {})}, path)
    return DiskWeight(str(path), key, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


def test_a_disk_tensor_on_cpu_is_used_from_the_map_without_anonymous_memory(tmp_path):
    tensor = torch.randn(64, 1024, 256)  # 64 MiB
    record = disk_record(tmp_path, tensor)
    expected = float(tensor.sum())
    del tensor
    source = DiskSource(record, SafetensorsFiles())
    before = rss_anon()
    assert source.prefetch(torch.device("cpu")) is None  # read ahead by the kernel, not copied
    loaded = source.load(torch.device("cpu"))
    total = float(loaded.sum())  # every page read
    grown = rss_anon() - before
    assert grown < 8 * 2**20, f"RssAnon grew {grown} bytes for a mapped tensor"
    assert total == expected


def test_disk_source_gives_the_stored_values_and_copies_for_a_cast(tmp_path):
    tensor = torch.randn(8, 16)
    other = torch.arange(6, dtype=torch.int64)
    record = disk_record(tmp_path, tensor, extra={"other": other})
    source = DiskSource(record, SafetensorsFiles())
    assert torch.equal(source.load(torch.device("cpu")), tensor)
    cast = DiskSource(
        DiskWeight(record.file, "w", "bfloat16", record.shape), SafetensorsFiles()
    ).load(torch.device("cpu"))
    assert cast.dtype == torch.bfloat16 and torch.equal(cast, tensor.to(torch.bfloat16))


def test_warm_reads_exactly_the_tensors_bytes(tmp_path):
    first, second = torch.randn(3, 5), torch.randn(7)
    record = disk_record(tmp_path, first, key="a", extra={"b": second})
    files = SafetensorsFiles()
    for key, tensor in (("a", first), ("b", second)):
        offset, length = files.byte_range(record.file, key)
        with open(record.file, "rb") as stream:
            stream.seek(offset)
            raw = stream.read(length)
        assert raw == tensor.numpy().tobytes()
        files.warm(record.file, key)


def test_a_shape_that_disagrees_with_its_record_is_refused(tmp_path):
    record = disk_record(tmp_path, torch.randn(4, 4))
    wrong = DiskWeight(record.file, "w", "float32", (2, 8))
    with pytest.raises(ValueError, match=r"has shape \(4, 4\), the offload record says \(2, 8\)"):
        DiskSource(wrong, SafetensorsFiles()).load(torch.device("cpu"))


def test_cpu_source_on_cpu_is_the_tensor_itself():
    tensor = torch.randn(3)
    assert CpuSource(tensor).load(torch.device("cpu")) is tensor


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def test_units_follow_the_blocks_and_split_containers():
    model = Stack()
    blocks = {"blocks.0", "blocks.1", "blocks.2"}
    units = [(p, whole) for p, _, whole in split_into_units(model, "", blocks)]
    assert units == [
        ("", False),
        ("embed", True),
        ("blocks", False),
        ("blocks.0", True),
        ("blocks.1", True),
        ("blocks.2", True),
        ("head", True),
    ]
    assert [p for p, _, _ in split_into_units(model.blocks[0], "blocks.0", blocks)] == ["blocks.0"]


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_cpu_units_run_exactly_and_release_their_tensors(prefetch):
    torch.manual_seed(0)
    model = Stack()
    ids = torch.randint(0, 10, (2, 5))
    expected = model(ids)
    blocks = {"blocks.0", "blocks.1", "blocks.2"}
    units = UnitPlanner(model, {}, blocks=blocks).plan([("", "cpu")])
    runtime = OffloadRuntime(units, "cpu", prefetch).attach()
    assert model.head.weight is model.embed.weight and model.head.weight.is_meta
    for _ in range(3):
        assert torch.equal(model(ids), expected)
    assert all(p.is_meta for p in model.parameters())
    assert runtime.loads + runtime.prefetched == 3 * len(units)
    if prefetch:
        assert runtime.prefetched >= 2 * len(units) - 1
    runtime.remove()
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_the_prefetch_order_is_learned_from_the_calls():
    """A decoder run again and again: after the first pass, the block that ran next is read."""
    model = Stack()
    blocks = {"blocks.0", "blocks.1", "blocks.2"}
    units = UnitPlanner(model, {}, blocks=blocks).plan([("blocks", "cpu")])
    runtime = OffloadRuntime(units, "cpu", prefetch=1).attach()
    x = torch.randn(2, 8)
    order = [2, 0, 1, 2, 0, 1, 2, 0, 1]  # not module order
    for i in order:
        model.blocks[i](x)
    assert runtime.loads <= 4  # the first pass guesses module order; then every guess is right
    assert runtime.prefetched >= len(order) - 4


def test_a_negative_prefetch_is_refused():
    with pytest.raises(ValueError, match="prefetch=-2 must be >= 0"):
        OffloadRuntime([], "cpu", prefetch=-2)


def test_the_first_units_are_read_ahead_when_the_model_is_called():
    """Without watch_calls the first unit of a call (after release) is read when reached."""
    for watched, first_call_loads in ((False, 1), (True, 0)):
        model = Stack()
        blocks = {"blocks.0", "blocks.1", "blocks.2"}
        units = UnitPlanner(model, {}, blocks=blocks).plan([("blocks", "cpu")])
        runtime = OffloadRuntime(units, "cpu", prefetch=1).attach()
        if watched:
            runtime.watch_calls(model)
        ids = torch.randint(0, 10, (2, 5))
        model(ids)
        assert runtime.loads == first_call_loads
        runtime.release()  # nothing read ahead survives
        model(ids)
        assert runtime.loads == 2 * first_call_loads
