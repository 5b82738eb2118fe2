"""PassManager: orders passes from their declarations, runs, times, verifies and records them.

Ordering: a networkx DAG with an edge from every pass that is named by, or `provides`, a
requirement of another; the topological order keeps the pipeline's own order where the
declarations leave a choice. A missing requirement or a cycle is a PassOrderError naming the
passes. After each pass the manager checks the invariants every pass must keep (each region
graph lints; state_dict keys are the original's) and, with `verify=True`, that the rewritten
module still computes what eager computes on the example inputs (bitwise for exact passes, the
loosest stated tolerance of the passes run so far otherwise).
"""

from __future__ import annotations

import difflib
import sys
import time
from collections.abc import Iterable
from typing import IO, Any

import networkx as nx
import torch
from torch.utils._pytree import tree_flatten

from retarget.core.errors import PassError, PassOrderError, VerificationError
from retarget.frontends.check import first_difference, preserved_state
from retarget.ir.program import PassRecord, Program
from retarget.passes.base import Numerics, Pass, PassResult


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
        self.passes = order_passes(
            [p for p in passes if p.name not in self.disabled], self.disabled
        )

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
            except Exception as exc:
                raise PassError(pass_.name, ran, exc) from exc
            seconds = time.perf_counter() - start
            if not isinstance(result, PassResult):
                raise PassError(pass_.name, ran, f"run() returned {type(result).__name__}")
            ran.append(pass_.name)
            tolerance.append(pass_.numerics)
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
                    graphs=program.graph_text() if result.changed else {},
                )
            )
            self._dump(pass_.name, program, "after", self.print_after)
        return program

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


def order_passes(passes: list[Pass], disabled: set[str] = frozenset()) -> list[Pass]:
    """Order passes so every requirement runs first; raise PassOrderError when impossible."""
    index = {p.name: i for i, p in enumerate(passes)}
    if len(index) != len(passes):
        raise PassOrderError(f"duplicate pass names in {[p.name for p in passes]}")
    providers: dict[str, list[str]] = {}
    for p in passes:
        for fact in (p.name, *p.provides):
            providers.setdefault(fact, []).append(p.name)
    graph = nx.DiGraph()
    graph.add_nodes_from(index)
    for p in passes:
        for need in p.requires:
            if need not in providers:
                why = "is disabled" if need in disabled else "is not in the pipeline"
                raise PassOrderError(f"pass '{p.name}' requires '{need}', which {why}")
            graph.add_edges_from((source, p.name) for source in providers[need])
    try:
        order = list(nx.lexicographical_topological_sort(graph, key=index.__getitem__))
    except nx.NetworkXUnfeasible:
        cycle = " -> ".join(edge[0] for edge in nx.find_cycle(graph))
        raise PassOrderError(f"pass requirements form a cycle: {cycle}") from None
    by_name = {p.name: p for p in passes}
    return [by_name[name] for name in order]


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
