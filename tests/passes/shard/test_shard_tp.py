"""shard_tp in one process: the recorded plan, per-rank counts, refusals, the report, inspect."""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn

import retarget
from retarget.core.errors import TargetNotSupportedError
from retarget.core.plans import TpRule
from retarget.report.memory_estimate import estimate_memory
from tests import tp_models as tm


def _compile(name: str, target: str, world: int = 2):
    build, _, kind = tm.MODELS[name]
    example = tm.batch_for(kind, 2)
    example = example["x"] if kind == "vector" else example
    return retarget.compile_for(build(), target, example_inputs=example, world_size=world)


@pytest.mark.parametrize("name", list(tm.MODELS))
def test_each_block_holds_at_most_55_percent_per_rank_at_size_2(name):
    compiled = _compile(name, f"tp[size=2,plan=tests.tp_models:{name.upper()}_2]")
    plan = compiled.program.plan.tp
    assert plan.size == 2 and plan.blocks
    for path, (mine, total) in plan.blocks.items():
        assert mine <= 0.55 * total, (path, mine, total)
    model = tm.MODELS[name][0]()
    assert plan.total_numel == sum(p.numel() for p in model.parameters())
    assert plan.per_rank_numel < plan.total_numel
    # In one process nothing is split: the blocks keep their graphs, captured again once split.
    assert not any(r.eager_only for r in compiled.program.regions)
    notes = next(p for p in compiled.report.to_dict()["passes"] if p["name"] == "shard_tp")
    assert any(n.endswith(": captured again once split") for n in notes["notes"])


def test_counts_follow_the_split_dims():
    compiled = _compile("mlp", "tp[size=2,plan=tests.tp_models:MLP_2]")
    plan = compiled.program.plan.tp
    # Per block: Linear(32->64) colwise holds half its weight and bias; Linear(64->32)
    # rowwise half its weight and its whole bias (32).
    colwise, rowwise = 64 * 32 + 64, 32 * 64 + 32
    assert plan.blocks["blocks.0"] == (colwise // 2 + 32 * 64 // 2 + 32, colwise + rowwise)
    # The head (4x32+4) stays whole.
    assert plan.per_rank_numel == 2 * plan.blocks["blocks.0"][0] + 4 * 32 + 4


def test_memory_estimate_counts_what_tp_leaves_per_rank():
    compiled = _compile("mlp", "tp[size=2,plan=tests.tp_models:MLP_2]")
    estimate = estimate_memory(compiled, run=False)
    assert estimate.parameters == 4 * compiled.program.plan.tp.per_rank_numel
    assert "tp[size=2]: the split modules hold 1/2 of their weights" in estimate.notes
    both = _compile("mlp", "fsdp+tp[size=2,plan=tests.tp_models:MLP_2]", world=4)
    assert estimate_memory(both, run=False).shards == 2  # FSDP over the 2 dp ranks


def test_report_and_json_show_the_plan():
    compiled = _compile("gpt2", "tp[size=2,plan=tests.tp_models:GPT2_2]")
    text = str(compiled.report)
    assert "distribution plan: tp over 2 processes; not applied: world size is 1" in text
    assert "transformer.h.0.attn.c_attn  colwise (3 fused parts)" in text
    assert "transformer.h.0.attn: per rank split_size=16, num_heads=2" in text
    assert "transformer.h.0  " in text
    assert "region transformer.h.*: captured again once split" in text
    plan = compiled.report.to_dict()["plan"]["tp"]
    assert plan["size"] == 2 and plan["fused"] == {
        "transformer.h.0.attn.c_attn": 3,
        "transformer.h.1.attn.c_attn": 3,
    }


def test_inspect_shows_the_plan_for_a_stated_world_size(capsys):
    from retarget.cli.main import main

    argv = ["inspect", "tests.tp_models:neox", "--inputs", "tests.zoo:lm_inputs"]
    target = "tp[size=4,plan=tests.tp_models:NEOX_4]"
    assert main([*argv, "--target", target, "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "distribution plan: tp over 4 processes; not applied: world size is 1" in out
    assert "9,744 of 25,344 parameter elements per rank" in out  # embed_in split too
    assert "gpt_neox.layers.0  8,544       2,280     27%" in out
    assert "region gpt_neox.layers.*: captured again once split" in out


def test_fsdp_plus_tp_plans_a_dp_by_tp_mesh():
    compiled = _compile("llama", "fsdp+tp[size=2,plan=tests.tp_models:LLAMA_2]", world=4)
    fsdp = compiled.program.plan.fsdp
    assert (fsdp.mesh_shape, fsdp.mesh_dims) == ((2,), ("dp",))
    passes = compiled.report.to_dict()["passes"]
    assert next(r for r in passes if r["name"] == "shard_tp")["stats"]["mesh"] == [2, 2]
    assert "distribution plan: fsdp+tp over 4 processes" in str(compiled.report)
    # FSDP's per-rank counts are of what tp left per rank, chunked over the 2 dp ranks.
    blocks = compiled.program.plan.tp.blocks
    for unit in fsdp.units[:-1]:
        assert len(unit.per_rank) == 2 and sum(unit.per_rank) == blocks[unit.path][0]


def test_fsdp_plus_tp_counts_a_fused_bias_whole_on_every_dp_rank():
    # GPT-2's c_attn bias is q|k|v split on dim 0: FSDP2 cannot chunk it over dp, so each dp
    # rank keeps its tp slice whole (execution/tp_fsdp.py); the counts and the estimate say so.
    compiled = _compile("gpt2", "fsdp+tp[size=2,plan=tests.tp_models:GPT2_2]", world=4)
    blocks = compiled.program.plan.tp.blocks
    for unit in compiled.program.plan.fsdp.units[:-1]:
        bias = compiled.get_submodule(unit.path).attn.c_attn.bias.numel() // 2  # one tp slice
        assert unit.per_rank[0] == unit.per_rank[1]
        assert sum(unit.per_rank) == blocks[unit.path][0] + bias  # one extra copy, not a split
    estimate = estimate_memory(compiled, optimizer="sgd")
    planned = sum(u.per_rank[0] for u in compiled.program.plan.fsdp.units)
    assert estimate.parameters == 4 * planned


def _refusal(name: str, target: str, world: int = 2) -> str:
    with pytest.raises(TargetNotSupportedError) as info:
        _compile(name, target, world)
    return str(info.value)


def test_refusals_name_the_module_and_why(monkeypatch):
    plan = tm.mlp_plan(tm.mlp(), 2)
    bad = {
        "MISSING": {"blocks.9.0": TpRule(style="colwise", reason="x")},
        "GELU": {"blocks.0.1": TpRule(style="colwise", reason="x")},
        "STYLE": {"blocks.0.0": TpRule(style="diagonal", reason="x")},
    }
    for key, rules in bad.items():
        monkeypatch.setattr(tm, f"{key}_2", dataclasses.replace(plan, rules=rules), raising=False)
    assert "module 'blocks.9.0': the model has no such module" in _refusal(
        "mlp", "tp[size=2,plan=tests.tp_models:MISSING_2]"
    )
    assert "module 'blocks.0.1': a GELU cannot be split colwise" in _refusal(
        "mlp", "tp[size=2,plan=tests.tp_models:GELU_2]"
    )
    assert "unknown style 'diagonal'" in _refusal("mlp", "tp[size=2,plan=tests.tp_models:STYLE_2]")
    # A width fix on a module the plan splits would be dropped at apply time: refused instead.
    gpt2 = tm.GPT2_2
    fixes = {**gpt2.attribute_fixes, "transformer.h.0.mlp.c_fc": {"nf": 64}}
    monkeypatch.setattr(tm, "NF_2", dataclasses.replace(gpt2, attribute_fixes=fixes), raising=False)
    assert "attribute fix on 'transformer.h.0.mlp.c_fc', which the plan splits colwise" in _refusal(
        "gpt2", "tp[size=2,plan=tests.tp_models:NF_2]"
    )
    # The head's 4 outputs do not split in 3.
    head = dataclasses.replace(plan, size=3, rules={"head": TpRule(style="colwise", reason="x")})
    monkeypatch.setattr(tm, "HEAD_3", head, raising=False)
    assert "module 'head': weight dim 0 (4) does not split evenly into 3" in _refusal(
        "mlp", "tp[size=3,plan=tests.tp_models:HEAD_3]", world=3
    )


def test_refusals_of_layouts_and_options():
    assert "plan is for size 2, the target asks for size 4" in _refusal(
        "mlp", "tp[size=4,plan=tests.tp_models:MLP_2]", world=4
    )
    assert "tp[size=2] alone on 4 processes" in _refusal(
        "mlp", "tp[size=2,plan=tests.tp_models:MLP_2]", world=4
    )
    assert "fsdp+tp: say the tensor-parallel degree" in _refusal(
        "mlp", "fsdp+tp[plan=tests.tp_models:MLP_2]", world=4
    )
    # Sequence and loss parallelism are derived (plan=auto); a record must say them itself.
    assert "the target says sequence_parallel=true, the plan record sequence_parallel=False" in (
        _refusal("mlp", "tp[size=2,sequence_parallel=true,plan=tests.tp_models:MLP_2]")
    )
    assert "the target says loss_parallel=true, the plan record loss_parallel=False" in (
        _refusal("mlp", "tp[size=2,loss_parallel=true,plan=tests.tp_models:MLP_2]")
    )
    # The MLP adds each block's output to the stream outside the blocks: glue between blocks.
    assert "the input of block 'blocks.1' is not the output of block 'blocks.0'" in _refusal(
        "mlp", "tp[size=2,sequence_parallel=true]"
    )
    assert "cannot import it" in _refusal("mlp", "tp[size=2,plan=tests.tp_models:NOPE]")


def test_a_model_not_split_is_untouched_in_one_process():
    compiled = _compile("mlp", "tp[size=2,plan=tests.tp_models:MLP_2]")
    assert not any(hasattr(p, "placements") for p in compiled.parameters())
    assert isinstance(compiled.program.submodule("blocks.0.0"), nn.Linear)


def test_partial_gradient_norms_are_planned_alone_and_under_fsdp():
    """Qwen3's per-head q/k norms are read whole on each rank's heads: the auto plan marks them
    replicate_grad_allreduce, under tp alone and under fsdp+tp (their gradients are summed over
    tp by a hook, or as Partial DTensors under FSDP2: tests/passes/shard/test_tp_training.py)."""
    for target, world in (("tp[size=2]", 2), ("fsdp+tp[size=2]", 4)):
        rules = _compile("qwen3", target, world).program.plan.tp.rules
        norms = [p for p in rules if p.endswith(("q_norm", "k_norm"))]
        assert len(norms) == 2 * tm.LAYERS, target
        assert all(rules[p].style == "replicate_grad_allreduce" for p in norms), target


def test_fused_parts_on_dim_0_are_planned_under_fsdp():
    """GPT-2's c_attn (bias [q|k|v] on dim 0) splits each part on its own under fsdp+tp too;
    FSDP2 keeps that bias whole over dp (execution/tp_fsdp.py, test_tp_training.py)."""
    plan = _compile("gpt2", "fsdp+tp[size=2,plan=tests.tp_models:GPT2_2]", world=4).program.plan
    assert plan.tp.fused["transformer.h.0.attn.c_attn"] == 3
    assert plan.tp.rules["transformer.h.0.attn.c_attn"].style == "colwise"
