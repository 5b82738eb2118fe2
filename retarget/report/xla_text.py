"""The xla plan in the report: where each parameter lives and the graphs XLA compiled per step.

`Report` appends `xla_lines` to its text (so `retarget inspect --target xla` shows them) and
`xla_dict` to its dict. Per parameter: its shape, the placement the plan chose (dim 0 over the
mesh axis, or replicated), the shape one device holds, and, once the plan is applied, XLA's own
sharding spec of the live tensor (`{devices=[4,1]0,1,2,3}`; "" is replicated). The step line
comes from the compiled model's XlaSteps: graphs compiled per step, and the steps after warm-up
that compiled again (each a performance bug: a changed shape or a baked-in value).
"""

from __future__ import annotations

from typing import Any

from retarget.core.plans import XlaPlan
from retarget.execution import xla_device as xla
from retarget.execution.xla_placement import xla_steps
from retarget.ir.program import Program


def xla_parameters(program: Program, plan: XlaPlan) -> list[dict[str, Any]]:
    """One row per parameter: name, shape, placement, per-device shape, XLA's spec."""
    rows = []
    for name, param in program.module.named_parameters():
        shape = tuple(param.shape)
        spec = plan.shards.get(name)
        local = shape
        if spec is not None:
            local = (shape[0] // plan.devices, *shape[1:])
        applied = param.device.type == "xla"
        rows.append(
            {
                "name": name,
                "shape": list(shape),
                "placement": _placement(spec, plan.devices),
                "per_device": list(local),
                "xla_spec": (xla.sharding_spec(param) or "replicated") if applied else None,
            }
        )
    return rows


def xla_dict(program: Program) -> dict[str, Any] | None:
    """The JSON form: the parameters' layout and the step counts (None without an xla plan)."""
    plan = program.plan.xla
    if plan is None:
        return None
    steps = xla_steps(program.module)
    return {
        "parameters": xla_parameters(program, plan),
        "steps": steps.to_dict() if steps is not None else None,
    }


def xla_lines(program: Program) -> list[str]:
    """Lines for the text report ([] without an xla plan)."""
    plan = program.plan.xla
    if plan is None:
        return []
    steps = xla_steps(program.module)
    lines = ["", plan.describe()]
    rows = [("parameter", "shape", "placement", "per device", "XLA sharding")]
    for row in xla_parameters(program, plan):
        rows.append(
            (
                row["name"],
                _shape(row["shape"]),
                row["placement"],
                _shape(row["per_device"]),
                row["xla_spec"] if row["xla_spec"] is not None else "not applied",
            )
        )
    lines += _table(rows)
    lines.append("  " + (steps.describe() if steps is not None else "xla steps: not applied"))
    return lines


def _placement(spec: tuple[str | None, ...] | None, devices: int) -> str:
    if spec is None:
        return "replicated" if devices > 1 else "whole (one device)"
    dims = [f"dim {i} over {axis} ({devices})" for i, axis in enumerate(spec) if axis]
    return ", ".join(dims)


def _shape(shape: list[int]) -> str:
    return "x".join(map(str, shape)) or "scalar"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
