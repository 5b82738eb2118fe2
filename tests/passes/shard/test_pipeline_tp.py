"""tp inside pipeline stages (tp+pp, fsdp+tp+pp: torchtitan's 3D) against one process, for
transformers causal LMs at their default configs (sizes shrunk, dropout off).

- 4 gloo ranks, tp[size=2]+pp[size=2] ((pp, tp) = (2, 2)): Llama (GQA: 4 heads, 2 key/value
  heads, so each tp rank holds one), Qwen2 with its head tied to the embedding and GPT-2
  (fused q|k|v Conv1D): the loss equals one process's within 1e-5 relative and every gradient
  too (the split ones gathered over tp); the two tp ranks of a stage hold the same parameters,
  split ones as halves; 10 clipped SGD steps track one process's losses and norms within 1e-4
  and unwrap() gives every rank the trained model; a checkpoint resumes bit for bit and
  save_model writes the whole trained model; bf16+ac run inside the split stages.
- 8 gloo ranks, fsdp+tp[size=2]+pp[size=2] ((pp, dp, tp) = (2, 2, 2)): the same agreement for
  a step of Llama and 20 clipped steps with unwrap(); each rank holds a quarter of its stage's
  weights; a checkpoint resumes bit for bit; Accelerate's rank members follow the mesh.
- One process: the refusals (tp without its size, sequence parallelism) and the plan text.
"""

from __future__ import annotations

from typing import Any

import pytest

import retarget
from retarget.core.errors import TargetNotSupportedError
from tests.distributed import run_ranks
from tests.passes.shard.test_pipeline_parallel import (
    MODELS,
    ROWS,
    _checkpoint,
    _inside_stages,
    _training,
    assert_inside_stages,
    assert_training,
    batch,
    gradient_errors,
    held_bytes,
    interpreted,
    llama,
    mine,
    whole_loss,
)


def _one_step(base: str, cases: list[tuple[str, str]]) -> dict[str, Any]:
    """One forward_backward per (model, schedule) against one process on the whole batch."""
    out = {}
    for name, schedule in cases:
        build = MODELS[name]
        compiled = retarget.compile_for(
            build(), f"{base}pp[size=2,schedule={schedule}]", example_inputs=batch()
        )
        dp = compiled.runtime.data_parallel_size
        data = batch(rows=ROWS * dp)
        reference = build()
        expected = reference(**data).loss
        expected.backward()
        loss = compiled.runtime.forward_backward(mine(data, compiled))
        loss = whole_loss(loss, compiled) if dp > 1 else loss
        split = {
            n: type(p).__name__ + str(getattr(p, "placements", ""))
            for n, p in compiled.named_parameters()
            if p.grad is not None
        }
        out[f"{name} {schedule}"] = {
            "loss_error": abs(float(loss) - float(expected)) / abs(float(expected)),
            "errors": gradient_errors(compiled, reference),
            "placements": split,
            "held_fraction": held_bytes(compiled) / held_bytes(build()),
            "wrapped": compiled.program.plan.applied.wrapped,
            "data_parallel": (dp, compiled.runtime.data_parallel_rank),
            "interpreted": interpreted(compiled),
        }
    return out


#: What runs inside tp-split stages (ac with compile is refused under tp+pp): each of bf16,
#: ac and compile once, against pp alone.
TP_PP_INSIDE = ("", "+bf16+ac", "+bf16+compile[backend=aot_eager]")
TP_PP_CASES = [("llama", "1f1b"), ("qwen2_tied", "gpipe"), ("gpt2", "1f1b")]


def _tp_pp(rank: int, world: int, folder: str) -> dict[str, Any]:
    """tp[size=2]+pp[size=2] on 4 ranks ((pp, tp) = (2, 2))."""
    target = "tp[size=2]+pp[size=2]"
    return {
        "step": _one_step("tp[size=2]+", TP_PP_CASES),
        "training": _training(rank, world, 10, target=target),  # 20 under 3D, below
        "tied": _checkpoint(rank, world, f"{folder}/qwen2", "qwen2_tied", target),
        "inside": _inside_stages(rank, world, base="tp[size=2]+", dp=1, arms=TP_PP_INSIDE),
    }


def assert_step(
    results: list[dict[str, Any]],
    key: str,
    stage_ranks: list[list[int]],
    embedding_as: str = "Parameter",
) -> None:
    """One step: loss and gradients as one process's; the ranks of a stage (`stage_ranks`)
    hold the same parameters, the blocks' Linears split, the embedding not split over tp
    (`embedding_as`: a plain Parameter, or fsdp's dp shard)."""
    for r in results:
        assert r["loss_error"] < 1e-5, key
        assert max(r["errors"].values()) < 1e-5, (key, r["errors"])
        # the DTensor blocks run their generated code, edited for DTensors, not the Interpreter
        assert r["interpreted"][0] == 0 and r["interpreted"][1] > 0, (key, r["interpreted"])
    for ranks in stage_ranks:
        assert len({tuple(results[k]["errors"]) for k in ranks}) == 1, key
    placements = results[0]["placements"]
    embedding = "transformer.wte.weight" if "gpt2" in key else "model.embed_tokens.weight"
    assert placements[embedding] == embedding_as, (key, placements)
    q = (
        "transformer.h.0.attn.c_attn.weight"
        if "gpt2" in key
        else "model.layers.0.self_attn.q_proj.weight"
    )
    assert "Shard" in placements[q], (key, placements)


@pytest.mark.distributed
def test_tp_pp_on_four_ranks_equals_one_process(tmp_path):
    by_rank = run_ranks(_tp_pp, 4, str(tmp_path), timeout=900)
    # ranks (pp, tp): 0 (0, 0), 1 (0, 1), 2 (1, 0), 3 (1, 1)
    for name, schedule in TP_PP_CASES:
        key = f"{name} {schedule}"
        results = [r["step"][key] for r in by_rank]
        assert_step(results, key, [[0, 1], [2, 3]])
        assert {n for r in results for n in r["errors"]} == {
            n for n, _ in MODELS[name]().named_parameters()
        }
        for r in results:
            assert r["data_parallel"] == (1, 0)
            assert r["held_fraction"] < 0.45, (key, r["held_fraction"])  # under half a model
        assert "tp over each stage's blocks (mesh pp x tp (2, 2))" in results[0]["wrapped"]
    for r in by_rank:
        assert_training(r["training"])
        assert_inside_stages(r["inside"])
    tied = [r["tied"] for r in by_rank]
    assert all(c["bitwise"] and c["saved_equal"] for c in tied), tied
    assert "model.embed_tokens.weight" in tied[2]["changed"]
    assert "model.layers.3.mlp.down_proj.weight" in tied[3]["changed"]


def _fsdp_tp_pp(rank: int, world: int, folder: str) -> dict[str, Any]:
    """fsdp+tp[size=2]+pp[size=2] on 8 ranks ((pp, dp, tp) = (2, 2, 2))."""
    target = "fsdp+tp[size=2]+pp[size=2]"
    accelerator = retarget.Accelerator(target=target)
    return {
        "step": _one_step("fsdp+tp[size=2]+", [("llama", "1f1b")]),
        "training": _training(rank, world, 20, target=target),
        "checkpoint": _checkpoint(rank, world, f"{folder}/llama", "llama", target),
        "accelerator": (
            accelerator.pipeline_parallel_rank,
            accelerator.data_parallel_shard_rank,
            accelerator.tensor_parallel_rank,
        ),
    }


@pytest.mark.distributed
def test_fsdp_tp_pp_on_eight_ranks_equals_one_process(tmp_path):
    by_rank = run_ranks(_fsdp_tp_pp, 8, str(tmp_path), timeout=900)
    results = [r["step"]["llama 1f1b"] for r in by_rank]
    # ranks (pp, dp, tp): 0-3 the first stage, 4-7 the last
    assert_step(
        results, "llama 1f1b", [[0, 1, 2, 3], [4, 5, 6, 7]], embedding_as="DTensor(Shard(dim=0),)"
    )
    assert [r["data_parallel"] for r in results] == [(2, d) for _ in range(2) for d in (0, 0, 1, 1)]
    for r in results:
        assert r["held_fraction"] < 0.25, r["held_fraction"]  # a stage's share over dp x tp
    assert (
        "fully_shard per stage + tp over each stage's blocks (mesh pp x dp x tp (2, 2, 2))"
        in (results[0]["wrapped"])
    )
    for r in by_rank:
        assert_training(r["training"])
    checkpoints = [r["checkpoint"] for r in by_rank]
    assert all(c["bitwise"] and c["saved_equal"] for c in checkpoints), checkpoints
    assert "lm_head.weight" in checkpoints[4]["changed"]
    # Accelerate's members: (pp, dp shard, tp), pp outermost and tp innermost
    assert [r["accelerator"] for r in by_rank] == [
        (p, d, t) for p in range(2) for d in range(2) for t in range(2)
    ]


# -- one process ---------------------------------------------------------------------------


def test_tp_pp_refusals_name_the_value():
    with pytest.raises(TargetNotSupportedError, match=r"tp\+pp: say the tensor-parallel degree"):
        retarget.compile_for(llama(), "tp+pp[size=2]", example_inputs=batch(), world_size=4)
    with pytest.raises(TargetNotSupportedError, match=r"tp\[sequence_parallel=true\]\+pp"):
        retarget.compile_for(
            llama(), "tp[size=2,sequence_parallel=true]+pp[size=2]", example_inputs=batch(),
            world_size=4,
        )  # fmt: skip
    with pytest.raises(TargetNotSupportedError, match=r"tp\+pp\[size=2\]\+ac\+compile: .*drop"):
        retarget.compile_for(
            llama(), "tp[size=2]+pp[size=2]+ac+compile", example_inputs=batch(), world_size=4
        )
    with pytest.raises(TargetNotSupportedError, match=r"pp\[size=4\]: the pipeline degree"):
        retarget.compile_for(llama(), "tp[size=2]+pp[size=4]", example_inputs=batch(), world_size=4)


def test_tp_pp_plan_text():
    compiled = retarget.compile_for(
        llama(), "fsdp+tp[size=2]+pp[size=2]", example_inputs=batch(), world_size=8
    )
    text = str(compiled.report)
    assert "each stage on 2 ranks, fsdp over them" in text
    assert "model.layers.0.self_attn.q_proj: colwise" in text
