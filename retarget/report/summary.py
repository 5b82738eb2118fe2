"""Report: what compile_for did, as a table for people and a dict for tools.

print(compiled.report)              # regions, passes, per-module decisions
json.dumps(compiled.report.to_dict())
"""

from __future__ import annotations

from typing import Any

from retarget.ir.program import Program
from retarget.report.memory_estimate import MemoryEstimate, estimate_memory
from retarget.report.plan_text import plan_lines
from retarget.report.xla_text import xla_dict, xla_lines


class Report:
    def __init__(self, program: Program):
        self.program = program

    def to_dict(self) -> dict[str, Any]:
        return self._to_dict(estimate_memory(self.program, run=False))

    def _to_dict(self, memory: MemoryEstimate) -> dict[str, Any]:
        p = self.program
        return {
            "target": str(p.target),
            "capture": _capture_in_effect(p),
            "capture_asked": p.capture,
            "lazy": p.example is None,
            "model": type(p.original).__name__,
            "parameters": sum(t.numel() for t in p.original.parameters()),
            "regions": [
                {
                    "name": r.name,
                    "block_type": r.block_type,
                    "frontend": r.frontend,
                    "reason": r.reason,
                    "failures": [{"frontend": f, "reason": w} for f, w in r.failures],
                    "repeats": r.repeats,
                    "paths": list(r.paths),
                    "shared_graph": r.shared,
                    "signatures": len(r.graphs),
                    "graphs": len(r.distinct_graphs()),
                    "dynamic_reuses": r.reuses,
                    "eager_signatures": list(r.eager_signatures),
                    "eager_while_hooked": dict(r.hooked),
                    "capture_seconds": round(r.capture_seconds, 4),
                    "compile": r.runner.summary() if r.runner is not None else None,
                }
                for r in p.regions
            ],
            "passes": [record.to_dict() for record in p.history],
            "modules": p.analysis.modules or {},
            "fp8": p.analysis.fp8,
            "quant": p.analysis.quant,
            "plan": p.plan.to_dict(),
            "memory": memory.to_dict(),
            "xla": xla_dict(p),
            "notes": list(p.notes),
        }

    def __str__(self) -> str:
        memory = estimate_memory(self.program, run=False)  # once, for the dict and the table
        d = self._to_dict(memory)
        lines = [
            f"retarget report: {d['model']} ({d['parameters']:,} parameters)",
            f"target: {d['target']}    capture: {d['capture']}"
            + (
                "    (lazy: no example_inputs, regions captured at first call)"
                if d["lazy"] and not d["capture"].startswith("none")
                else ""
            ),
            "",
            "regions",
        ]
        rows = [("name", "block", "repeats", "frontend", "reason")]
        for r in d["regions"]:
            rows.append((r["name"], r["block_type"], str(r["repeats"]), r["frontend"], r["reason"]))
        lines += _table(rows)
        lines += _region_events(d["regions"])
        lines += compile_lines(d["regions"])
        lines += ["", "passes"]
        rows = [("pass", "changed", "seconds", "stats / notes")]
        for record in d["passes"]:
            stats = ", ".join(f"{k}={v}" for k, v in record["stats"].items())
            rows.append(
                (
                    record["name"],
                    "yes" if record["changed"] else "no",
                    f"{record['seconds']:.3f}",
                    stats,
                )
            )
        lines += _table(rows)
        noted = [(r["name"], note) for r in d["passes"] for note in r["notes"]]
        if noted:  # full text: notes carry the decisions, a table cell would cut them
            lines += ["", "notes"] + [f"  {name}: {note}" for name, note in noted]
        if d["modules"]:
            lines += ["", "linear / conv modules"]
            fp8 = (d["fp8"] or {}).get("linears", {})
            quant = (d["quant"] or {}).get("linears", {})
            header = ("module", "class", "weight", "flops", "inputs")
            rows = [header + (("fp8",) if fp8 else ()) + (("quant",) if quant else ())]
            for path, m in d["modules"].items():
                row = (
                    path,
                    m["class"],
                    m["weight"],
                    f"{m['flops']:,}",
                    " ".join(m.get("inputs", [])),
                )
                if fp8:
                    row += (_fp8_decision(fp8.get(path)),)
                if quant:
                    row += (_quant_decision(quant.get(path)),)
                rows.append(row)
            lines += _table(rows)
        lines += ["", *str(memory).splitlines()]
        lines += plan_lines(self.program.plan)
        lines += xla_lines(self.program)
        lines += [f"note: {note}" for note in d["notes"]]
        return "\n".join(lines)

    __repr__ = __str__


def _fp8_decision(decision: dict[str, Any] | None) -> str:
    if decision is None:
        return ""
    if decision["swapped"]:
        return f"swapped ({decision.get('class', 'fp8')})"
    return f"kept: {decision['rule']}"


def _quant_decision(decision: dict[str, Any] | None) -> str:
    if decision is None:
        return ""
    if decision["quantized"]:
        return f"{decision['format']} ({decision['bytes']:,} bytes)"
    return f"kept: {decision['rule']}"


def _region_events(regions: list[dict[str, Any]]) -> list[str]:
    """What happened to regions after capture: eager calls (and why), graphs reused by size."""
    lines = []
    for r in regions:
        for path, kind in r["eager_while_hooked"].items():
            lines.append(f"  {r['name']}: eager while a {kind} on {path} exists")
        if r["eager_signatures"]:
            lines.append(
                f"  {r['name']}: {len(r['eager_signatures'])} call signature(s) eager: "
                + r["eager_signatures"][0]
            )
        if r["dynamic_reuses"]:
            lines.append(
                f"  {r['name']}: {r['graphs']} graph(s) serve {r['signatures']} signatures "
                f"({r['dynamic_reuses']} reused with symbolic sizes)"
            )
    return lines


def compile_lines(regions: list[dict[str, Any]]) -> list[str]:
    """The compile table (the `compile` part): per region how it was compiled and what it cost."""
    compiled = [r for r in regions if r["compile"] is not None]
    if not compiled:
        return []
    header = ("region", "backend", "mode", "form", "compiles", "recompiles", "breaks", "seconds")
    rows = [(*header, "status")]
    for r in compiled:
        c = r["compile"]
        status = f"uncompiled: {c['fallback']}" if c["fallback"] else "compiled"
        if not c["compiles"] and not c["fallback"]:
            status = "pending: compiled at its first call"
        rows.append(
            (
                r["name"],
                c["backend"],
                c["mode"],
                c["form"],
                str(c["compiles"]),
                str(c["recompiles"]),
                str(c["graph_breaks"]),
                f"{c['compile_seconds']:.2f}",
                status,
            )
        )
    lines = ["", "compile (torch.compile; glue outside regions runs eagerly)", *_table(rows)]
    for r in compiled:
        for reason in r["compile"]["break_reasons"]:
            lines.append(f"  {r['name']}: graph break: {reason}")
    return lines


def _table(rows: list[tuple[str, ...]], limit: int = 90) -> list[str]:
    rows = [tuple(c if len(c) <= limit else c[: limit - 3] + "..." for c in row) for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _capture_in_effect(program: Program) -> str:
    """The capture mode that ran: capture="whole" falls back to regions when the whole model
    cannot be captured, and the report says so with the reason, not "whole"."""
    if program.capture == "auto":
        if program.regions and all(r.deferred and not r.recaptured for r in program.regions):
            return "none (auto: no pass reads a graph; capture='regions' captures)"
        if any(r.deferred and r.recaptured for r in program.regions):  # execution/tp_regions.py
            return "regions (auto: the blocks tp split run their own forward)"
        return "regions" if program.regions else "auto"
    if program.capture != "whole" or any(r.paths == [""] for r in program.regions):
        return program.capture
    record = next((r for r in program.history if r.name == "capture_regions"), None)
    why = next((n for n in (record.notes if record else ()) if n.startswith("whole model")), "")
    return f"regions (asked whole; {why})" if why else "regions (asked whole)"
