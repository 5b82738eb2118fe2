"""pp (pipeline parallelism) against one process, for transformers causal LMs at their default
configs (sizes shrunk, dropout off).

- 2 gloo ranks, schedules gpipe and 1f1b on a 4-layer Llama (GQA): the loss every rank gets
  from `runtime.forward_backward` equals one process's within 1e-5 relative, every parameter's
  gradient lives on exactly one rank and equals one process's within 1e-5 relative (of its
  largest entry); 20 SGD steps track one process's losses within 1e-4; a plain call is refused
  naming forward_backward and unwrap(); the loader is not divided (every stage reads the batch).
- 4 gloo ranks, both schedules, an 8-layer Llama: the same agreement (the rotary cos/sin and
  mask made before the blocks reach every stage through the stages in between).
- One process: the stage plan for 4 ranks (balanced by FLOPs, the head on the last stage),
  inspect's text, the exact balancing, refusals naming the value.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import retarget
from retarget.core.errors import TargetNotSupportedError
from retarget.passes.shard.split_stages import balance
from retarget.spec.errors import TargetError
from tests import zoo
from tests.distributed import run_ranks

SEQ, ROWS = 16, 4


def llama(layers: int = 4, tied: bool = False) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=zoo.VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config).train()


def llama8() -> torch.nn.Module:
    """For `retarget inspect tests.passes.shard.test_pipeline_parallel:llama8`."""
    return llama(8)


def batch(seed: int = 1, rows: int = ROWS) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, zoo.VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _one_step(rank: int, world: int, schedules: list[str]) -> dict[str, Any]:
    out = {}
    for schedule in schedules:
        data = batch()
        reference = llama()
        expected = reference(**data).loss
        expected.backward()
        compiled = retarget.compile_for(llama(), f"pp[schedule={schedule}]", example_inputs=data)
        loss = compiled.runtime.forward_backward(data)
        grads = dict(reference.named_parameters())
        errors = {
            name: float((p.grad - grads[name].grad).abs().max() / grads[name].grad.abs().max())
            for name, p in compiled.named_parameters()
            if p.grad is not None
        }
        try:
            compiled(**data)
            refused = ""
        except RuntimeError as error:
            refused = str(error)
        out[schedule] = {
            "loss_error": abs(float(loss) - float(expected)) / abs(float(expected)),
            "errors": errors,
            "refused": refused,
            "data_parallel": (
                compiled.runtime.data_parallel_rank,
                compiled.runtime.data_parallel_size,
            ),
        }
    return out


@pytest.mark.distributed
def test_two_stages_equal_one_process_for_gpipe_and_1f1b():
    by_rank = run_ranks(_one_step, 2, ["gpipe", "1f1b"], timeout=300)
    names = {name for name, _ in llama().named_parameters()}
    for schedule in ("gpipe", "1f1b"):
        results = [r[schedule] for r in by_rank]
        held = [set(r["errors"]) for r in results]
        assert held[0] | held[1] == names and not held[0] & held[1], schedule  # one rank each
        assert "model.embed_tokens.weight" in held[0] and "lm_head.weight" in held[1]
        for r in results:
            assert r["loss_error"] < 1e-5, schedule
            assert max(r["errors"].values()) < 1e-5, schedule
            assert "runtime.forward_backward(batch)" in r["refused"] and "unwrap()" in r["refused"]
            assert r["data_parallel"] == (0, 1)


def _training(rank: int, world: int, steps: int) -> tuple[list[float], list[float]]:
    reference = llama()
    compiled = retarget.compile_for(llama(), "pp", example_inputs=batch())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    ours, theirs = [], []
    for step in range(steps):
        data = batch(seed=100 + step % 2)  # two batches in turn: the loss must fall
        loss = reference(**data).loss
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        theirs.append(float(loss))
        ours.append(float(compiled.runtime.forward_backward(data)))
        opt.step()
        opt.zero_grad()
    return ours, theirs


@pytest.mark.distributed
def test_twenty_steps_track_one_process():
    for ours, theirs in run_ranks(_training, 2, 20, timeout=300):
        assert theirs[-1] < theirs[0]
        for a, b in zip(ours, theirs, strict=True):
            assert abs(a - b) <= 1e-4 * abs(b)


def _four_stages(rank: int, world: int) -> dict[str, Any]:
    """8 layers on 4 stages: the rotary cos/sin and mask made before the blocks reach every
    stage forwarded stage by stage (chain_skips)."""
    out = {}
    for schedule in ("gpipe", "1f1b"):
        data = batch(rows=8)
        reference = llama(8)
        expected = reference(**data).loss
        expected.backward()
        compiled = retarget.compile_for(llama(8), f"pp[schedule={schedule}]", example_inputs=data)
        loss = compiled.runtime.forward_backward(data)
        grads = dict(reference.named_parameters())
        out[schedule] = {
            "loss_error": abs(float(loss) - float(expected)) / abs(float(expected)),
            "errors": {
                name: float((p.grad - grads[name].grad).abs().max() / grads[name].grad.abs().max())
                for name, p in compiled.named_parameters()
                if p.grad is not None
            },
        }
    return out


@pytest.mark.distributed
def test_four_stages_equal_one_process():
    by_rank = run_ranks(_four_stages, 4, timeout=400)
    names = {name for name, _ in llama(8).named_parameters()}
    for schedule in ("gpipe", "1f1b"):
        held = [set(r[schedule]["errors"]) for r in by_rank]
        assert set().union(*held) == names and sum(map(len, held)) == len(names), schedule
        for r in by_rank:
            assert r[schedule]["loss_error"] < 1e-5, schedule
            assert max(r[schedule]["errors"].values()) < 1e-5, schedule


# -- one process ---------------------------------------------------------------------------


def _largest(costs: list[int], tail: int, runs: list[tuple[int, int]]) -> int:
    assert runs[0][0] == 0 and runs[-1][1] == len(costs)
    assert all(
        a < b and b == c for (a, b), (c, _) in zip(runs, runs[1:] + [(runs[-1][1], 0)], strict=True)
    )
    totals = [sum(costs[a:b]) for a, b in runs]
    totals[-1] += tail
    return max(totals)


def test_balance_is_the_exact_minimax_cut():
    assert balance([1, 1, 1, 1], 0, 2) == [(0, 2), (2, 4)]
    # The head's cost sits on the last stage, which then takes fewer blocks.
    assert balance([4, 4, 4, 4, 4, 4], 6, 2) == [(0, 4), (4, 6)]
    assert balance([1, 9, 1, 1], 0, 2) == [(0, 2), (2, 4)]
    # Against every cut of a small case: nothing has a smaller largest stage.
    import itertools

    costs, tail = [5, 1, 2, 7, 1, 1, 3, 2], 4
    best = min(
        _largest(
            costs, tail, [(a, b) for a, b in zip((0, *cuts), (*cuts, len(costs)), strict=True)]
        )
        for cuts in itertools.combinations(range(1, len(costs)), 3)
    )
    assert _largest(costs, tail, balance(costs, tail, 4)) == best


def test_plan_for_four_ranks_and_inspect(capsys):
    compiled = retarget.compile_for(llama(8), "pp", example_inputs=batch(rows=8), world_size=4)
    plan = compiled.program.plan.pp
    assert (plan.size, plan.schedule, plan.microbatches, plan.microbatch_rows) == (4, "1f1b", 8, 1)
    blocks = [len(s.blocks) for s in plan.stages]
    assert sum(blocks) == 8 and blocks[-1] <= blocks[0]  # the head weighs on the last stage
    assert plan.split_points[0] == f"model.layers.{blocks[0]}"
    assert abs(plan.bubble - 3 / 11) < 1e-9
    from retarget.cli.main import main

    module = "tests.passes.shard.test_pipeline_parallel"
    argv = ["inspect", f"{module}:llama8", "--inputs", f"{module}:batch", "--world-size", "4"]
    assert main([*argv, "--target", "pp[schedule=gpipe,microbatches=2]"]) == 0
    out = capsys.readouterr().out
    assert "pp[size=4] (gpipe, 2 microbatches): 4 stages of" in out
    assert "bubble 60%" in out


@pytest.mark.parametrize(
    ("build", "target", "world", "message"),
    [
        (llama, "pp[size=8]", 8, r"has 4 repeated blocks \(model.layers.0 \.\.\.\), fewer than"),
        (llama, "pp[microbatches=3]", 2, r"microbatches=3 does not divide the example's 4 rows"),
        (llama, "pp[schedule=interleaved-1f1b]", 2, r"schedule=interleaved-1f1b is not"),
        (lambda: llama(tied=True), "pp", 2, r"lm_head.weight is tied to model.embed_tokens.weight|"
         r"model.embed_tokens.weight is tied to lm_head.weight"),
        (llama, "pp[size=2]", 4, r"the degree must be the 4 processes"),
    ],
)  # fmt: skip
def test_refusals_name_the_value(build, target, world, message):
    with pytest.raises(TargetNotSupportedError, match=message):
        retarget.compile_for(build(), target, example_inputs=batch(), world_size=world)


def test_pp_runs_alone_so_far():
    with pytest.raises(TargetError, match="'pp' does not combine with 'ddp'"):
        retarget.compile_for(llama(), "ddp+pp", example_inputs=batch(), world_size=2)
