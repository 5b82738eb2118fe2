"""The default pipeline: the list is the order, the manager checks it, every reason is declared."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

import retarget
from retarget.core.errors import PassOrderError, TargetNotSupportedError
from retarget.execution import xla_device as xla
from retarget.models.tiny_llama import synthetic_batch, tiny_lm
from retarget.passes import pipeline
from retarget.passes.base import Pass, PassResult
from retarget.passes.manager import PassManager, check_order
from retarget.passes.pipeline import STAGES, build_pipeline, place_extra
from retarget.passes.shard import shard_ddp
from retarget.targets.grammar import parse_target

ANALYSES = ["find_blocks", "capture_regions", "annotate_shapes"]
#: Rich targets and the order their passes run in, as the pipeline documents it.
DOCUMENTED = {
    "fsdp+bf16+fp8[min_size=16]+ac": [
        *ANALYSES,
        *("swap_fp8", "insert_autocast", "checkpoint_blocks", "shard_fsdp", "apply_plan"),
    ],
    "ddp+fp16+ac+powersgd": [
        *ANALYSES,
        *("insert_autocast", "checkpoint_blocks", "shard_ddp", "comm_hook", "apply_plan"),
    ],
    "fsdp+bf16+fp8[min_size=16]+ac+compile[backend=eager]": [
        *ANALYSES,
        *("swap_fp8", "insert_autocast", "checkpoint_blocks", "compile_regions", "shard_fsdp"),
        "apply_plan",
    ],
    "ddp+bf16+ac+compile[backend=eager]": [
        *ANALYSES,
        *("insert_autocast", "checkpoint_blocks", "compile_regions", "shard_ddp", "apply_plan"),
    ],
    "zero1+bf16+fp8+ac+bf16-comm": [
        *ANALYSES,
        *("swap_fp8", "insert_autocast", "checkpoint_blocks", "shard_ddp"),
        *("shard_optimizer_state", "comm_hook", "apply_plan"),
    ],
    "bf16+stream[from=disk,max_memory=0.5]": [
        *ANALYSES,
        *("insert_autocast", "plan_stream", "apply_stream"),
    ],
}
#: (must run first, must run later): each reason the pipeline's comments give for an order.
CONSTRAINTS = [
    ("find_blocks", "capture_regions"),
    ("capture_regions", "annotate_shapes"),
    ("annotate_shapes", "swap_fp8"),
    ("swap_fp8", "insert_autocast"),
    ("swap_fp8", "checkpoint_blocks"),
    ("insert_autocast", "checkpoint_blocks"),
    ("swap_fp8", "shard_fsdp"),
    ("insert_autocast", "shard_fsdp"),
    ("checkpoint_blocks", "shard_fsdp"),
    ("swap_fp8", "shard_ddp"),
    ("insert_autocast", "shard_ddp"),
    ("checkpoint_blocks", "shard_ddp"),
    ("swap_fp8", "compile_regions"),
    ("insert_autocast", "compile_regions"),
    ("checkpoint_blocks", "compile_regions"),
    ("compile_regions", "shard_ddp"),
    ("compile_regions", "shard_fsdp"),
    ("shard_ddp", "shard_optimizer_state"),
    ("shard_ddp", "comm_hook"),
    # The appliers carry out what every decision recorded: after all of them.
    ("shard_fsdp", "apply_plan"),
    ("shard_ddp", "apply_plan"),
    ("comm_hook", "apply_plan"),
    ("shard_optimizer_state", "apply_plan"),
    ("plan_stream", "apply_stream"),
]


def names(target: str) -> list[str]:
    return [p.name for p in build_pipeline(parse_target(target))]


@pytest.mark.parametrize("target", list(DOCUMENTED))
def test_default_pipeline_passes_the_check_and_runs_in_the_documented_order(target):
    passes = build_pipeline(parse_target(target))
    assert [p.name for p in passes] == DOCUMENTED[target]
    check_order(passes)
    assert PassManager(passes).passes == passes
    model = tiny_lm()
    batch = synthetic_batch(
        model.config, batch=2, seq=8, generator=torch.Generator().manual_seed(0)
    )
    compiled = retarget.compile_for(model, target, example_inputs=batch, world_size=2)
    assert [record.name for record in compiled.program.history] == DOCUMENTED[target]


@pytest.mark.parametrize(("first", "later"), CONSTRAINTS)
def test_every_documented_constraint_is_declared_so_a_swap_is_refused(first, later):
    target = next(t for t, order in DOCUMENTED.items() if {first, later} <= set(order))
    passes = build_pipeline(parse_target(target))
    index = {p.name: i for i, p in enumerate(passes)}
    moved = passes.pop(index[later])
    passes.insert(index[first], moved)
    with pytest.raises(PassOrderError, match=f"pass '{later}' .*runs after it") as refused:
        check_order(passes)
    assert f"'{first}'" in str(refused.value)


def test_zero1_is_composed_in_the_pipeline_not_imported_by_shard_ddp():
    assert names("zero1")[-3:] == ["shard_ddp", "shard_optimizer_state", "apply_plan"]
    assert names("ddp")[-2:] == ["shard_ddp", "apply_plan"]
    tree = ast.parse(inspect.getsource(shard_ddp))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "retarget.passes.shard.zero1" not in imported


def test_every_stage_is_built_by_its_pass_class_and_parts_it_names():
    for parts, pass_class in STAGES:
        for part in parts:
            if part == "xla" and not xla.available() and pass_class.name == "place_xla":
                with pytest.raises(TargetNotSupportedError, match="constraints-xla.txt"):
                    pass_class.stage(parse_target(part))
                continue
            built = pass_class.stage(parse_target(_alone(part)))
            assert built and all(isinstance(p, pass_class) for p in built), part
        if parts:
            assert pass_class.stage(parse_target("single")) == [], pass_class.name


def test_single_is_only_the_analyses():
    assert names("single") == ANALYSES


def test_a_part_no_stage_realises_is_refused(monkeypatch):
    # Every part has a stage now: take tp away from every stage (its pass and its applier) to
    # see the refusal a part without one gets.
    without_tp = tuple((parts - {"tp"}, cls) for parts, cls in pipeline.STAGES)
    monkeypatch.setattr(pipeline, "STAGES", without_tp)
    with pytest.raises(TargetNotSupportedError, match="no pass implements 'tp'"):
        build_pipeline(parse_target("fsdp+tp"))


def _alone(part: str) -> str:
    """A valid target naming `part`: parts that need a strategy or precision get one."""
    needs = {
        "offload": "fsdp+offload",
        "fp16-comm": "ddp+fp16-comm",
        "bf16-comm": "ddp+bf16-comm",
        "cp": "ddp+cp",
    }
    return needs.get(part, "ddp+powersgd" if part == "powersgd" else part)


class _Counting(Pass):
    name = "count_linears"
    summary = "count nn.Linear modules"

    def run(self, program):
        n = sum(isinstance(m, torch.nn.Linear) for m in program.module.modules())
        return PassResult(changed=False, stats={"linears": n})


def test_extra_passes_are_placed_by_their_contracts_and_run():
    base = build_pipeline(parse_target("ddp+bf16+ac"))

    def position(**declared) -> list[str]:
        extra = type("Extra", (_Counting,), declared)()
        return [p.name for p in place_extra(base, [extra])]

    assert position(requires=("regions",))[:3] == [
        "find_blocks",
        "capture_regions",
        "count_linears",
    ]
    assert position(after=("insert_autocast",)).index("count_linears") == 4
    assert position()[3] == "count_linears"  # no needs: after the analyses
    named = position(after=("shard_ddp",))  # past the last decision, never past the appliers
    assert named[-3:] == ["shard_ddp", "count_linears", "apply_plan"]
    model = tiny_lm()
    batch = synthetic_batch(
        model.config, batch=2, seq=8, generator=torch.Generator().manual_seed(0)
    )
    compiled = retarget.compile_for(
        model,
        "bf16",
        example_inputs=batch,
        extra_passes=[_Counting()],
        print_after=["count_linears"],
    )
    record = next(r for r in compiled.history if r.name == "count_linears")
    assert record.stats == {"linears": 7 * model.config.layers + 1}  # q k v o, gate up down
    with pytest.raises(TypeError, match="extra_passes takes Pass instances"):
        retarget.compile_for(model, "single", extra_passes=[lambda program: None])
