"""PassManager: the order check, provides checks, disabling, verification, failure messages."""

from __future__ import annotations

import io
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import retarget
from retarget.core.errors import PassError, PassOrderError, VerificationError
from retarget.core.modules import structural_copy, with_mixin
from retarget.core.plans import DdpPlan
from retarget.core.slots import PROGRAM
from retarget.ir.program import ExampleInputs, Program
from retarget.passes.analysis.find_blocks import FindBlocks
from retarget.passes.base import Numerics, Pass, PassResult
from retarget.passes.capture.capture_regions import CaptureRegions
from retarget.passes.manager import PassManager, check_order
from retarget.targets.grammar import parse_target


def make(name, requires=(), provides=(), run=None, numerics=None, after=()):
    attrs = {"name": name, "summary": name, "requires": tuple(requires), "provides": provides}
    attrs["after"] = tuple(after)
    if numerics is not None:
        attrs["numerics"] = numerics
    attrs["run"] = run or (lambda self, program: PassResult(changed=False))
    return type(name.title(), (Pass,), attrs)()


def program_for(model, example=None):
    root = with_mixin(structural_copy(model), retarget.CompiledModule)
    program = Program(root, model, parse_target("single"), ExampleInputs.of(example))
    PROGRAM.set(root, program)
    return program


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def recorder(ran, also=None):
    """A run() that appends the pass name to `ran` (after `also(program)`, when given)."""

    def run(self, program):
        if also is not None:
            also(program)
        ran.append(self.name)
        return PassResult(changed=False)

    return run


def plan_ddp(program):
    program.plan.ddp = DdpPlan(
        strategy="ddp", world=program.world, options={}, parameters=0, buckets=()
    )


def test_a_correct_list_runs_in_exactly_the_given_order():
    ran = []
    passes = [
        make("d", run=recorder(ran)),
        make("b", provides=("ddp",), run=recorder(ran, plan_ddp)),
        make("c", requires=["ddp"], after=["b"], run=recorder(ran)),
        make("a", run=recorder(ran)),
    ]
    manager = PassManager(passes)
    assert manager.passes == passes
    manager.run(program_for(nn.Linear(2, 2)))
    assert ran == ["d", "b", "c", "a"]


def test_a_requirement_provided_later_is_refused_naming_both_passes_and_the_token():
    passes = [make("c", requires=["ddp"]), make("b", provides=("ddp",)), make("a")]
    with pytest.raises(
        PassOrderError, match=r"pass 'c' requires 'ddp', which runs after it \(provided by 'b'\)"
    ):
        check_order(passes)
    with pytest.raises(PassOrderError, match="pass 'c' requires 'ddp', which runs after it"):
        PassManager(passes)


def test_missing_requirement_names_both_passes():
    with pytest.raises(PassOrderError, match="pass 'x' requires 'y', which is not in the pipeline"):
        check_order([make("x", requires=["y"])])


def test_mutual_requirements_are_refused_at_the_first_pass():
    with pytest.raises(PassOrderError, match="pass 'a' requires 'b', which runs after it$"):
        check_order([make("a", requires=["b"]), make("b", requires=["a"])])


def test_after_is_enforced_when_both_passes_are_present():
    check_order([make("x"), make("y", after=["x"])])
    check_order([make("y", after=["x"])])
    with pytest.raises(
        PassOrderError, match="pass 'y' is declared after 'x', which runs after it; put 'x' first"
    ):
        check_order([make("y", after=["x"]), make("x")])
    PassManager([make("y", after=["x"]), make("x")], disable=["x"])


def test_duplicate_pass_names_are_refused():
    with pytest.raises(PassOrderError, match="duplicate pass names"):
        check_order([make("a"), make("a")])


def test_a_provides_token_without_a_fact_check_is_refused():
    with pytest.raises(
        PassOrderError, match="pass 'b' provides 'fact_b', which retarget.passes.facts has no check"
    ):
        PassManager([make("b", provides=("fact_b",))])


def test_a_pass_whose_provides_does_not_hold_is_refused():
    program = program_for(nn.Linear(2, 2))
    with pytest.raises(
        VerificationError,
        match=r"pass 'fake_ddp' failed \(after: first\): provides 'ddp', which does not hold",
    ):
        PassManager([make("first"), make("fake_ddp", provides=("ddp",))]).run(program)
    assert [record.name for record in program.history] == ["first"]


def test_disable_removes_a_pass_and_reports_dependents():
    ran = []
    record = lambda self, program: ran.append(self.name) or PassResult(changed=False)  # noqa: E731
    passes = [make("a", run=record), make("b", run=record)]
    PassManager(passes, disable=["a"]).run(program_for(nn.Linear(2, 2)))
    assert ran == ["b"]
    with pytest.raises(PassOrderError, match="requires 'a', which is disabled$"):
        PassManager([make("a"), make("b", requires=["a"])], disable=["a"])
    with pytest.raises(
        PassOrderError, match=r"requires 'ddp', which is disabled \(provided by 'a'\)"
    ):
        PassManager([make("a", provides=("ddp",)), make("b", requires=["ddp"])], disable=["a"])


def test_unknown_disable_name_suggests_the_closest():
    with pytest.raises(ValueError, match="did you mean 'alpha'"):
        PassManager([make("alpha")], disable=["alpah"])


def test_history_records_timing_stats_and_notes():
    def run(self, program):
        return PassResult(changed=False, stats={"n": 3}, notes=("looked",))

    program = program_for(nn.Linear(2, 2))
    PassManager([make("look", run=run)]).run(program)
    (record,) = program.history
    assert (record.name, record.changed, record.stats, record.notes) == (
        "look",
        False,
        {"n": 3},
        ("looked",),
    )
    assert record.seconds >= 0


def test_failing_pass_is_named_with_the_passes_before_it():
    def boom(self, program):
        raise NotImplementedError("unsupported pattern at layers.0")

    with pytest.raises(PassError) as info:
        PassManager([make("first"), make("second"), make("third", run=boom)]).run(
            program_for(nn.Linear(2, 2))
        )
    message = str(info.value)
    assert "pass 'third' failed (after: first, second)" in message
    assert "unsupported pattern at layers.0" in message
    assert info.value.pass_name == "third"


def test_pass_returning_something_else_is_an_error():
    with pytest.raises(PassError, match="returned NoneType"):
        PassManager([make("bad", run=lambda self, program: None)]).run(program_for(nn.Linear(2, 2)))


def capture_pipeline(*extra):
    return [FindBlocks(), CaptureRegions(), *extra]


def rewrite_output(gm, fn, *extra):
    """Apply fn to the graph's first output value (export outputs are a tuple)."""
    output = next(iter(gm.graph.find_nodes(op="output")))
    values = output.args[0]
    many = isinstance(values, (tuple, list))
    with gm.graph.inserting_before(output):
        new = gm.graph.call_function(fn, (values[0] if many else values, *extra))
    output.args = ((new, *values[1:]) if many else new,)


def add_one(self, program):
    for region in program.regions:
        region.add_transform(self.name, lambda gm: rewrite_output(gm, torch.add, 1.0))
    return PassResult(changed=True)


def test_verify_catches_a_pass_that_breaks_numerics():
    x = torch.randn(4, 8)
    program = program_for(Stack(), x)
    with pytest.raises(VerificationError, match="pass 'add_one' failed .*numerics differ"):
        PassManager(
            capture_pipeline(make("add_one", requires=["regions"], run=add_one)), verify=True
        ).run(program)


def test_verify_respects_declared_tolerance_of_approx_passes():
    def nudge(self, program):
        for region in program.regions:
            region.add_transform(self.name, lambda gm: rewrite_output(gm, torch.mul, 1 + 1e-6))
        return PassResult(changed=True)

    loose = Numerics("approx", rtol=1e-3, atol=1e-5)
    program = program_for(Stack(), torch.randn(4, 8))
    PassManager(
        capture_pipeline(make("nudge", ["regions"], run=nudge, numerics=loose)), verify=True
    ).run(program)
    assert program.history[-1].changed


def test_keys_check_catches_a_pass_that_renames_state():
    def rename(self, program):
        program.module.blocks.add_module("extra", nn.Linear(1, 1))
        return PassResult(changed=True)

    with pytest.raises(VerificationError, match="state_dict keys changed"):
        PassManager([make("rename", run=rename)]).run(program_for(Stack()))


def test_lint_check_catches_a_broken_graph():
    def corrupt(self, program):
        gm = program.regions[0].representative().gm
        gm.graph.create_node("get_attr", "no.such.attribute")
        return PassResult(changed=True)

    program = program_for(Stack(), torch.randn(4, 8))
    with pytest.raises(VerificationError, match="graph of blocks.*"):
        PassManager(capture_pipeline(make("corrupt", ["regions"], run=corrupt))).run(program)


def test_print_before_and_after_named_passes():
    stream = io.StringIO()
    program = program_for(Stack(), torch.randn(4, 8))
    rewrite = make("add_one", requires=["regions"], run=add_one)
    PassManager(
        capture_pipeline(rewrite), print_before=["add_one"], print_after=["add_one"], stream=stream
    ).run(program)
    text = stream.getvalue()
    before = text.split("# ---- after")[0]
    after = text.split("# ---- after")[1]
    assert "# ---- before add_one: region blocks.*" in text
    assert "torch.add" not in before.replace("torch.ops.aten", "")
    assert "torch.add" in after
    assert "torch.add" in program.graphs_at("add_one")["blocks.*"]
    assert "torch.add" not in program.graphs_at("add_one", "before")["blocks.*"]


@dataclass(frozen=True, kw_only=True)
class _Opts:
    level: int = 1
    """How much."""


def test_options_type_is_checked():
    cls = type("WithOpts", (Pass,), {"name": "w", "summary": "w", "Options": _Opts})
    assert cls().options == _Opts()
    assert cls(_Opts(level=2)).options.level == 2
    with pytest.raises(TypeError, match="takes _Opts"):
        cls({"level": 2})
