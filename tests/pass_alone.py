"""Run one pass alone on a captured Program, twice: what it changed, and that a second run changes
nothing more (a pass is a function of the program it is given, not of how often it ran).

    program = captured("bf16")
    first = run_twice(InsertAutocast, "bf16", program)      # the first run's PassResult

`captured(target)` is retarget.driver.capture_program on the zoo's tiny Llama (tests/zoo.py: an HF
LlamaForCausalLM at its default config, sizes shrunk) and its example batch; `run_twice` builds
the pass the way the pipeline does (`stage(target)`), runs it, then runs it again and
checks that the second run reports no change and leaves the graphs, the modules, their records
and the plan as the first left them.
"""

from __future__ import annotations

from typing import Any

from retarget.core.module_record import record_of
from retarget.driver.capture_program import capture_program
from retarget.ir.program import Program
from retarget.passes.base import Pass, PassResult
from retarget.targets.grammar import Target
from tests import zoo


def captured(target: str = "single", world_size: int = 1) -> Program:
    return capture_program(
        zoo.tiny_llama(), target, example_inputs=zoo.lm_inputs(), world_size=world_size
    )


def snapshot(program: Program) -> dict[str, Any]:
    """What a pass can change: region graphs, module classes and records, the plan, analysis."""
    return {
        "graphs": {r.name: [g.gm.code for g in r.distinct_graphs()] for r in program.regions},
        "modules": [(p, type(m).__name__, record_of(m)) for p, m in program.module.named_modules()],
        "plan": program.plan.to_dict(),
        "analysis": repr(program.analysis),
    }


def build(pass_class: type[Pass], target: str) -> Pass:
    (built,) = pass_class.stage(Target.parse(target))
    return built


def run_twice(pass_class: type[Pass], target: str, program: Program) -> PassResult:
    """Run the pass `target` asks for on `program`, then again: the second changes nothing."""
    first = build(pass_class, target).run(program)
    after = snapshot(program)
    second = build(pass_class, target).run(program)
    assert not second.changed, f"{pass_class.name} changed the program again: {second}"
    assert snapshot(program) == after, f"{pass_class.name}'s second run changed the program"
    return first
