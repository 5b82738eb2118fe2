"""PassManager: checks the order it is given, then runs, times, verifies and records passes.

Order is the list's: the manager never reorders. `check_order` refuses (PassOrderError, naming
both passes and the token) a pass whose `requires` no earlier pass provides, or that is declared
`after` a pass placed later. After each pass the manager checks that every token it `provides`
holds on the Program (passes/facts.py), the invariants every pass must keep (each region graph
lints; state_dict keys are the original's) and, with `verify=True`, that the rewritten module
still computes what eager computes on the example inputs (bitwise for exact passes, the
loosest stated tolerance of the passes run so far otherwise).
"""

from __future__ import annotations

import difflib
import sys
import time
from collections.abc import Iterable
from typing import IO, Any

import torch
from torch.utils._pytree import tree_flatten

from retarget.core.errors import (
    PassError,
    PassOrderError,
    TargetNotSupportedError,
    VerificationError,
)
from retarget.frontends.check import first_difference, preserved_state
from retarget.ir.program import PassRecord, Program
from retarget.passes.base import Numerics, Pass, PassResult
from retarget.passes.facts import FACTS


class PassManager:
    """Runs a list of passes over a Program.

    >>> PassManager([FindBlocks(), CaptureRegions()], verify=True).run(program)
    """

    def __init__(
        self,
        passes: Iterable[Pass],
        *,
        verify: bool = False,
        disable: Iterable[str] = (),
        print_before: Iterable[str] = (),
        print_after: Iterable[str] = (),
        stream: IO[str] | None = None,
    ):
        passes = list(passes)
        names = [p.name for p in passes]
        self.disabled = _check_names(set(disable), names, "disable")
        self.print_before = _check_names(set(print_before), names, "print_before")
        self.print_after = _check_names(set(print_after), names, "print_after")
        self.verify = verify
        self.stream = stream
        self.passes = [p for p in passes if p.name not in self.disabled]
        check_order(self.passes, [p for p in passes if p.name in self.disabled])

    def run(self, program: Program) -> Program:
        keys = program.state_keys()
        reference = _reference_outputs(program) if self.verify else None
        tolerance: list[Numerics] = []
        ran: list[str] = []
        for pass_ in self.passes:
            self._dump(pass_.name, program, "before", self.print_before)
            start = time.perf_counter()
            try:
                result = pass_.run(program)
            except TargetNotSupportedError:
                raise  # a refusal of the target (shard_tp's plan checks), not a broken pass
            except Exception as exc:
                raise PassError(pass_.name, ran, exc) from exc
            seconds = time.perf_counter() - start
            if not isinstance(result, PassResult):
                raise PassError(pass_.name, ran, f"run() returned {type(result).__name__}")
            ran.append(pass_.name)
            tolerance.append(pass_.numerics)
            self._check_provides(pass_, ran[:-1], program)
            if not pass_.applies:  # an applied model's forward may be collective, or lazy (XLA)
                self._check(pass_.name, ran[:-1], program, keys, reference, tolerance)
            program.history.append(
                PassRecord(
                    name=pass_.name,
                    summary=pass_.summary,
                    numerics=str(pass_.numerics),
                    seconds=seconds,
                    changed=result.changed,
                    stats=dict(result.stats),
                    notes=tuple(result.notes),
                    graphs=program.graph_text() if result.changed and not pass_.applies else {},
                )
            )
            self._dump(pass_.name, program, "after", self.print_after)
        return program

    def _check_provides(self, pass_: Pass, before: list[str], program: Program) -> None:
        for token in pass_.provides:
            fact = FACTS[token]
            if not fact(program):
                why = f"provides '{token}', which does not hold: {fact.__doc__}"
                raise VerificationError(pass_.name, before, why)

    def _check(self, name, before, program, keys, reference, tolerance) -> None:
        for region in program.regions:
            for graph in region.graphs.values():
                try:
                    graph.gm.graph.lint()
                except Exception as exc:
                    raise VerificationError(name, before, f"graph of {region.name}: {exc}") from exc
        now = program.state_keys()
        if now != keys:
            added = sorted(set(now) - set(keys))[:5]
            lost = sorted(set(keys) - set(now))[:5]
            raise VerificationError(name, before, f"state_dict keys changed: +{added} -{lost}")
        if reference is not None:
            problem = _compare(reference, _outputs(program), tolerance)
            if problem:
                raise VerificationError(name, before, f"numerics differ from eager: {problem}")

    def _dump(self, name: str, program: Program, when: str, selected: set[str]) -> None:
        if name not in selected:
            return
        out = self.stream or sys.stderr
        for region, code in program.graph_text().items():
            print(f"# ---- {when} {name}: region {region}\n{code}\n", file=out)


def check_order(passes: list[Pass], disabled: Iterable[Pass] = ()) -> None:
    """Refuse a pass list that breaks a declaration; the list's own order is never changed.

    Each `requires` token must be provided (or named) by an earlier pass, each `after` name
    present in the list must come earlier, and each `provides` token must have a check in
    passes/facts.py. Raises PassOrderError naming both passes and the token.
    """
    names = [p.name for p in passes]
    if len(set(names)) != len(names):
        raise PassOrderError(f"duplicate pass names in {names}")
    disabled = list(disabled)
    for index, pass_ in enumerate(passes):
        for token in pass_.provides:
            if token not in FACTS:
                raise PassOrderError(
                    f"pass '{pass_.name}' provides '{token}', which retarget.passes.facts "
                    f"has no check for; add one to FACTS ({', '.join(FACTS)})"
                )
        for need in pass_.requires:
            if not _providers(passes[:index], need):
                raise PassOrderError(
                    f"pass '{pass_.name}' requires '{need}', "
                    + _unmet(need, _providers(passes[index:], need), _providers(disabled, need))
                )
        for name in pass_.after:
            if name in names[index:]:
                raise PassOrderError(
                    f"pass '{pass_.name}' is declared after '{name}', which runs after it; "
                    f"put '{name}' first"
                )


def _providers(passes: Iterable[Pass], token: str) -> list[str]:
    """Names of the passes that provide `token` or are named by it."""
    return [p.name for p in passes if token == p.name or token in p.provides]


def _unmet(need: str, later: list[str], disabled: list[str]) -> str:
    """Why no earlier pass provides `need`: a later one does, a disabled one does, or none."""
    for providers, why in ((later, "runs after it"), (disabled, "is disabled")):
        if providers:
            by = "" if providers == [need] else f" (provided by '{providers[0]}')"
            return f"which {why}{by}"
    return "which is not in the pipeline"


def _check_names(selected: set[str], names: list[str], what: str) -> set[str]:
    for name in selected:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; passes: {', '.join(names)}"
            raise ValueError(f"{what}: no pass named '{name}' in this pipeline{hint}")
    return selected


def _outputs(program: Program) -> Any:
    with preserved_state(program.module), torch.no_grad():
        return program.run_example()


def _reference_outputs(program: Program) -> Any:
    if program.example is None:
        raise ValueError("verify=True needs example_inputs to compare against eager")
    with preserved_state(program.original), torch.no_grad():
        return program.original(*program.example.args, **program.example.kwargs)


def _compare(expected: Any, got: Any, numerics: list[Numerics]) -> str:
    approx = [n for n in numerics if n.kind != "exact"]
    if not approx:
        return first_difference(expected, got)
    rtol = max(n.rtol for n in approx)
    atol = max(n.atol for n in approx)
    flat_expected, flat_got = tree_flatten(expected)[0], tree_flatten(got)[0]
    if len(flat_expected) != len(flat_got):
        return f"{len(flat_got)} outputs instead of {len(flat_expected)}"
    for index, (a, b) in enumerate(zip(flat_expected, flat_got, strict=True)):
        if isinstance(a, torch.Tensor) and not torch.allclose(
            a.float(), b.float(), rtol=rtol, atol=atol
        ):
            return f"output {index} outside rtol={rtol}, atol={atol}"
    return ""
