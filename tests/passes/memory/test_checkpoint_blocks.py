"""checkpoint_blocks (ac): numerics against no-ac, the recompute really happening, memory it
saves, the budget solver, guards (BatchNorm, hooks, lazy capture), no-op and bad input."""

from __future__ import annotations

import gc
import itertools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import retarget
from retarget.core.errors import PassError
from retarget.core.module_record import record_of
from retarget.execution.checkpoint import FULL, NONE, POLICIES
from retarget.models import TinyConfig, synthetic_batch, tiny_lm
from retarget.passes.memory.activation_profile import ActivationProfile, BlockProfile
from retarget.passes.memory.budget import BudgetError, cost, solve_budget
from retarget.passes.memory.checkpoint_blocks import CheckpointOptions
from retarget.passes.memory.measure import measure_training_step
from tests.conftest import assert_same_step, step, to_device
from tests.distributed import run_ranks
from tests.memory_ranks import fsdp_bf16_ac_rank
from tests.zoo import ZOO, call, loss_of

BLOCK_MODELS = [name for name, entry in ZOO.items() if entry.repeated_block_type]
#: A deep, narrow model with long sequences: activations dominate and grow with depth.
DEEP = dict(hidden=32, heads=2, layers=8, max_seq=512, vocab_size=64)


def _record(compiled):
    return next(r for r in compiled.history if r.name == "checkpoint_blocks")


def _deep_model():
    torch.manual_seed(0)
    return tiny_lm(**DEEP)


def _deep_batch():
    generator = torch.Generator().manual_seed(0)
    return synthetic_batch(TinyConfig(**DEEP), batch=2, seq=512, generator=generator)


# -- numerics ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", BLOCK_MODELS)
def test_full_is_bitwise_equal_to_no_ac(name, device):
    """Loss, every gradient and every buffer (BatchNorm stats) equal eager's after a step."""
    entry = ZOO[name]
    inputs = to_device(entry.inputs(2), device)
    eager = to_device(entry.factory(), device)
    compiled = retarget.compile_for(to_device(entry.factory(), device), "ac", example_inputs=inputs)
    repeats = sum(len(group.paths) for group in compiled.program.blocks)
    assert _record(compiled).stats["checkpointed"] == repeats > 0
    assert_same_step(eager, compiled, inputs)
    for (key, a), b in zip(eager.state_dict().items(), compiled.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name}: {key} differs after a step"


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("tiny_gpt2", "ac[every=2]"),  # dropout, graph region
        ("tiny_gpt2", "ac[policy=selective]"),
        ("tiny_llama", "ac[policy=selective]"),  # HF Llama: scoped graph (selective_scope.py)
        ("small_cnn", "ac[policy=selective]"),  # BatchNorm recomputed op by op
        ("uncapturable_block_model", "ac[policy=selective]"),  # eager region
        ("tiny_llama", "ac[budget=0.5]"),
    ],
)
def test_every_selective_and_budget_are_bitwise_equal_to_no_ac(name, target, device):
    entry = ZOO[name]
    inputs = to_device(entry.inputs(2), device)
    eager = to_device(entry.factory(), device)
    compiled = retarget.compile_for(
        to_device(entry.factory(), device), target, example_inputs=inputs
    )
    assert _record(compiled).changed
    assert_same_step(eager, compiled, inputs)
    assert all(torch.equal(a, b) for a, b in zip(eager.buffers(), compiled.buffers(), strict=True))


def test_selective_on_tinylm_is_bitwise_equal_to_no_ac():
    batch = _deep_batch()
    eager = _deep_model()
    compiled = retarget.compile_for(_deep_model(), "ac[policy=selective]", example_inputs=batch)
    assert _record(compiled).stats["selective"] == DEEP["layers"]
    assert_same_step(eager, compiled, batch)


def test_dropout_masks_follow_the_seed_under_recompute():
    """Same seed -> same result; another seed -> another result (dropout is really on)."""
    entry = ZOO["tiny_bert"]
    inputs = entry.inputs(2)
    compiled = retarget.compile_for(entry.factory(), "ac", example_inputs=inputs)
    first, grads_1 = step(compiled, inputs, seed=3)
    again, grads_2 = step(compiled, inputs, seed=3)
    other, _ = step(compiled, inputs, seed=4)
    assert torch.equal(first, again) and all(torch.equal(grads_1[k], grads_2[k]) for k in grads_1)
    assert not torch.equal(first, other)


def test_bf16_plus_ac_equals_bf16_and_stays_within_bf16_tolerance():
    entry = ZOO["tiny_llama"]
    inputs = entry.inputs(2)
    bf16 = retarget.compile_for(entry.factory(), "bf16", example_inputs=inputs)
    both = retarget.compile_for(entry.factory(), "bf16+ac", example_inputs=inputs)
    assert [r.name for r in both.history][-2:] == ["insert_autocast", "checkpoint_blocks"]
    assert_same_step(bf16, both, inputs)
    loss_fp32, grads_fp32 = step(entry.factory(), inputs)
    loss_ac, grads_ac = step(both, inputs)
    # insert_autocast's measured bounds on the zoo: loss within 3e-3, grads 3% relative.
    assert abs(loss_ac - loss_fp32) < 3e-3
    for key, grad in grads_fp32.items():
        assert (grads_ac[key] - grad).norm() <= 0.03 * grad.norm() + 1e-6, key


@pytest.mark.distributed
def test_fsdp_bf16_ac_equals_fsdp_bf16_on_two_ranks():
    """Checkpointing runs before sharding; each FSDP unit recomputes its own block, exactly."""
    for rank in run_ranks(fsdp_bf16_ac_rank, 2):
        assert rank["equal"]
        assert rank["passes"][-3:] == ["checkpoint_blocks", "shard_fsdp", "apply_plan"]


# -- the recompute really happens -----------------------------------------------------------------
def _backward_flops(compiled, inputs) -> int:
    loss = loss_of(call(compiled, inputs))
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return counter.get_total_flops()


def test_full_recomputes_each_block_forward_and_selective_no_matmul():
    """Backward FLOPs grow by exactly the predicted recompute FLOPs: the blocks' forward matmuls
    under full, half of them under every=2, none under selective (it keeps matmul outputs)."""
    entry = ZOO["tiny_llama"]
    inputs = entry.inputs(2)
    baseline = _backward_flops(retarget.compile_for(entry.factory(), example_inputs=inputs), inputs)
    extra = {}
    for target in ("ac", "ac[every=2]", "ac[policy=selective]"):
        compiled = retarget.compile_for(entry.factory(), target, example_inputs=inputs)
        extra[target] = _backward_flops(compiled, inputs) - baseline
        assert extra[target] == _record(compiled).stats["recompute_flops"], target
    assert extra["ac"] > 0 and extra["ac[every=2]"] * 2 == extra["ac"]
    assert extra["ac[policy=selective]"] == 0
    assert _record(compiled).stats["recompute_elements"] > 0


def test_eager_region_block_runs_twice_per_step():
    entry = ZOO["uncapturable_block_model"]
    inputs = entry.inputs(2)
    compiled = retarget.compile_for(entry.factory(), "ac", example_inputs=inputs)
    assert compiled.program.regions[0].eager_only
    calls = []
    compiled.blocks[0].fc1.register_forward_hook(lambda *_: calls.append(1))
    loss = loss_of(call(compiled, inputs))
    forward_calls = len(calls)
    loss.backward()
    assert forward_calls >= 1 and len(calls) == 2 * forward_calls


# -- purpose -------------------------------------------------------------------------------------
def test_full_halves_peak_and_budget_lands_on_its_budget():
    """Deep narrow model, long sequences: full ac at least halves the step's peak memory, and
    ac[budget=0.5] keeps within 10% of half the activations kept without checkpointing."""
    batch = _deep_batch()
    measured = {}
    for target in ("single", "ac", "ac[budget=0.5]"):
        compiled = retarget.compile_for(_deep_model(), target, example_inputs=batch)
        measured[target] = measure_training_step(lambda c=compiled: c(**batch)["loss"])
    none, full, budget = measured["single"], measured["ac"], measured["ac[budget=0.5]"]
    assert full.peak <= 0.5 * none.peak, (full, none)
    assert 0.9 * 0.5 <= budget.activations / none.activations <= 1.1 * 0.5, (budget, none)


def test_selective_cuts_activations_by_over_a_third():
    """The op-level policy (keep matmul and attention outputs) on a bench-shaped model: at least
    35% fewer bytes alive after forward than without checkpointing, as predicted (within 5%)."""
    batch = _deep_batch()
    measured = {}
    for target in ("single", "ac[policy=selective]"):
        compiled = retarget.compile_for(_deep_model(), target, example_inputs=batch)
        measured[target] = measure_training_step(lambda c=compiled: c(**batch)["loss"])
    none, selective = measured["single"], measured["ac[policy=selective]"]
    assert selective.activations <= 0.65 * none.activations, (selective, none)
    predicted = _record(compiled).stats["activations_after"]
    assert abs(predicted - selective.activations) <= 0.05 * selective.activations


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_selective_under_compile_trains_and_keeps_its_cut(backend):
    """Compiled blocks run under torch's whole-block selective form (checkpoint_blocks). aot_eager
    runs the same aten ops: bitwise equal to uncompiled selective, same bytes kept. inductor
    (its generated code writes matmuls into its own buffers, never kept): within its numerics,
    and the activation cut holds."""
    batch = _deep_batch()
    plain = retarget.compile_for(_deep_model(), "ac[policy=selective]", example_inputs=batch)
    target = f"ac[policy=selective]+compile[backend={backend}]"
    compiled = retarget.compile_for(_deep_model(), target, example_inputs=batch)
    none = retarget.compile_for(_deep_model(), "single", example_inputs=batch)
    for _ in range(2):  # the second step runs the compiled code as compiled the first time
        memory = measure_training_step(lambda: compiled(**batch)["loss"])
        compiled.zero_grad(set_to_none=True)
    reference = measure_training_step(lambda: plain(**batch)["loss"])
    plain.zero_grad(set_to_none=True)
    baseline = measure_training_step(lambda: none(**batch)["loss"])
    loss = compiled(**batch)["loss"]
    loss.backward()
    expected = plain(**batch)["loss"]
    expected.backward()
    assert memory.activations <= 0.65 * baseline.activations, (memory, baseline)
    pairs = list(zip(plain.named_parameters(), compiled.parameters(), strict=True))
    if backend == "aot_eager":
        assert memory.activations == reference.activations
        assert torch.equal(loss, expected)
        assert all(torch.equal(a.grad, b.grad) for (_, a), b in pairs)
    else:
        assert torch.isfinite(loss) and abs(loss - expected) <= 1e-5 * abs(expected)
        for (name, a), b in pairs:
            assert (a.grad - b.grad).norm() <= 1e-4 * a.grad.norm() + 1e-7, name


def _graph_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.grad_fn)


def test_profiling_leaves_no_forward_alive():
    """The activation profile's forward is freed: its saved-tensor hook once returned the tensor
    itself, and a node saving its own output (rsqrt) then held it in a cycle through C++ that
    gc never frees, with every activation and transposed weight of the forward."""
    batch = _deep_batch()
    before = _graph_tensors()
    compiled = retarget.compile_for(_deep_model(), "ac", example_inputs=batch)
    assert compiled.program.analysis.activation_profile is not None  # the profile ran
    # Nothing of the profile's forward is left; earlier tests' graphs in the same process may
    # be freed meanwhile (the full suite once had one fewer afterwards), never more.
    assert _graph_tensors() <= before


# -- structure -----------------------------------------------------------------------------------
def test_summary_keys_and_classes():
    entry = ZOO["tiny_llama"]
    original = entry.factory()
    compiled = retarget.compile_for(original, "ac[every=2]", example_inputs=entry.inputs(2))
    record = _record(compiled)
    assert record.notes[0] == (
        "model.layers.*: 1 full of 2 repeats checkpointed (torch.utils.checkpoint, "
        "non-reentrant, around each call; the block runs its captured graph again in backward)"
    )
    assert {k: record.stats[k] for k in ("policy", "checkpointed", "repeats", "full")} == {
        "policy": "full",
        "checkpointed": 1,
        "repeats": 2,
        "full": 1,
    }
    layers = compiled.model.layers
    assert record_of(layers[0]).checkpoint is None
    assert record_of(layers[1]).checkpoint.policy == "full"
    assert type(layers[1]).__name__ == "RetargetedLlamaDecoderLayer"
    assert isinstance(layers[1], type(original.model.layers[1]))
    assert list(compiled.state_dict()) == list(original.state_dict())
    assert compiled.program.analysis.checkpoint["plan"] == {
        "model.layers.0": NONE,
        "model.layers.1": FULL,
    }


def test_eval_and_no_grad_run_without_checkpoint():
    entry = ZOO["tiny_gpt2"]
    inputs = entry.inputs(2)
    eager = entry.factory().eval()
    compiled = retarget.compile_for(entry.factory(), "ac", example_inputs=inputs).eval()
    with torch.no_grad():
        assert torch.equal(call(eager, inputs).logits, call(compiled, inputs).logits)


def test_lazy_capture_happens_outside_the_checkpoint():
    entry = ZOO["tiny_llama"]
    inputs = entry.inputs(2)
    compiled = retarget.compile_for(entry.factory(), "ac")
    record = _record(compiled)
    assert record.changed and "no example_inputs" in record.notes[-1]
    assert_same_step(entry.factory(), compiled, inputs)
    assert compiled.program.regions[0].frontend == "export"


def test_hooks_inside_eager_checkpointed_blocks_are_reported():
    entry = ZOO["uncapturable_block_model"]
    model = entry.factory()
    model.blocks[1].fc2.register_forward_hook(lambda *_: None)
    compiled = retarget.compile_for(model, "ac", example_inputs=entry.inputs(2))
    notes = "\n".join(_record(compiled).notes)
    assert "blocks.1: forward hooks on fc2 run again when backward recomputes the block" in notes


def test_batchnorm_guard_is_reported():
    entry = ZOO["small_cnn"]
    compiled = retarget.compile_for(entry.factory(), "ac", example_inputs=entry.inputs(2))
    notes = _record(compiled).notes
    assert any(n.startswith("layer1.0: 2 BatchNorm running stats restored") for n in notes)


# -- budget solver -------------------------------------------------------------------------------
def _synthetic_profile() -> ActivationProfile:
    """Three repeats with different sizes and costs; storage ids are labels."""
    blocks = {}
    for k, (saved, kept, flops, elements) in enumerate(
        [(1000, 400, 5000, 300), (800, 500, 9000, 100), (1200, 300, 2000, 900)]
    ):
        base = 100 * (k + 1)
        blocks[f"b{k}"] = BlockProfile(
            path=f"b{k}",
            group="b.*",
            saved={base: 50, base + 1: saved},
            inputs={base: 50},
            kept={base + 2: kept},
            flops=flops,
            kept_flops=flops,
            elements=elements,
            kept_elements=elements // 3,
        )
    return ActivationProfile(blocks=blocks, glue={1: 700})


def test_budget_solver_finds_the_cheapest_plan_that_fits():
    profile = _synthetic_profile()
    combos = itertools.product(POLICIES, repeat=3)
    plans = [dict(zip(profile.blocks, combo, strict=True)) for combo in combos]
    for budget in (900, 1400, 1800, 2300, 3000, 4000):
        fitting = [p for p in plans if profile.bytes(p) <= budget]
        best = min(sum(cost(profile, path, pol) for path, pol in p.items()) for p in fitting)
        solved = solve_budget(profile, budget)
        assert solved.predicted <= budget
        assert sum(cost(profile, path, pol) for path, pol in solved.plan.items()) == best, budget


def test_budget_below_the_floor_says_the_minimum():
    with pytest.raises(BudgetError, match="below the minimum 850 bytes"):
        solve_budget(_synthetic_profile(), 849)


def test_budget_below_the_floor_fails_compile_with_the_minimum():
    entry = ZOO["small_cnn"]
    with pytest.raises(PassError, match=r"minimum [\d,]+ bytes \(0\.52 of .*ac\[budget=0\.53\]"):
        retarget.compile_for(entry.factory(), "ac[budget=0.1]", example_inputs=entry.inputs(2))


# -- no-op and bad input -------------------------------------------------------------------------
def test_model_without_repeated_block_is_left_alone_with_a_note():
    entry = ZOO["mnist_cnn"]
    compiled = retarget.compile_for(entry.factory(), "ac", example_inputs=entry.inputs(2))
    record = _record(compiled)
    assert not record.changed and "no repeated block" in record.notes[0]
    assert not any(record_of(m).checkpoint for m in compiled.modules())


def test_every_beyond_the_repeats_is_a_no_op():
    entry = ZOO["tiny_llama"]
    compiled = retarget.compile_for(entry.factory(), "ac[every=3]", example_inputs=entry.inputs(2))
    assert not _record(compiled).changed
    assert not any(record_of(m).checkpoint for m in compiled.modules())


def test_budget_needs_example_inputs():
    with pytest.raises(PassError, match=r"needs example_inputs.*ac\[policy=full\]"):
        retarget.compile_for(ZOO["tiny_llama"].factory(), "ac[budget=0.5]")


def test_whole_model_graph_is_refused():
    entry = ZOO["tiny_llama"]
    model = entry.factory()
    # capture='whole' of an HF decoder that returns its cache is not captured (known gap)
    model.config.use_cache = False
    with pytest.raises(PassError, match="capture='whole'.*use capture='regions'"):
        retarget.compile_for(model, "ac", example_inputs=entry.inputs(2), capture="whole")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(policy="budget"), "goes with policy=budget"),
        (dict(budget=0.5), "goes with policy=budget"),
        (dict(policy="budget", budget=1.5), r"lies in \(0, 1\]"),
        (dict(policy="budget", budget=0.5, every=2), "every applies to"),
        (dict(policy="sometimes"), "policy must be one of"),
        (dict(every=0), "every must be at least 1"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        CheckpointOptions(**options)


@pytest.mark.parametrize("target", ["single+ac", "single+ac[policy=selective]"])
def test_checkpointed_block_with_a_kv_cache_updates_it_once(target: str) -> None:
    # HF decoders at their default config pass a cache even in training; the recompute must
    # see it as the forward did, and the cache must be updated once, as in eager.
    from retarget.frontends.state_layout import layout
    from tests.frontends.test_state import small_llama

    model, reference = small_llama(), small_llama()
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    compiled = retarget.compile_for(model, target, example_inputs=batch)
    assert not any(r.eager_only for r in compiled.program.regions)
    want, got = reference(**batch), compiled(**batch)
    want.loss.backward()
    got.loss.backward()
    assert torch.equal(want.loss, got.loss)
    for (name, a), b in zip(reference.named_parameters(), compiled.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
    (want_layout, want_tensors), (got_layout, got_tensors) = (
        layout([want.past_key_values]),
        layout([got.past_key_values]),
    )
    assert want_layout == got_layout
    assert all(map(torch.equal, want_tensors, got_tensors))
    assert got_tensors[0].shape[-2] == ids.shape[1]  # one update per layer, not two
