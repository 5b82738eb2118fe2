"""Accelerate's N-D sizes (ParallelismConfig, TorchTensorParallelPlugin, launch flags) as
targets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from retarget.accelerate.target_choice import resolve_target
from retarget.target.errors import TargetError
from retarget.target.parallelism import parallelism_target


def _sizes(**given: int) -> dict[str, int]:
    return {"dp_replicate_size": 1, "dp_shard_size": 1, "tp_size": 1, "cp_size": 1, **given}


@pytest.mark.parametrize(
    "sizes, target",
    [
        (_sizes(tp_size=2), "tp[size=2]"),
        (_sizes(dp_shard_size=2, tp_size=2), "fsdp+tp[size=2]"),
        (_sizes(dp_shard_size=4), "fsdp"),
        (_sizes(dp_replicate_size=2, dp_shard_size=2), "hsdp[replicate=2,shard=2]"),
        (_sizes(dp_replicate_size=2), "ddp"),
        ({"tp_size": "2"}, "tp[size=2]"),
    ],
)
def test_sizes_become_the_target_with_that_mesh(sizes, target):
    assert str(parallelism_target(sizes, "ParallelismConfig")) == target


@pytest.mark.parametrize(
    "sizes, message",
    [
        (_sizes(dp_replicate_size=2, tp_size=2), "replication beside tensor parallelism"),
        (_sizes(cp_size=2), "ParallelismConfig.cp_size=2: context parallelism"),
        ({"sp_size": 2}, r"sequence parallelism \(Ulysses\) is not implemented"),
        (_sizes(), "every size is 1"),
        ({"tp_size": 0}, "expected a whole number >= 1"),
        ({"tp_size": "two"}, "expected a whole number"),
    ],
)
def test_layouts_not_implemented_are_refused_with_the_reason(sizes, message):
    with pytest.raises(TargetError, match=message):
        parallelism_target(sizes, "ParallelismConfig")


def test_the_accelerator_arguments_choose_the_target():
    config = SimpleNamespace(**_sizes(dp_shard_size=2, tp_size=2))
    resolved = resolve_target(parallelism_config=config, mixed_precision="bf16", world_size=4)
    assert str(resolved.target) == "fsdp+tp[size=2]+bf16"
    assert resolved.origin == "parallelism_config"
    plugin = SimpleNamespace(tp_size=2)
    alone = resolve_target(torch_tp_plugin=plugin, world_size=2)
    assert str(alone.target) == "tp[size=2]"
    beside = resolve_target(torch_tp_plugin=plugin, fsdp_plugin={"fsdp_version": 2}, world_size=4)
    assert str(beside.target) == "fsdp+tp[size=2]"
    assert beside.origin == "fsdp_plugin + torch_tp_plugin"
    with pytest.raises(TargetError, match="give the layout in one place"):
        resolve_target(torch_tp_plugin=plugin, target="fsdp", world_size=4)
    with pytest.raises(TargetError, match="both choose the distribution"):
        resolve_target(parallelism_config=config, target="fsdp", world_size=4)
