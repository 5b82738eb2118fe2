"""cp (context parallelism) on real gloo ranks against one process, for transformers models at
their default configs (sizes shrunk, dropout off): Llama (GQA), Qwen2 with tied embeddings,
Mistral with a sliding window shorter than the sequence (so the window is exercised).

- 2 ranks, ddp+cp[size=2], each of ring, allgather and ulysses (zig-zag and contiguous): the
  loss every rank gets equals one process's on the whole sequence within 1e-5 relative and
  every gradient within 1e-4 relative (of the parameter's largest gradient); bf16+ac within
  the bf16 tolerance; 20 SGD steps track one process's losses.
- 4 ranks, fsdp+cp[size=2] on a (dp 2, cp 2) mesh: two batches, the same agreement, loaders
  and runtime.data_parallel_* over dp.
- One process: the plan for 2 ranks (inspect), refusals naming the value, the user's model
  keeps its own attention.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import retarget
from retarget.core.errors import TargetNotSupportedError
from retarget.models.tiny_llama import tiny_lm
from retarget.targets.errors import TargetError
from tests import zoo
from tests.distributed import run_ranks

SEQ = 64
ROWS = 2
#: The shrunk sizes every model here is built with (GQA: 2 key/value heads for 4 query heads).
SIZES = dict(
    vocab_size=zoo.VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def build(name: str) -> torch.nn.Module:
    """A causal LM at its default config with the sizes shrunk, dropout off, seeded."""
    import transformers as tf

    extra: dict[str, Any] = {
        "llama": {},
        "qwen2": {"tie_word_embeddings": True},
        # A window shorter than the sequence, so the split attention's window mask matters.
        "mistral": {"sliding_window": 24},
    }[name]
    config_class, model_class = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }[name]
    torch.manual_seed(0)
    model = model_class(config_class(**SIZES, **extra))
    return model.train()


def mistral() -> torch.nn.Module:
    """For `retarget inspect tests.passes.shard.test_context_parallel:mistral`."""
    return build("mistral")


def batch(seed: int = 1, rows: int = ROWS) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, zoo.VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    grad = p.grad
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def gradient_error(compiled: torch.nn.Module, reference: torch.nn.Module) -> float:
    """Largest difference of a gradient from the reference's, relative to its largest entry."""
    expected = dict(reference.named_parameters())
    worst = 0.0
    for name, p in compiled.named_parameters():
        want = expected[name].grad
        worst = max(worst, float((_grad(p) - want).abs().max() / want.abs().max()))
    return worst


def padded(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rows right-padded as transformers' collators pad them: mask 0 and labels -100 there."""
    mask = torch.ones_like(data["input_ids"])
    mask[0, 40:], mask[1, 57:] = 0, 0
    return {**data, "attention_mask": mask, "labels": data["labels"].masked_fill(mask == 0, -100)}


def _agreement(
    rank: int, world: int, cases: list[tuple[str, str]]
) -> list[tuple[str, float, float]]:
    out = []
    for case, target in cases:
        name = case.removesuffix(" padded")
        data = padded(batch()) if case != name else batch()
        reference = build(name)
        expected = reference(**data).loss
        expected.backward()
        compiled = retarget.compile_for(build(name), target, example_inputs=data)
        loss = compiled(**data).loss
        loss.backward()
        if "compile" in target:  # one compile per block type, no recompile, no fallback
            (region,) = compiled.program.regions
            summary = region.runner.summary()
            assert (summary["compiles"], summary["recompiles"], summary["fallback"]) == (1, 0, "")
        out.append(
            (
                f"{case} {target}",
                abs(float(loss) - float(expected)) / abs(float(expected)),
                gradient_error(compiled, reference),
            )
        )
    return out


CASES_2 = [
    (name, f"ddp+cp[{options}]")
    for name in ("llama", "qwen2", "mistral")
    for options in ("attention=ring", "attention=allgather,load_balance=false", "attention=ulysses")
] + [
    # Right padding with the attention mask one process uses, pads labelled -100.
    ("llama padded", "ddp+cp"),
    ("mistral padded", "ddp+cp[attention=ulysses]"),
    # Each block region compiled with the split attention as one opaque op in its graph.
    ("llama", "ddp+cp+compile[backend=aot_eager]"),
    ("mistral", "fsdp+cp[attention=ulysses]+compile[backend=aot_eager]"),
]


@pytest.mark.distributed
def test_two_ranks_equal_one_process_for_each_attention():
    for rank_results in run_ranks(_agreement, 2, CASES_2, timeout=400):
        for case, loss_error, grad_error in rank_results:
            assert loss_error < 1e-5, case
            assert grad_error < 1e-4, case


def _low_precision(rank: int, world: int) -> dict[str, tuple[float, float]]:
    """bf16+ac and fp16 against one process under the same autocast (fp16: loss.backward()
    itself, so the gradients are not scaled)."""
    out = {}
    for precision, dtype in (("bf16+ac", torch.bfloat16), ("fp16", torch.float16)):
        data = batch()
        reference = build("llama")
        with torch.autocast("cpu", dtype=dtype):
            expected = reference(**data).loss
        expected.backward()
        compiled = retarget.compile_for(build("llama"), f"ddp+cp+{precision}", example_inputs=data)
        loss = compiled(**data).loss
        loss.backward() if precision == "fp16" else compiled.runtime.backward(loss)
        error = abs(float(loss) - float(expected)) / abs(float(expected))
        out[precision] = (error, gradient_error(compiled, reference))
    return out


def _training(rank: int, world: int, steps: int) -> dict[str, tuple[list[float], list[float]]]:
    return {name: _train(name, steps) for name in ("llama", "qwen2", "mistral")}


def _train(name: str, steps: int) -> tuple[list[float], list[float]]:
    """SGD steps through the runtime; each step a new batch (every cp rank the same one)."""
    reference = build(name)
    compiled = retarget.compile_for(build(name), "ddp+cp", example_inputs=batch())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = compiled.runtime.prepare(torch.optim.SGD(compiled.parameters(), lr=0.1))
    ours, theirs = [], []
    for step in range(steps):
        data = batch(seed=100 + step)
        loss = reference(**data).loss
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        theirs.append(float(loss))
        loss = compiled(**data).loss
        compiled.runtime.backward(loss)
        opt.step()
        opt.zero_grad()
        ours.append(float(loss))
    return ours, theirs


@pytest.mark.distributed
def test_two_ranks_bf16_ac_fp16_and_twenty_steps():
    for by_precision in run_ranks(_low_precision, 2):
        for precision, (loss_error, grad_error) in by_precision.items():
            # Autocast against autocast: the split attention runs in float32 where the
            # whole-sequence attention ran in 16 bits, so they agree to 16-bit rounding.
            assert loss_error < 2e-2, precision
            assert grad_error < 1e-1, precision
    for by_model in run_ranks(_training, 2, 20, timeout=400):
        for name, (ours, theirs) in by_model.items():
            assert theirs[-1] < theirs[0], name
            for a, b in zip(ours, theirs, strict=True):
                assert abs(a - b) <= 1e-4 * abs(b), name


def _four_ranks(rank: int, world: int) -> dict[str, dict[str, Any]]:
    return {name: _on_four(name) for name in ("llama", "qwen2", "mistral")}


def _on_four(name: str) -> dict[str, Any]:
    """fsdp+cp[size=2] on (dp 2, cp 2): dp group d reads batch d; the reference reads both."""
    both = batch(rows=2 * ROWS)
    reference = build(name)
    expected = reference(**both).loss
    expected.backward()
    compiled = retarget.compile_for(build(name), "fsdp+cp[size=2]", example_inputs=batch())
    run = compiled.runtime
    dp = run.data_parallel_rank
    mine = {k: v[dp * ROWS : (dp + 1) * ROWS] for k, v in both.items()}
    loss = compiled(**mine).loss
    run.backward(loss)
    total = run.reduce(loss.detach().clone(), "mean")
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    seen = [int(x) for b in run.shard(loader) for x in b]
    return {
        "dp": (dp, run.data_parallel_size),
        "loss_error": abs(float(total) - float(expected)) / abs(float(expected)),
        "grad_error": gradient_error(compiled, reference),
        "seen": seen,
    }


@pytest.mark.distributed
def test_four_ranks_fsdp_cp_mesh():
    by_rank = run_ranks(_four_ranks, 4, timeout=600)
    for name in ("llama", "qwen2", "mistral"):
        results = [r[name] for r in by_rank]
        assert [r["dp"] for r in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]
        for r in results:
            assert r["loss_error"] < 1e-5, name
            assert r["grad_error"] < 1e-4, name
        # The ranks of a cp group read the same batches; the two dp groups split the loader.
        assert results[0]["seen"] == results[1]["seen"]
        assert results[2]["seen"] == results[3]["seen"]
        assert sorted(results[0]["seen"] + results[2]["seen"]) == list(range(8))


# -- one process: the plan, refusals --------------------------------------------------------


def test_plan_for_two_ranks_and_the_users_model_untouched():
    model = build("mistral")
    compiled = retarget.compile_for(
        model, "ddp+cp[attention=ulysses]", example_inputs=batch(), world_size=2
    )
    plan = compiled.program.plan.cp
    assert (plan.size, plan.attention, plan.sequence, plan.per_rank_sequence) == (
        2,
        "ulysses",
        SEQ,
        SEQ // 2,
    )
    assert len(plan.attention_modules) == 2
    assert set(plan.sliding_windows.values()) == {24}
    assert "cp[size=2] (ulysses attention" in str(compiled.report)
    assert model.config._attn_implementation == "sdpa"
    assert compiled.config._attn_implementation == plan.implementation
    # Captured at the rank's shapes, with the split attention in the block graphs.
    graphs = "\n".join(compiled.program.graph_text().values())
    assert "context_attention" in graphs and "scaled_dot_product_attention" not in graphs
    with pytest.raises(RuntimeError, match=r"compiled for cp\[size=2\] and needs 2 processes"):
        compiled(**batch())


def test_memory_estimate_counts_one_ranks_share_of_the_sequence():
    from retarget.report.memory_estimate import estimate_memory

    sizes = {}
    for target in ("ddp", "ddp+cp", "ddp+cp[attention=ulysses]"):
        compiled = retarget.compile_for(
            build("llama"), target, example_inputs=batch(), world_size=2
        )
        sizes[target] = sum(estimate_memory(compiled).activations.values())
    assert sizes["ddp+cp"] <= 0.6 * sizes["ddp"]
    assert sizes["ddp+cp[attention=ulysses]"] <= 0.6 * sizes["ddp"]


def test_inspect_shows_which_attention_calls_are_split(capsys):
    from retarget.cli.main import main

    module = "tests.passes.shard.test_context_parallel"
    argv = ["inspect", f"{module}:mistral", "--inputs", f"{module}:batch", "--world-size", "4"]
    assert main([*argv, "--target", "fsdp+cp[size=2,attention=allgather]"]) == 0
    out = capsys.readouterr().out
    assert "cp[size=2] (allgather attention, zig-zag chunks): 2 attention modules split" in out
    assert "a sequence of 64 is 32 positions per rank; 2 data-parallel group(s)" in out
    assert "model.layers.1.self_attn  allgather over 2 ranks  24" in out


@pytest.mark.parametrize(
    ("target", "data", "message"),
    [
        (
            "ddp+cp",
            {"input_ids": torch.ones(2, 30, dtype=torch.long)},
            r"sequence of 30 does not split into 4",
        ),
        (
            "ddp+cp[attention=ulysses,size=3]",
            batch(),
            r"num_attention_heads=4 does not divide by 3",
        ),
        ("ddp+cp[size=3]", batch(), r"must be at least 2 and divide"),
    ],
)
def test_refusals_name_the_value(target, data, message):
    world = 3 if "size=3" in target and "ulysses" in target else 2
    with pytest.raises(TargetNotSupportedError, match=message):
        retarget.compile_for(build("llama"), target, example_inputs=data, world_size=world)


def test_refused_without_a_strategy_and_beside_tp():
    with pytest.raises(TargetError, match="'cp' needs one of 'ddp', 'fsdp'"):
        retarget.compile_for(build("llama"), "cp", example_inputs=batch(), world_size=2)
    with pytest.raises(TargetError, match="'tp' and 'cp' do not combine"):
        retarget.compile_for(build("llama"), "fsdp+tp+cp", example_inputs=batch(), world_size=4)


def test_a_convolution_over_time_is_refused_naming_it():
    import transformers as tf

    config = tf.Lfm2Config(**SIZES, layer_types=["conv", "full_attention"])
    with pytest.raises(TargetNotSupportedError, match=r"model.layers.0.conv: Lfm2ShortConv mixes"):
        retarget.compile_for(
            tf.Lfm2ForCausalLM(config), "ddp+cp", example_inputs=batch(), world_size=2
        )


def test_models_outside_transformers_and_padding_are_refused():
    from retarget.execution.context.attention import ContextLayout
    from retarget.execution.context.batch import split_call

    with pytest.raises(TargetNotSupportedError, match="does not call transformers' attention"):
        retarget.compile_for(
            tiny_lm(),
            "ddp+cp",
            example_inputs={"input_ids": torch.ones(2, 8, dtype=torch.long)},
            world_size=2,
        )
    layout = ContextLayout(size=2, rank=1, mode="ring", balanced=True)
    data = batch()
    mask = torch.ones_like(data["input_ids"])
    args, kwargs = split_call(layout, (), {**data, "attention_mask": mask})
    assert "attention_mask" not in kwargs  # all ones: nothing padded, dropped
    assert kwargs["position_ids"].tolist() == [list(range(16, 32)) + list(range(32, 48))]
    shifted = torch.cat([data["labels"][:, 1:], torch.full((ROWS, 1), -100)], dim=1)
    assert torch.equal(kwargs["shift_labels"], shifted[:, kwargs["position_ids"][0]])
    assert kwargs["num_items_in_batch"] == ROWS * (SEQ - 1)
    mask[0, -3:] = 0  # right padding: dropped once the pads' labels are -100
    with pytest.raises(ValueError, match="pads positions whose labels are not -100"):
        split_call(layout, (), {**data, "attention_mask": mask})
    labels = data["labels"].masked_fill(mask == 0, -100)
    _, kwargs = split_call(layout, (), {**data, "labels": labels, "attention_mask": mask})
    assert "attention_mask" not in kwargs
    left = torch.ones_like(mask)
    left[1, :4] = 0
    with pytest.raises(ValueError, match="pads on the left or masks inside a row"):
        split_call(layout, (), {**data, "attention_mask": left})
    bidirectional = ContextLayout(size=2, rank=1, mode="ring", balanced=True, causal=False)
    with pytest.raises(ValueError, match="pads a model whose attention is not causal"):
        split_call(bidirectional, (), {**data, "labels": labels, "attention_mask": mask})
    with pytest.raises(ValueError, match=r"sequence of 1 positions does not split into 4.*unwrap"):
        split_call(layout, (), {"input_ids": torch.ones(1, 1, dtype=torch.long)})
