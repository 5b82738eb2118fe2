"""tp[size=2, sequence_parallel=true] (and with loss_parallel=true) on 2 gloo ranks: loss and
every gradient (gathered whole) equal one process's within 1e-5 relative for Llama (GQA) and
Qwen2, a few SGD steps with clipping track one process's loss, a sequence the degree does not
divide works (DTensor's uneven split), so do padded rows, greedy generate() equals one process's;
fsdp+tp[size=2, sequence_parallel=true] on a 2x2 mesh for Llama. One process: the plan carries
the sequence boundaries and prints them; where the model's code between the embedding and the
first block (GPT-2's position embeddings, BERT's LayerNorm) or after the last block (BERT's
classifier and prediction transform) computes on the stream, the split moves to the first
block's input and the join to the last block's output (GPT-2 and BERT on 2 ranks, with
loss_parallel too); glue between two blocks is refused, naming them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import retarget
from retarget.core.errors import TargetNotSupportedError
from tests import tp_models as tm
from tests.distributed import run_ranks
from tests.passes.shard.test_tp_training import ROWS, _example, _rows, step_errors

SP = "tp[size=2,sequence_parallel=true]"
SP_LP = "tp[size=2,sequence_parallel=true,loss_parallel=true]"
STEPS = 4
LR = 0.05


def one_step(
    rank: int,
    world: int,
    target: str,
    names: list[str],
    seq: int = 0,
    direct: bool = False,
    padded: bool = False,
    capture: str = "regions",
) -> dict:
    """(loss error, worst gradient error, DTensor parameters) per model against one process;
    the backward through the runtime, or `loss.backward()` itself (`direct`); `padded`: rows
    right-padded (an attention mask, padded labels -100); `capture`: compile_for's."""

    out = {}
    for name in names:
        build, _, kind = tm.MODELS[name]
        batch = tm.batch_for(kind, ROWS)
        if seq:
            batch = {k: v[:, :seq] for k, v in batch.items()}
        if padded:
            mask = torch.ones_like(batch["input_ids"])
            mask[1, 12:], mask[3, 9:] = 0, 0
            batch["attention_mask"] = mask
            batch["labels"] = batch["labels"].masked_fill(mask == 0, -100)
        reference = build()
        expected = tm.loss_of(reference, batch)
        expected.backward()
        compiled = retarget.compile_for(
            build(), target, example_inputs=_example(kind), capture=capture
        )
        out[name] = step_errors(rank, world, compiled, batch, reference, expected, direct)
    return out


def training(
    rank: int, world: int, target: str, name: str, capture: str = "regions"
) -> list[tuple[float, float]]:
    """STEPS SGD steps with clipping through the runtime: (this rank's loss, one process's)."""
    build, _, kind = tm.MODELS[name]
    reference = build()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    compiled = retarget.compile_for(build(), target, example_inputs=_example(kind), capture=capture)
    run = compiled.runtime
    optimizer = run.prepare(torch.optim.SGD(compiled.parameters(), lr=LR))
    losses = []
    for step in range(STEPS):
        batch = tm.batch_for(kind, ROWS, seed=100 + step)
        expected = tm.loss_of(reference, batch)
        expected.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        loss = tm.loss_of(compiled, _rows(batch, rank // 2, world // 2))
        run.backward(loss)
        run.clip_grad_norm_(compiled.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append((loss.item(), expected.item()))
    return losses


def generate(target: str, capture: str = "regions") -> tuple[bool, str]:
    """Greedy generation with the KV cache (decode steps of one token: one rank's slice of
    the sequence is empty) equals one process's; or the error it raised."""
    ids = tm.batch_for("lm", 2)["input_ids"][:, :8]
    expected = tm.llama().eval().generate(ids, max_new_tokens=4, do_sample=False)
    example = _example("lm")
    compiled = retarget.compile_for(tm.llama(), target, example_inputs=example, capture=capture)
    compiled = compiled.eval()
    try:
        got = compiled.generate(ids, max_new_tokens=4, do_sample=False)
    except RuntimeError as error:
        return False, str(error)
    return torch.equal(got, expected), ""


def check_one_step(result: dict[str, Any], names: list[str]) -> None:
    assert sorted(result) == sorted(names)
    for name, (loss_error, grad_error, split) in result.items():
        assert loss_error <= 1e-5 and grad_error <= 1e-5, (name, loss_error, grad_error)
        assert split > 0, name


def check_training(results: list[list[tuple[float, float]]], world: int) -> None:
    for step in range(STEPS):
        mine = sum(r[step][0] for r in results) / world
        expected = results[0][step][1]
        assert abs(mine - expected) <= 1e-4 * abs(expected), (step, mine, expected)


def _sp_body(rank: int, world: int) -> dict[str, Any]:
    return {
        "sp": one_step(rank, world, SP, ["llama", "qwen2", "neox"]),
        "sp_lp": one_step(rank, world, SP_LP, ["llama", "qwen2"]),
        "uneven": one_step(rank, world, SP, ["llama"], seq=tm.zoo.SEQ - 1),
        "padded": one_step(rank, world, SP_LP, ["llama"], padded=True),
        "train_sp": training(rank, world, SP, "llama"),
        "train_sp_lp": training(rank, world, SP_LP, "qwen2"),
        # Glue on the stream: GPT-2's position embeddings, BERT's embedding LayerNorm and its
        # classifier / prediction transform on the whole stream.
        "glue": one_step(rank, world, SP, ["gpt2", "bert"]),
        "glue_lp": one_step(rank, world, SP_LP, ["gpt2", "bert_mlm"]),
        "generate": generate(SP),
    }


@pytest.mark.distributed
def test_sequence_parallel_on_2_ranks_matches_one_process():
    results = run_ranks(_sp_body, 2, timeout=900)
    check_one_step(results[0]["sp"], ["llama", "qwen2", "neox"])
    check_one_step(results[0]["sp_lp"], ["llama", "qwen2"])
    check_one_step(results[0]["uneven"], ["llama"])
    check_one_step(results[0]["padded"], ["llama"])
    check_one_step(results[0]["glue"], ["gpt2", "bert"])
    check_one_step(results[0]["glue_lp"], ["gpt2", "bert_mlm"])
    for key in ("train_sp", "train_sp_lp"):
        # Both tp ranks computed the whole loss; _check averages over the world.
        check_training([r[key] for r in results], 2)
    assert all(r["generate"] == (True, "") for r in results), results[0]["generate"]


def _fsdp_sp_body(rank: int, world: int) -> dict[str, Any]:
    return {
        "sp": one_step(rank, world, "fsdp+" + SP, ["llama"]),
        "sp_lp": one_step(rank, world, "fsdp+" + SP_LP, ["llama"], direct=True),
        "train": training(rank, world, "fsdp+" + SP_LP, "llama"),
    }


@pytest.mark.distributed
def test_fsdp_tp_sequence_parallel_on_a_2x2_mesh():
    results = run_ranks(_fsdp_sp_body, 4, timeout=900)
    check_one_step(results[0]["sp"], ["llama"])
    check_one_step(results[0]["sp_lp"], ["llama"])
    # Each dp group's loss is its rows' (the mean of the two groups is one process's).
    check_training([r["train"] for r in results], 4)


def _plan(name: str, target: str) -> Any:
    build, _, kind = tm.MODELS[name]
    compiled = retarget.compile_for(build(), target, example_inputs=_example(kind))
    return compiled.program.plan.tp


def test_plan_marks_the_sequence_boundaries_and_prints_them():
    plan = _plan("llama", SP_LP)
    rules = plan.rules
    assert rules["model.embed_tokens"].sequence == "scatter"
    assert rules["model.layers.0.self_attn.q_proj"].sequence == "gather"
    assert rules["model.layers.0.mlp.down_proj"].sequence == "scatter"
    assert rules["model.layers.1.input_layernorm"].style == "sequence_parallel"
    assert rules["model.norm"].style == "sequence_parallel"
    assert (rules["lm_head"].style, rules["lm_head"].sequence) == ("colwise", "gather")
    assert rules["lm_head"].vocab_output
    text = plan.describe()
    assert "sequence_parallel: residual stream split on the sequence, 11 modules all-gather" in text
    assert "5 reduce-scatter onto it" in text
    assert "loss_parallel: lm_head logits split over the vocabulary" in text
    # Without the option nothing is marked.
    plain = _plan("llama", "tp[size=2]")
    assert not any(r.sequence or r.vocab_output for r in plain.rules.values())
    assert "sequence_parallel" not in plain.describe()


def test_sequence_parallel_on_a_replicated_embedding_scatters_it():
    rules = _plan("qwen2", SP).rules
    assert (rules["model.embed_tokens"].style, rules["model.embed_tokens"].sequence) == (
        "replicate",
        "scatter",
    )
    assert (rules["lm_head"].style, rules["lm_head"].sequence) == ("replicate", "gather")


def test_glue_on_the_stream_moves_the_split_to_the_blocks():
    # GPT-2 adds wpe's position embeddings to wte's output: the embedding and that sum run
    # whole, and the first block's input is cut to each rank's slice; ln_f and the head are
    # on the split stream as for Llama.
    gpt2 = _plan("gpt2", SP_LP).rules
    assert (gpt2["transformer.h.0"].style, gpt2["transformer.h.0"].sequence) == (
        "replicate",
        "scatter_input",
    )
    assert gpt2["transformer.wte"].sequence == ""
    assert gpt2["transformer.ln_f"].style == "sequence_parallel"
    assert gpt2["lm_head"].sequence == "gather"
    # BERT normalises the embeddings' sum (whole) and its classifier reads the stream: the
    # last block's output is gathered, and no norm outside the blocks is split.
    bert = _plan("bert", SP)
    assert bert.rules["bert.encoder.layer.0"].sequence == "scatter_input"
    assert bert.rules["bert.encoder.layer.1"].sequence == "gather_output"
    assert "bert.embeddings.LayerNorm" not in bert.rules
    assert "gathered at bert.encoder.layer.1's output" in bert.describe()
    mlm = _plan("bert_mlm", SP_LP).rules
    assert mlm["cls.predictions.decoder"].vocab_output
    assert mlm["cls.predictions.decoder"].sequence == ""  # behind the whole-stream transform
    assert "cls.predictions.transform.LayerNorm" not in mlm


class GlueBetweenBlocks(torch.nn.Module):
    """Two blocks with a position-dependent scale between them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
            for _ in range(2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.blocks[0](x)
        x = x * torch.linspace(0.5, 1.5, x.shape[1])[None, :, None]
        return x + self.blocks[1](x)


def test_glue_between_two_blocks_is_refused_naming_them():
    with pytest.raises(TargetNotSupportedError, match="sequence_parallel=true") as caught:
        retarget.compile_for(
            GlueBetweenBlocks(), SP, example_inputs=torch.randn(2, 4, 8), world_size=2
        )
    assert "the input of block 'blocks.1' is not the output of block 'blocks.0'" in str(
        caught.value
    )


def test_sequence_parallel_with_a_hand_plan_is_refused():
    with pytest.raises(TargetNotSupportedError, match="plan=hf"):
        _plan("llama", "tp[size=2,plan=hf,sequence_parallel=true]")
    # A TpPlan record that does not say sequence_parallel, asked with it.
    with pytest.raises(TargetNotSupportedError, match="sequence_parallel=true, the plan record"):
        _plan("llama", "tp[size=2,plan=tests.tp_models:LLAMA_2,sequence_parallel=true]")
