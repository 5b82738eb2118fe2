"""Kwargs handlers: each field maps onto a target option or a runtime setting, or is refused."""

from __future__ import annotations

import datetime
import os

import pytest
import torch

from retarget.compat.accelerate.arguments import ProjectConfiguration
from retarget.compat.accelerate.kwargs_base import KwargsHandlerError
from retarget.compat.accelerate.kwargs_handlers import as_handler, collect_handlers
from retarget.compat.accelerate.precision_kwargs import (
    AORecipeKwargs,
    AutocastKwargs,
    FP8RecipeKwargs,
    GradScalerKwargs,
    MSAMPRecipeKwargs,
    TERecipeKwargs,
)
from retarget.compat.accelerate.process_kwargs import (
    DistributedDataParallelKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
)
from retarget.compat.accelerate.target_choice import resolve_target
from retarget.targets.grammar import TargetError


def target_of(*handlers, **kwargs) -> str:
    kwargs.setdefault("world_size", 2)
    return str(resolve_target(handlers=collect_handlers(handlers), **kwargs).target)


@pytest.mark.parametrize(
    ("handler", "expected"),
    [
        (DistributedDataParallelKwargs(), "ddp"),
        (DistributedDataParallelKwargs(bucket_cap_mb=50), "ddp[bucket_cap_mb=50]"),
        (
            DistributedDataParallelKwargs(find_unused_parameters=True),
            "ddp[find_unused_parameters=true]",
        ),
        (
            DistributedDataParallelKwargs(static_graph=True, gradient_as_bucket_view=True),
            "ddp[gradient_as_bucket_view=true,static_graph=true]",
        ),
        (DistributedDataParallelKwargs(broadcast_buffers=False), "ddp[broadcast_buffers=false]"),
        (DistributedDataParallelKwargs(comm_hook="fp16"), "ddp+fp16-comm"),
        (DistributedDataParallelKwargs(comm_hook="bf16"), "ddp+bf16-comm"),
        (DistributedDataParallelKwargs(comm_hook="power_sgd"), "ddp+powersgd"),
        (
            DistributedDataParallelKwargs(
                comm_hook="power_sgd",
                comm_wrapper="bf16",
                comm_state_option={
                    "matrix_approximation_rank": 4,
                    "start_powerSGD_iter": 2,
                    "min_compression_rate": 1.5,
                    "use_error_feedback": False,
                    "warm_start": False,
                },
            ),
            "ddp+powersgd[error_feedback=false,min_compression_rate=1.5,rank=4,start_iter=2,"
            "warm_start=false,wrapper=bf16]",
        ),
    ],
)
def test_ddp_fields_become_ddp_options_and_comm_parts(handler, expected):
    assert target_of(handler) == expected


def test_ddp_settings_apply_to_zero1_and_make_a_default_single_run_ddp():
    assert target_of(DistributedDataParallelKwargs(bucket_cap_mb=5), target="zero1") == (
        "zero1[bucket_cap_mb=5]"
    )
    # In a world of one the plan is recorded (and reported as not applied), never dropped.
    assert target_of(DistributedDataParallelKwargs(comm_hook="fp16"), world_size=1) == (
        "ddp+fp16-comm"
    )


@pytest.mark.parametrize(
    ("handler", "target", "message"),
    [
        (DistributedDataParallelKwargs(dim=1), None, r"\(dim=1\) cannot be honoured: DDP scatters"),
        (DistributedDataParallelKwargs(check_reduction=True), None, "deprecated in torch"),
        (DistributedDataParallelKwargs(comm_hook="batched_power_sgd"), None, "batched PowerSGD"),
        (DistributedDataParallelKwargs(comm_hook="int8"), None, "comm_hook='int8'"),
        (
            DistributedDataParallelKwargs(comm_hook="fp16", comm_wrapper="fp16"),
            None,
            "only comm_hook='power_sgd' takes one",
        ),
        (
            DistributedDataParallelKwargs(comm_state_option={"warm_start": False}),
            None,
            "it configures PowerSGD",
        ),
        (
            DistributedDataParallelKwargs(
                comm_hook="power_sgd", comm_state_option={"random_seed": 1}
            ),
            None,
            r"comm_state_option=\{'random_seed': \.\.\.\}",
        ),
        (
            DistributedDataParallelKwargs(comm_hook="bf16"),
            "fsdp",
            "distribution is 'fsdp'.*reduce dtype of the mixed-precision policy",
        ),
        (DistributedDataParallelKwargs(bucket_cap_mb=50), "single", "distribution is 'single'"),
        (
            DistributedDataParallelKwargs(bucket_cap_mb=50),
            "ddp[bucket_cap_mb=10]",
            r"sets ddp\[bucket_cap_mb=50\] but the target says ddp\[bucket_cap_mb=10\]",
        ),
    ],
)
def test_ddp_fields_that_cannot_be_honoured(handler, target, message):
    with pytest.raises(KwargsHandlerError, match=message):
        target_of(handler, target=target)


def test_accelerate_enum_values_are_read():
    class Hook:  # Accelerate's DDPCommunicationHookType is a str enum with .value
        value = "power_sgd"

    assert target_of(DistributedDataParallelKwargs(comm_hook=Hook())) == "ddp+powersgd"


@pytest.mark.parametrize(
    ("handler", "expected"),
    [
        (TERecipeKwargs(), "fp8[amax_history=1024,backend=te]"),
        (
            TERecipeKwargs(
                fp8_format="E4M3",
                amax_history_len=32,
                amax_compute_algo="max",
                margin=1,
                interval=2,
                override_linear_precision=(False, False, True),
                use_autocast_during_eval=True,
            ),
            "fp8[amax_algo=max,amax_history=32,autocast_eval=true,backend=te,format=e4m3,"
            "interval=2,margin=1,override_linear_precision=false|false|true]",
        ),
        (MSAMPRecipeKwargs(opt_level="O1"), "fp8[backend=msamp,opt_level=o1]"),
        (AORecipeKwargs(), "fp8[backend=torchao,scaling=current]"),
        (FP8RecipeKwargs(backend="TE", margin=2), "fp8[amax_history=1024,backend=te,margin=2]"),
        (FP8RecipeKwargs(backend="MSAMP"), "fp8[backend=msamp]"),
        (FP8RecipeKwargs(), "fp8"),
    ],
)
def test_fp8_recipes_become_fp8_options(handler, expected):
    assert target_of(handler, mixed_precision="fp8", world_size=1) == f"bf16+{expected}"


@pytest.mark.parametrize(
    ("handler", "message"),
    [
        (TERecipeKwargs(use_mxfp8_block_scaling=True), "use_mxfp8_block_scaling=True"),
        (TERecipeKwargs(fp8_format="E5M2"), "TERecipeKwargs.fp8_format: 'E5M2' is not one of"),
        (AORecipeKwargs(config=object()), r"AORecipeKwargs\(config=.*scaling=rowwise"),
        (AORecipeKwargs(module_filter_func=lambda m, n: True), "include=...,exclude="),
        (AORecipeKwargs(pad_inner_dim=True), "not padded"),
        (AORecipeKwargs(enable_fsdp_float8_all_gather=True), "high-precision weights"),
        (FP8RecipeKwargs(backend="XLA"), "backend='XLA'"),
        (FP8RecipeKwargs(backend="MSAMP", margin=1), "are Transformer Engine recipe fields"),
        (FP8RecipeKwargs(opt_level="O1"), "it is MS-AMP's"),
    ],
)
def test_fp8_fields_that_cannot_be_honoured(handler, message):
    with pytest.raises((KwargsHandlerError, TargetError), match=message):
        target_of(handler, mixed_precision="fp8")


def test_fp8_recipe_needs_fp8_and_a_single_place_for_its_options():
    with pytest.raises(KwargsHandlerError, match="pass mixed_precision='fp8'"):
        target_of(TERecipeKwargs(margin=1), mixed_precision="bf16")
    with pytest.raises(KwargsHandlerError, match="fp8\\[...\\] options both configure fp8"):
        target_of(TERecipeKwargs(margin=1), target="ddp+bf16+fp8[margin=2]")
    with pytest.raises(KwargsHandlerError, match="several FP8 recipes"):
        collect_handlers([TERecipeKwargs(), AORecipeKwargs()])


def test_grad_scaler_maps_onto_fp16():
    handler = GradScalerKwargs(init_scale=1024, growth_interval=10, backoff_factor=0.25)
    assert target_of(handler, mixed_precision="fp16") == (
        "ddp+fp16[backoff_factor=0.25,growth_interval=10,init_scale=1024.0]"
    )
    assert target_of(GradScalerKwargs(), mixed_precision="bf16") == "ddp+bf16"  # all defaults
    with pytest.raises(KwargsHandlerError, match="pass mixed_precision='fp16'"):
        target_of(GradScalerKwargs(init_scale=8), mixed_precision="bf16")
    with pytest.raises(KwargsHandlerError, match=r"enabled=False\) cannot be honoured.*bf16"):
        target_of(GradScalerKwargs(enabled=False), mixed_precision="fp16")


def test_init_process_group_settings():
    InitProcessGroupKwargs(init_method="env://").check()
    with pytest.raises(KwargsHandlerError, match="init_method='tcp://h:1'"):
        InitProcessGroupKwargs(init_method="tcp://h:1").check()
    handler = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=42))
    before = os.environ.get("RETARGET_TIMEOUT_S")
    with handler.environment():
        assert os.environ["RETARGET_TIMEOUT_S"] == "42.0"
    assert os.environ.get("RETARGET_TIMEOUT_S") == before


def test_autocast_kwargs():
    assert AutocastKwargs().autocast_kwargs() == {"enabled": True}
    assert AutocastKwargs(enabled=False, cache_enabled=False).autocast_kwargs() == {
        "enabled": False,
        "cache_enabled": False,
    }


def test_profile_kwargs_build_a_profiler_and_refuse_missing_devices():
    profiler = ProfileKwargs(activities=["cpu"], record_shapes=True).build()
    with profiler:
        torch.ones(4) @ torch.ones(4)
    assert any("aten::dot" in e.key for e in profiler.key_averages())
    if not torch.cuda.is_available():
        with pytest.raises(KwargsHandlerError, match="no cuda device"):
            ProfileKwargs(activities=["cuda"]).build()
    with pytest.raises(KwargsHandlerError, match="'tpu' is not one of"):
        ProfileKwargs(activities=["tpu"]).build()
    with pytest.raises(KwargsHandlerError, match="schedule_option"):
        ProfileKwargs(schedule_option={"wait": 1, "bogus": 2}).build()


def test_project_configuration_defaults_logging_dir():
    assert ProjectConfiguration(project_dir="p").logging_dir == "p"
    assert ProjectConfiguration(project_dir="p", logging_dir="l").logging_dir == "l"


def test_handlers_are_collected_once_each_and_foreign_ones_converted():
    with pytest.raises(KwargsHandlerError, match="two DistributedDataParallelKwargs"):
        collect_handlers([DistributedDataParallelKwargs(), DistributedDataParallelKwargs()])
    with pytest.raises(KwargsHandlerError, match="holds a dict, which retarget does not know"):
        collect_handlers([{"bucket_cap_mb": 5}])

    class DistributedDataParallelKwargsLike:  # a foreign handler of the same name
        def __init__(self):
            self.bucket_cap_mb = 5

    DistributedDataParallelKwargsLike.__name__ = "DistributedDataParallelKwargs"
    assert as_handler(DistributedDataParallelKwargsLike()) == DistributedDataParallelKwargs(
        bucket_cap_mb=5
    )

    class GradScalerKwargsLike:
        def __init__(self):
            self.dynamic = True

    GradScalerKwargsLike.__name__ = "GradScalerKwargs"
    with pytest.raises(KwargsHandlerError, match=r"GradScalerKwargs\(dynamic\).*no such field"):
        as_handler(GradScalerKwargsLike())


def test_accelerates_own_handlers_convert():
    utils = pytest.importorskip("accelerate.utils")
    handlers = collect_handlers(
        [
            utils.DistributedDataParallelKwargs(comm_hook="bf16", bucket_cap_mb=10),
            utils.InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=5)),
        ]
    )
    assert str(resolve_target(handlers=handlers, world_size=2).target) == (
        "ddp[bucket_cap_mb=10]+bf16-comm"
    )
    # Accelerate's default backend ("nccl") is not passed on, as Accelerate itself does not.
    assert handlers[InitProcessGroupKwargs].backend is None


def test_ddp_communication_hook_type_has_accelerates_members_and_maps_as_its_strings():
    from accelerate.utils import DDPCommunicationHookType as Theirs

    from retarget import DDPCommunicationHookType

    assert {m.name: m.value for m in DDPCommunicationHookType} == {m.name: m.value for m in Theirs}
    parts = {"FP16": "ddp+fp16-comm", "BF16": "ddp+bf16-comm", "POWER_SGD": "ddp+powersgd"}
    for member, target in parts.items():
        handler = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType[member])
        assert target_of(handler) == target
    with pytest.raises(KwargsHandlerError, match="comm_hook"):
        target_of(
            DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.BATCHED_POWER_SGD)
        )
