"""shard_ddp and zero1: the plan in one process; DDP, ZeRO-1 on 2 gloo ranks vs one process."""

from __future__ import annotations

import pytest
import torch

import retarget
from retarget.core.plans import AppliedPlan
from retarget.core.slots import APPLIED
from retarget.execution.step_guard import OptimizerNotPrepared
from retarget.passes.shard.shard_ddp import DdpOptions, plan_buckets, trainable_parameters
from retarget.passes.shard.zero1 import partition
from tests import zoo
from tests.distributed import run_ranks
from tests.sharded_training import (
    lm_batches,
    max_difference,
    mnist_batches,
    mnist_without_dropout,
    share,
    train,
)

LR = 0.1


# -- one process: the plan ------------------------------------------------------------------


def test_world_of_one_records_the_plan_and_says_it_was_not_applied():
    compiled = retarget.compile_for(zoo.tiny_llama(), "ddp", example_inputs=zoo.lm_inputs())
    plan = compiled.program.plan
    assert plan.ddp.world.size == 1 and plan.applied == AppliedPlan(
        applied=False, reason="world size is 1"
    )
    text = str(compiled.report)
    assert "plan not applied: world size is 1" in text
    assert "distribution plan" in text and "DDP buckets" in text
    assert list(compiled.state_dict()) == list(zoo.tiny_llama().state_dict())


def test_buckets_follow_ddps_rule_and_show_in_the_report():
    model = mnist_without_dropout()
    compiled = retarget.compile_for(
        model, "ddp[bucket_cap_mb=2]", example_inputs=zoo.mnist_cnn_inputs(), world_size=4
    )
    entry = compiled.program.plan.ddp
    assert entry.world.size == 4 and entry.options["bucket_cap_mb"] == 2
    # Reverse definition order; fc1.weight (4.5 MiB) fills the first bucket past 1 MiB.
    assert [b.parameters for b in entry.buckets] == [
        ("fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight"),
        ("conv2.bias", "conv2.weight", "conv1.bias", "conv1.weight"),
    ]
    assert sum(b.numel for b in entry.buckets) == sum(p.numel() for p in model.parameters())
    assert "2 buckets" in str(compiled.report)


def test_find_unused_parameters_keeps_the_initial_buckets():
    params = trainable_parameters(mnist_without_dropout())
    unused = plan_buckets(params, DdpOptions(bucket_cap_mb=2, find_unused_parameters=True))
    # Definition order, 1 MiB first bucket (conv1.weight .. fc1.weight), launched last first.
    assert [len(b.parameters) for b in unused] == [3, 5]
    assert [b.parameters[0] for b in unused] == ["fc1.bias", "conv1.weight"]


def test_zero1_partition_is_greedy_by_size():
    sizes = [torch.empty(n) for n in (5, 3, 3, 2, 1)]
    assert partition(sizes, 2) == [7, 7]
    assert partition(sizes, 1) == [14]


def test_a_target_without_ddp_has_no_ddp_plan():
    compiled = retarget.compile_for(
        zoo.mnist_cnn(), "single", example_inputs=zoo.mnist_cnn_inputs()
    )
    assert compiled.program.plan.ddp is None and compiled.program.plan.applied is None


# -- two ranks ------------------------------------------------------------------------------


def _ddp_ranks(rank, world):
    out = {}
    # tiny Llama, ddp, SGD: each rank trains on its half of every global batch.
    batches = lm_batches(3, 4)
    model = retarget.compile_for(zoo.tiny_llama(), "ddp", example_inputs=share(batches[0], 0, 2))
    reference = zoo.tiny_llama()
    run = model.runtime
    train(
        model,
        [share(b, rank, world) for b in batches],
        torch.optim.SGD(model.parameters(), LR),
        run.backward,
    )
    train(reference, batches, torch.optim.SGD(reference.parameters(), LR))
    out["llama"] = max_difference(model, reference)
    out["applied"] = model.program.plan.applied
    out["isinstance"] = isinstance(model, type(reference)) and isinstance(
        model, retarget.CompiledModule
    )
    out["keys"] = list(model.state_dict()) == list(reference.state_dict())
    model.eval()  # DDP follows the model's mode; eval is a new signature, captured under DDP
    reference.eval()
    with torch.no_grad():
        logits = model(input_ids=batches[0]["input_ids"]).logits
        expected = reference(input_ids=batches[0]["input_ids"]).logits
    ddp = APPLIED.get(model.program.module).ddp
    out["eval"] = (not ddp.training, (logits - expected).abs().max().item())

    # MNIST CNN with 2 MiB buckets: numerics and the buckets DDP really built.
    batches = mnist_batches(3, 4)
    model = retarget.compile_for(
        mnist_without_dropout(), "ddp[bucket_cap_mb=2]", example_inputs=zoo.mnist_cnn_inputs()
    )
    reference = mnist_without_dropout()
    train(model, [share(b, rank, world) for b in batches], torch.optim.SGD(model.parameters(), LR))
    train(reference, batches, torch.optim.SGD(reference.parameters(), LR))
    out["mnist"] = max_difference(model, reference)
    ddp = APPLIED.get(model.program.module).ddp
    built = ddp.reducer._get_zeros_like_grad_buckets()
    out["buckets_built"] = [len(b.parameters()) for b in built]
    out["buckets_planned"] = [len(b.parameters) for b in model.program.plan.ddp.buckets]

    # zero1 + SGD with momentum (state to shard) built before compile_for: prepared into a
    # ZeroRedundancyOptimizer. (Adam would amplify float rounding of near-zero gradients.)
    batches = lm_batches(3, 4, seed=3)
    original = zoo.tiny_llama()
    optimizer = torch.optim.SGD(original.parameters(), lr=LR, momentum=0.9)
    model = retarget.compile_for(original, "zero1", example_inputs=share(batches[0], 0, 2))
    prepared = model.runtime.prepare(optimizer)
    reference = zoo.tiny_llama()
    train(model, [share(b, rank, world) for b in batches], prepared, model.runtime.backward)
    train(reference, batches, torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9))
    out["zero1"] = max_difference(model, reference)
    out["zero1_type"] = type(prepared).__name__
    held = sum(p.numel() for p in prepared.optim.state if prepared.optim.state[p])
    out["zero1_state"] = held
    out["zero1_planned"] = model.program.plan.zero1.per_rank

    # zero1 with a plain optimizer: refused at its first step, the message says what to do.
    plain = torch.optim.SGD(model.parameters(), lr=LR)
    model.runtime.backward(model(**share(batches[0], rank, world)).loss)
    try:
        plain.step()
        out["unprepared"] = "stepped"
    except OptimizerNotPrepared as err:
        out["unprepared"] = str(err)

    # zero1 on the MNIST CNN, the optimizer created after compile_for and prepared.
    batches = mnist_batches(3, 4, seed=4)
    model = retarget.compile_for(
        mnist_without_dropout(), "zero1", example_inputs=zoo.mnist_cnn_inputs()
    )
    reference = mnist_without_dropout()
    zero = model.runtime.prepare(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    train(model, [share(b, rank, world) for b in batches], zero)
    train(reference, batches, torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9))
    out["zero1 mnist"] = max_difference(model, reference)
    return out


@pytest.mark.distributed
def test_ddp_and_zero1_on_two_ranks_match_one_process():
    for out in run_ranks(_ddp_ranks, 2):
        print({k: v for k, v in out.items() if isinstance(v, float)})
        # Measured: 7.5e-9 (tiny Llama), 1.2e-7 (MNIST), zero1 (SGD momentum) below.
        assert out["llama"] < 1e-6 and out["mnist"] < 1e-6
        assert out["zero1"] < 1e-6 and out["zero1 mnist"] < 1e-6
        assert out["applied"].applied and out["applied"].wrapped == "DistributedDataParallel"
        assert out["isinstance"] and out["keys"]
        assert out["eval"][0] and out["eval"][1] < 1e-5
        assert out["buckets_built"] == out["buckets_planned"] == [4, 4]
        assert out["zero1_type"] == "ZeroRedundancyOptimizer"
        assert out["zero1_state"] in out["zero1_planned"] and out["zero1_state"] < sum(
            out["zero1_planned"]
        )
        assert "runtime.prepare(optimizer)" in out["unprepared"] and "zero1" in out["unprepared"]
