"""Accelerate's N-D sizes (ParallelismConfig, TorchTensorParallelPlugin, launch flags) as
targets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from retarget.compat.accelerate.config_yaml import read_accelerate_config
from retarget.compat.accelerate.target_choice import resolve_target
from retarget.targets.errors import TargetError
from retarget.targets.grammar import Target
from retarget.targets.parallelism import parallelism_target


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
        (_sizes(cp_size=2), "fsdp+cp[size=2]"),
        (_sizes(dp_shard_size=2, cp_size=2), "fsdp+cp[size=2]"),
        (_sizes(dp_replicate_size=2, cp_size=2), "ddp+cp[size=2]"),
        ({"sp_size": 2}, "fsdp+cp[attention=ulysses,size=2]"),
        ({"cp_size": 2, "cp_comm_strategy": "allgather"}, "fsdp+cp[attention=allgather,size=2]"),
    ],
)
def test_sizes_become_the_target_with_that_mesh(sizes, target):
    assert str(parallelism_target(sizes, "ParallelismConfig")) == target


@pytest.mark.parametrize(
    "sizes, message",
    [
        (_sizes(dp_replicate_size=2, tp_size=2), "replication beside tensor parallelism"),
        (_sizes(cp_size=2, tp_size=2), "cp_size=2 beside tp_size: context parallelism"),
        ({"cp_size": 2, "sp_size": 2}, "both split the sequence"),
        ({"cp_size": 2, "cp_comm_strategy": "ring"}, "cp_comm_strategy='ring': one of"),
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


# -- the YAML parallelism_config section beside fsdp_config ----------------------------------


def _yaml(tmp_path, sizes: dict[str, object], fsdp: str) -> str:
    """What `accelerate config` writes for FSDP2 with N-D sizes; `fsdp` holds fsdp_config's
    strategy and option keys."""
    lines = "".join(f"  parallelism_config_{key}: {value}\n" for key, value in sizes.items())
    path = tmp_path / "accelerate.yaml"
    path.write_text(
        "distributed_type: FSDP\nmixed_precision: bf16\nnum_processes: 4\n"
        "fsdp_config:\n  fsdp_version: 2\n  fsdp_activation_checkpointing: true\n"
        f"{fsdp}parallelism_config:\n{lines}"
    )
    return str(path)


_SHARDED = "  fsdp_state_dict_type: SHARDED_STATE_DICT\n"
_ZERO2 = "  fsdp_reshard_after_forward: false\n"
_HYBRID = {"dp_replicate_size": 2, "dp_shard_size": 2}


@pytest.mark.parametrize(
    "sizes, fsdp, target",
    [
        (
            {"dp_replicate_size": 1, "dp_shard_size": 2, "tp_size": 2, "cp_size": 1},
            _SHARDED,
            "fsdp[state_dict=sharded]+tp[size=2]+bf16+ac",
        ),
        ({"dp_shard_size": 2, "tp_size": 2}, _ZERO2, "zero2+tp[size=2]+bf16+ac"),
        (_HYBRID, _SHARDED, "hsdp[replicate=2,shard=2,state_dict=sharded]+bf16+ac"),
        (_HYBRID, _ZERO2, "hsdp[replicate=2,reshard=false,shard=2]+bf16+ac"),
        # tp alone: sharded checkpoints are what tp writes anyway, so that option is accepted
        ({"tp_size": 2, "dp_shard_size": 1}, _SHARDED, "tp[size=2]+bf16+ac"),
        (
            {"dp_shard_size": 2, "cp_size": 2},
            _SHARDED,
            "fsdp[state_dict=sharded]+cp[size=2]+bf16+ac",
        ),
        (
            {"cp_size": 2, "cp_comm_strategy": "allgather"},
            "",
            "fsdp+cp[attention=allgather,size=2]+bf16+ac",
        ),
    ],
)  # fmt: skip
def test_yaml_parallelism_config_lays_out_the_fsdp_strategy(tmp_path, sizes, fsdp, target):
    got = read_accelerate_config(_yaml(tmp_path, sizes, fsdp)).target
    assert got == Target.parse(target)


@pytest.mark.parametrize(
    "sizes, fsdp, message",
    [
        ({"tp_size": 2, "cp_size": 2}, "", "cp_size=2 beside tp_size"),
        ({"tp_size": 2, "dp_replicate_size": 2}, "", "replication beside tensor parallelism"),
        (
            {"dp_shard_size": 4},
            "  fsdp_sharding_strategy: HYBRID_SHARD\n",
            "fsdp_config asks for hsdp, but the sizes lay out fsdp",
        ),
        (
            {"tp_size": 2},
            "  fsdp_state_dict_type: FULL_STATE_DICT\n",
            "shards nothing over data-parallel ranks, so fsdp_config's state_dict=full",
        ),
    ],
)
def test_yaml_parallelism_config_refusals_name_the_file_and_reason(tmp_path, sizes, fsdp, message):
    path = _yaml(tmp_path, sizes, fsdp)
    with pytest.raises(TargetError, match=message) as raised:
        read_accelerate_config(path)
    assert str(raised.value).startswith(f"{path}: ")


def test_yaml_parallelism_config_goes_with_fsdp_only(tmp_path):
    path = tmp_path / "ddp.yaml"
    path.write_text(
        "distributed_type: MULTI_CPU\nparallelism_config:\n  parallelism_config_tp_size: 2\n"
    )
    with pytest.raises(
        TargetError, match="parallelism_config: is set but distributed_type is MULTI"
    ):
        read_accelerate_config(path)
