"""Which target an Accelerator trains for: target=, plugins, the launch, world size, precision."""

from __future__ import annotations

import functools

import pytest

from retarget.compat.accelerate.target_choice import resolve_target
from retarget.targets.grammar import TargetError


def target_of(**kwargs) -> str:
    return str(resolve_target(**kwargs).target)


@pytest.fixture(autouse=True)
def not_launched(monkeypatch):
    monkeypatch.delenv("RETARGET_TARGET", raising=False)


def test_default_follows_the_world_size_and_precision_is_added():
    assert target_of() == "single"
    assert target_of(world_size=2) == "ddp"
    assert target_of(world_size=2, mixed_precision="bf16") == "ddp+bf16"
    assert target_of(mixed_precision="fp8") == "bf16+fp8"  # Accelerate runs the rest in bf16
    assert target_of(mixed_precision="no") == "single"
    resolution = resolve_target(world_size=2)
    assert resolution.origin == "default for 2 processes"


def test_launched_target_and_mixed_precision_override(monkeypatch):
    monkeypatch.setenv("RETARGET_TARGET", "fsdp+bf16")
    assert target_of(world_size=2) == "fsdp+bf16"
    # The script's argument wins over the launch, as Accelerate's does over its config.
    assert target_of(world_size=2, mixed_precision="fp16") == "fsdp+fp16"
    assert resolve_target(world_size=2).origin == "$RETARGET_TARGET"


def test_explicit_target_and_mixed_precision_must_agree():
    assert target_of(target="zero2", mixed_precision="bf16") == "zero2+bf16"
    assert target_of(target="fsdp+bf16", mixed_precision="bf16") == "fsdp+bf16"
    with pytest.raises(TargetError, match="target='fsdp\\+bf16' says bf16 but mixed_precision"):
        target_of(target="fsdp+bf16", mixed_precision="fp16")
    with pytest.raises(TargetError, match="mixed_precision='int4': use one of no, bf16"):
        target_of(mixed_precision="int4")


def test_fsdp_plugin_fields_map_through_the_accelerate_tables():
    plugin = {
        "reshard_after_forward": False,
        "cpu_offload": True,
        "activation_checkpointing": True,
        "state_dict_type": "FULL_STATE_DICT",
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_cls_names_to_wrap": ["BertLayer"],
        "use_orig_params": True,
        "min_num_params": 100,
    }
    assert target_of(fsdp_plugin=plugin, mixed_precision="bf16") == (
        "zero2[min_params=100,state_dict=full]+bf16+ac+offload"
    )
    assert target_of(fsdp_plugin={"sharding_strategy": "HYBRID_SHARD"}) == "hsdp"
    assert target_of(fsdp_plugin={"fsdp_sharding_strategy": "FULL_SHARD"}) == "fsdp"


@pytest.mark.parametrize(
    ("plugin", "message"),
    [
        ({"mixed_precision_policy": "bf16"}, "mixed_precision_policy='bf16'.*mixed_precision="),
        ({"ignored_modules": ["x"]}, "ignored_modules=\\['x'\\] cannot be honoured"),
        ({"param_init_fn": print}, "param_init_fn is not called"),
        ({"limit_all_gathers": False}, "limit_all_gathers=False.*prefetching"),
        ({"backward_prefetch": "BACKWARD_POST"}, "fsdp_plugin.backward_prefetch: 'BACKWARD_POST'"),
        ({"activation_checkpointing_offload": True}, "fsdp_plugin.activation_checkpointing_off"),
        ({"auto_wrap_policy": lambda m, r, n: True}, "fsdp_plugin.auto_wrap_policy"),
        ({"sharding_strategy": "NO_SHARD", "reshard_after_forward": True}, "keep one of them"),
        ({"shard_everything": True}, "fsdp_plugin.shard_everything: unknown field"),
    ],
)
def test_fsdp_plugin_fields_that_cannot_be_honoured(plugin, message):
    with pytest.raises(TargetError, match=message):
        target_of(fsdp_plugin=plugin)


def test_deepspeed_plugin_stages_offload_and_accumulation():
    assert target_of(deepspeed_plugin={"zero_stage": 3}) == "zero3"
    assert target_of(deepspeed_plugin={"zero_stage": 0}) == "ddp"
    assert (
        target_of(deepspeed_plugin={"zero_stage": 2, "offload_optimizer_device": "cpu"})
        == "zero2+offload[params=false]"
    )
    resolved = resolve_target(
        deepspeed_plugin={
            "zero_stage": 1,
            "gradient_accumulation_steps": 4,
            "gradient_clipping": "auto",
        }
    )
    assert resolved.gradient_accumulation_steps == 4 and str(resolved.target) == "zero1"


@pytest.mark.parametrize(
    ("plugin", "message"),
    [
        ({"zero_stage": 2, "gradient_clipping": 1.0}, "clip in the training loop"),
        ({"zero_stage": 3, "offload_param_device": "nvme"}, "nvme offload"),
        ({"zero_stage": 2, "enable_msamp": True}, "FP8RecipeKwargs\\(backend='MSAMP'\\)"),
        ({"zero_stage": 2, "hf_ds_config": {"optimizer": {"type": "Adam"}}}, "JSON configs"),
        ({"offload_param_device": "cpu"}, "zero_stage is not set"),
    ],
)
def test_deepspeed_plugin_fields_that_cannot_be_honoured(plugin, message):
    with pytest.raises(TargetError, match=message):
        target_of(deepspeed_plugin=plugin)


def test_one_place_chooses_the_distribution():
    with pytest.raises(TargetError, match="target= and fsdp_plugin both choose"):
        target_of(target="ddp", fsdp_plugin={})


def test_accelerates_own_plugin_objects():
    utils = pytest.importorskip("accelerate.utils")
    plugin = utils.FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=True, state_dict_type="SHARDED_STATE_DICT"
    )
    assert target_of(fsdp_plugin=plugin) == "fsdp"
    offload = utils.FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload=True)
    assert target_of(fsdp_plugin=offload) == "fsdp+offload"
    wrap = utils.FullyShardedDataParallelPlugin(
        auto_wrap_policy="transformer_based_wrap", sharding_strategy="SHARD_GRAD_OP"
    )
    # Accelerate's FSDP1 defaults are spelled out in its object, and they are honoured.
    assert target_of(fsdp_plugin=wrap) == "zero2[state_dict=full,sync_module_states=false]"
    assert target_of(deepspeed_plugin=utils.DeepSpeedPlugin(zero_stage=2)) == "zero2"


def test_partial_wrap_policies_are_read_by_their_function():
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=10)
    assert target_of(fsdp_plugin={"auto_wrap_policy": policy}) == "fsdp"
