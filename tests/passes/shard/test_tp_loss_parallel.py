"""tp[size=2, loss_parallel=true] on 2 gloo ranks: the LM head's logits stay split over the
vocabulary and HF's loss from `labels` is computed by torch's loss_parallel(); loss and every
gradient (gathered whole) equal one process's within 1e-5 relative for Llama (GQA) and Qwen2,
through the runtime's backward and through `loss.backward()` itself; a few SGD steps track one
process's loss; what `outputs.logits` is for metric code; generate() is refused by torch (the
logits are a DTensor: a documented limit). (With sequence_parallel too: in
tests/passes/shard/test_tp_sequence_parallel.py.) The runtime's step runs the blocks' dynamo
graphs captured after the split (capture="regions"); the direct backward, the training, the
metrics and generate() compile with capture="auto", where the split blocks run their own
forward (execution/tp_regions.py): both ways through loss_parallel's head.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import retarget
from retarget.core.errors import TargetNotSupportedError
from tests import tp_models as tm
from tests.distributed import run_ranks
from tests.passes.shard.test_tp_sequence_parallel import (
    check_one_step,
    check_training,
    generate,
    one_step,
    training,
)
from tests.passes.shard.test_tp_training import ROWS, _example

LP = "tp[size=2,loss_parallel=true]"


def logits_for_metrics(rank: int, world: int) -> dict[str, Any]:
    """outputs.logits under loss_parallel: a DTensor split over the vocabulary (as torchtitan
    hands it back); `.full_tensor()` makes it whole, argmax over it gives a replicated DTensor."""
    batch = tm.batch_for("lm", ROWS)
    reference = tm.llama()(**batch)
    compiled = retarget.compile_for(tm.llama(), LP, example_inputs=_example("lm"), capture="auto")
    outputs = compiled(**batch)
    logits = outputs.logits
    whole = logits.full_tensor()
    predicted = logits.argmax(-1)
    gathered = compiled.runtime.gather_for_metrics(predicted.full_tensor())
    as_tuple = compiled(**batch, return_dict=False)  # (loss, logits, ...)
    as_tuple[0].backward()
    scale = reference.logits.abs().max().item()
    return {
        "placements": [str(p) for p in logits.placements],
        "local_vocab": logits.to_local().shape[-1],
        "logits_error": (whole - reference.logits).abs().max().item() / scale,
        "argmax_equal": torch.equal(gathered, reference.logits.argmax(-1)),
        "argmax_placements": [str(p) for p in predicted.placements],
        "loss_is_plain": type(outputs.loss) is torch.Tensor,
        "tuple_loss_is_plain": type(as_tuple[0]) is torch.Tensor,
        "tuple_loss_equal": torch.equal(as_tuple[0].detach(), outputs.loss.detach()),
    }


def _lp_body(rank: int, world: int) -> dict[str, Any]:
    return {
        "runtime": one_step(rank, world, LP, ["llama", "qwen2"]),
        "direct": one_step(rank, world, LP, ["llama"], direct=True, capture="auto"),
        "train": training(rank, world, LP, "llama", capture="auto"),
        "metrics": logits_for_metrics(rank, world),
        "generate": generate(LP, capture="auto"),
    }


@pytest.mark.distributed
def test_loss_parallel_on_2_ranks_matches_one_process():
    results = run_ranks(_lp_body, 2, timeout=900)
    check_one_step(results[0]["runtime"], ["llama", "qwen2"])
    check_one_step(results[0]["direct"], ["llama"])
    check_training([r["train"] for r in results], 2)
    for result in results:
        metrics = result["metrics"]
        assert metrics["placements"] == ["S(2)"], metrics  # split on the vocabulary
        assert metrics["argmax_placements"] == ["R"], metrics  # whole on every rank
        assert metrics["local_vocab"] == tm.VOCAB // 2
        assert metrics["logits_error"] <= 1e-5, metrics
        assert metrics["argmax_equal"] and metrics["loss_is_plain"], metrics
        assert metrics["tuple_loss_is_plain"] and metrics["tuple_loss_equal"], metrics
        # generate() reads vocab-split logits as plain ones: torch refuses, loudly (a limit).
        assert result["generate"][0] is False
        assert "mixed torch.Tensor and DTensor" in result["generate"][1]


def _plan(target: str) -> Any:
    compiled = retarget.compile_for(tm.llama(), target, example_inputs=_example("lm"))
    return compiled.program.plan.tp


def test_plan_splits_the_vocabulary_and_says_so():
    plan = _plan(LP)
    assert plan.loss_parallel and not plan.sequence_parallel
    assert plan.rules["model.embed_tokens"].style == "rowwise_rep"
    head = plan.rules["lm_head"]
    assert (head.style, head.vocab_output, head.sequence) == ("colwise", True, "")
    assert "loss_parallel: lm_head logits split over the vocabulary" in plan.describe()


def test_loss_parallel_with_a_hand_plan_is_refused():
    with pytest.raises(TargetNotSupportedError, match="loss_parallel=true, plan=hf"):
        _plan("tp[size=2,plan=hf,loss_parallel=true]")
    with pytest.raises(TargetNotSupportedError, match="loss_parallel=true, the plan record"):
        _plan("tp[size=2,plan=tests.tp_models:LLAMA_2,loss_parallel=true]")


def _tied_body(rank: int, world: int) -> dict[str, Any]:
    """GPT-2 ties its head to the token embedding: both split on the vocabulary, still one
    parameter (its gradient the sum of both uses, as in one process)."""
    compiled = retarget.compile_for(tm.gpt2(), LP, example_inputs=_example("lm"))
    tied = compiled.lm_head.weight is compiled.transformer.wte.weight
    return {"tied": tied, "step": one_step(rank, world, LP, ["gpt2"])}


@pytest.mark.distributed
def test_loss_parallel_keeps_a_tied_head_tied():
    results = run_ranks(_tied_body, 2, timeout=600)
    assert results[0]["tied"]
    check_one_step(results[0]["step"], ["gpt2"])
