"""The pass contract.

A pass declares what it is (`name`, one-line `summary`), what must hold before it runs (`requires`:
facts an earlier pass `provides`, or an earlier pass's name), what it makes hold (`provides`: tokens
of passes/facts.py, checked after it runs), which passes it must follow when they are present
(`after`), how it may change numbers (`numerics`), and its options as a frozen keyword-only
dataclass. The third line of a pass's module docstring repeats these, machine-read by
tests/passes/test_pass_contracts.py, which keeps the two equal ("-" is none; the line may wrap onto
lines starting "    | "):

    Contract: requires regions | provides ddp | after checkpoint_blocks | numerics exact
        | options DdpOptions

An applier (`applies = True`, passes/apply/) decides nothing: it carries out what the passes
recorded, through the execution layer, as one of the pipeline's last stages. A pass that works
on modules and records only (`reads_graphs = False`) lets a pipeline of such passes skip capture.

`stage(target)` builds the passes a target asks for; `run(program)` returns a
`PassResult`; a pass with nothing to do returns `changed=False` and touches nothing. Unsupported
patterns raise NotImplementedError naming the pass and the module path or node; the PassManager
wraps every failure in a PassError that also names the passes that ran before.

    class CountLinears(Pass):
        name = "count_linears"
        summary = "count nn.Linear modules"
        def run(self, program):
            n = sum(isinstance(m, nn.Linear) for m in program.module.modules())
            return PassResult(changed=False, stats={"linears": n})
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from retarget.ir.program import Program
    from retarget.targets.grammar import Target


@dataclass(frozen=True)
class Numerics:
    """`exact`: bitwise equal to eager in fp32; `approx`: within rtol/atol of eager."""

    kind: str = "exact"
    rtol: float = 0.0
    atol: float = 0.0

    def __str__(self) -> str:
        return "exact" if self.kind == "exact" else f"approx(rtol={self.rtol}, atol={self.atol})"


EXACT = Numerics()


@dataclass(frozen=True)
class PassResult:
    """What a pass did: whether it changed the program, counters, and human-readable notes."""

    changed: bool
    stats: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


def coerce_options(options: Any, schema: Mapping[str, Any], owner: str) -> None:
    """Coerce each field of a frozen options dataclass that `schema` (a target part's options)
    declares with that option's parser, in place; a bad value raises ValueError naming
    `owner` (the pass), the field and the value."""
    for item in dataclasses.fields(options):
        if item.name not in schema:
            continue
        value = getattr(options, item.name)
        try:
            object.__setattr__(options, item.name, schema[item.name].coerce(value))
        except ValueError as err:
            raise ValueError(f"{owner} option {item.name}={value!r}: {err}") from None


@dataclass(frozen=True, kw_only=True)
class NoOptions:
    """This pass takes no options."""


class Pass:
    """Base class of every pass; subclasses set the class attributes and implement run()."""

    name: ClassVar[str]
    summary: ClassVar[str]
    requires: ClassVar[tuple[str, ...]] = ()
    provides: ClassVar[tuple[str, ...]] = ()
    after: ClassVar[tuple[str, ...]] = ()
    numerics: ClassVar[Numerics] = EXACT
    Options: ClassVar[type] = NoOptions
    applies: ClassVar[bool] = False
    """An applier (passes/apply/): carries out recorded decisions on the process group or the
    devices. The manager records it but does not re-check the model after it."""
    reads_graphs: ClassVar[bool] = True
    """It reads or rewrites region graphs. When no pass of a pipeline does, capture="auto"
    (retarget.Accelerator's) captures nothing: the regions run their modules' own forward,
    which is what their graphs would compute (passes/capture/capture_regions.py). True unless a
    pass says otherwise, so a pass of the user's (extra_passes) always finds its graphs."""

    def __init__(self, options: Any = None):
        self.options = self.Options() if options is None else options
        if not isinstance(self.options, self.Options):
            raise TypeError(f"pass '{self.name}' takes {self.Options.__name__}, got {options!r}")

    @classmethod
    def stage(cls, target: Target) -> list[Pass]:
        """The passes of this class that realise `target`, options set; [] when it asks for none.

        `capture` is compile_for's CaptureOptions (capture mode, frontends); only
        capture_regions reads it. Every stage of passes/pipeline.py is built through this call.
        """
        raise NotImplementedError(f"pass '{cls.name}' does not implement stage()")

    def run(self, program: Program) -> PassResult:
        raise NotImplementedError(f"pass '{self.name}' does not implement run()")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options})"
