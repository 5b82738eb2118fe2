"""core/plans.py: frozen plan records, what each pass writes, and their JSON form."""

from __future__ import annotations

import dataclasses
import json

import pytest

import retarget
from retarget.core.plans import CommHookPlan, DdpPlan, FsdpPlan, LossScalerPlan, Plan, Zero1Plan
from retarget.core.world import World
from tests import zoo


def test_records_are_frozen():
    hook = CommHookPlan(part="fp16-comm", kind="cast", dtype="float16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        hook.dtype = "bfloat16"


def test_each_pass_writes_its_record_and_nothing_else():
    example = zoo.mnist_cnn_inputs()
    ddp = retarget.compile_for(zoo.mnist_cnn(), "zero1+fp16+fp16-comm", example_inputs=example)
    plan = ddp.program.plan
    assert isinstance(plan.ddp, DdpPlan) and isinstance(plan.zero1, Zero1Plan)
    assert isinstance(plan.loss_scaler, LossScalerPlan) and plan.comm_hook.part == "fp16-comm"
    assert plan.fsdp is None and plan.fp8 is None and plan.distribution is plan.ddp
    fsdp = retarget.compile_for(zoo.mnist_cnn(), "fsdp", example_inputs=example, world_size=2)
    plan = fsdp.program.plan
    assert isinstance(plan.fsdp, FsdpPlan) and plan.distribution is plan.fsdp
    assert plan.ddp is None and plan.zero1 is None and plan.comm_hook is None


def test_to_dict_is_json_with_only_the_records_that_are_set():
    world = World(size=2, local_size=2, source="stated")
    plan = Plan(
        zero1=Zero1Plan(optimizer="ZeroRedundancyOptimizer", world=world, per_rank=(3, 2)),
        comm_hook=CommHookPlan(part="powersgd", kind="powersgd", powersgd={"rank": 1}),
    )
    as_dict = plan.to_dict()
    assert set(as_dict) == {"zero1", "comm_hook"}
    assert as_dict["zero1"] == {
        "optimizer": "ZeroRedundancyOptimizer",
        "world": {"size": 2, "local_size": 2, "source": "stated"},
        "per_rank": [3, 2],
    }
    assert as_dict["comm_hook"]["powersgd"] == {"rank": 1}
    json.dumps(as_dict)


def test_the_report_carries_the_plan_as_json():
    compiled = retarget.compile_for(
        zoo.mnist_cnn(), "ddp", example_inputs=zoo.mnist_cnn_inputs(), world_size=2
    )
    report = compiled.report.to_dict()
    assert report["plan"]["ddp"]["world"]["size"] == 2
    assert report["plan"]["applied"] == {
        "applied": False,
        "reason": "world size is 1",
        "world_size": 1,
        "backend": "",
        "device": "",
        "wrapped": "",
    }
    json.dumps(report)


def test_comm_hook_plan_describes_itself():
    cast = CommHookPlan(part="bf16-comm", kind="cast", dtype="bfloat16")
    assert cast.describe().startswith("bf16-comm: buckets all-reduced in bfloat16")
    options = {
        "rank": 2,
        "start_iter": 3,
        "min_compression_rate": 2.0,
        "error_feedback": True,
        "warm_start": False,
        "wrapper": "fp16",
    }
    text = CommHookPlan(part="powersgd", kind="powersgd", powersgd=options).describe()
    assert "rank-2 approximation after 3 plain all-reduce steps" in text
    assert "sent in fp16 (comm wrapper)" in text
