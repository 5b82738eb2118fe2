"""The plan as report lines: DDP buckets, FSDP units per rank, hooks, applied or not; streaming.

`retarget.report.summary` appends these lines to the text report; the JSON report carries the plan
itself (`to_dict()["plan"]`, from `Plan.to_dict()`).
"""

from __future__ import annotations

from retarget.core.plans import (
    AppliedPlan,
    CpPlan,
    DdpPlan,
    FsdpPlan,
    Plan,
    PpPlan,
    StreamPlan,
    TpPlan,
)

_SHOWN_RANKS = 8
_DDP_FLAGS = ("find_unused_parameters", "static_graph", "gradient_as_bucket_view")


def plan_lines(plan: Plan) -> list[str]:
    """Lines for the text report; [] when the plan has nothing about distribution or streaming."""
    record = plan.distribution
    if record is None and plan.pp is not None:
        head = f"distribution plan: pp over {plan.pp.size} processes; {_applied(plan.applied)}"
        return ["", head, *_pp_lines(plan.pp)]
    if record is None and plan.tp is not None:
        head = f"distribution plan: tp over {plan.tp.size} processes; {_applied(plan.applied)}"
        return ["", head, *_tp_lines(plan.tp)]
    if record is None:
        return _stream_lines(plan.stream) if plan.stream is not None else []
    strategy = record.strategy + ("+tp" if plan.tp is not None else "")
    lines = [
        "",
        f"distribution plan: {strategy} over {record.world.describe()}; {_applied(plan.applied)}",
    ]
    lines += _ddp_lines(record) if isinstance(record, DdpPlan) else _fsdp_lines(record)
    if plan.tp is not None:
        lines.append(
            "  (FSDP's counts above: whole tensors over dp; tp splits its modules further)"
        )
        lines += _tp_lines(plan.tp)
    if plan.zero1 is not None:
        lines.append(
            "  zero1: optimizer state per rank (elements) "
            + " | ".join(f"{n:,}" for n in plan.zero1.per_rank[:_SHOWN_RANKS])
            + " (runtime.prepare(optimizer) makes it a ZeroRedundancyOptimizer)"
        )
    if plan.comm_hook is not None:
        lines.append(f"  comm hook: {plan.comm_hook.describe()}")
    if plan.cp is not None:
        lines += _cp_lines(plan.cp)
    return lines


def _pp_lines(plan: PpPlan) -> list[str]:
    lines = [f"  {plan.describe()}"]
    rows = [("stage", "blocks", "est. GFLOPs", "also")]
    for stage in plan.stages:
        first = stage.start if stage.start not in ("", stage.blocks[0]) else stage.blocks[0]
        span = f"{first} .. {stage.blocks[-1]}" if first != stage.blocks[-1] else first
        also = "embeddings" if stage.index == 0 else ""
        also = "final norm, head, loss" if stage.index == len(plan.stages) - 1 else also
        rows.append(
            (str(stage.index), f"{span} ({len(stage.blocks)})", f"{stage.cost / 1e9:.3f}", also)
        )
    return lines + _table(rows)


def _cp_lines(plan: CpPlan) -> list[str]:
    lines = [f"  {plan.describe()}"]
    lines.append(
        f"  (the strategy averages gradients over all ranks, data- and context-parallel: "
        f"mesh (dp {plan.data_parallel}, cp {plan.size}))"
    )
    rows = [("attention module", "split", "sliding window")]
    for path in plan.attention_modules:
        window = plan.sliding_windows.get(path)
        rows.append((path, f"{plan.attention} over {plan.size} ranks", str(window or "-")))
    return lines + _table(rows)


def _stream_lines(plan: StreamPlan) -> list[str]:
    lines = ["", plan.describe()]
    if plan.device_map:
        lines.append(
            f"  offloaded: {plan.offloaded_bytes:,} bytes in {plan.units} blocks; device map:"
        )
        rows = [("module", "device")] + [(k or "<model>", v) for k, v in plan.device_map.items()]
        lines += _table(rows)
    else:
        lines.append("  device map: planned when the plan is applied")
    return lines


def _applied(applied: AppliedPlan | None) -> str:
    if applied is None:
        return "not applied yet"
    if not applied.applied:
        return f"not applied: {applied.reason}"
    return f"applied: {applied.wrapped} on {applied.backend}, {applied.device}"


def _ddp_lines(plan: DdpPlan) -> list[str]:
    buckets = plan.buckets
    options = plan.options
    lines = [
        f"  DDP buckets: {len(buckets)} bucket{'s' if len(buckets) != 1 else ''} "
        f"(cap {options['bucket_cap_mb']} MiB, first 1 MiB), launched in this order"
    ]
    rows = [("bucket", "tensors", "elements", "MiB", "parameters")]
    for i, b in enumerate(buckets):
        names = b.parameters
        span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
        rows.append((str(i), str(len(names)), f"{b.numel:,}", f"{b.mib}", span))
    lines += _table(rows)
    flags = [k for k in _DDP_FLAGS if options[k]]
    if flags:
        lines.append(f"  DDP options: {', '.join(flags)}")
    return lines


def _fsdp_lines(plan: FsdpPlan) -> list[str]:
    shape = " x ".join(f"{n} {d}" for n, d in zip(plan.mesh_shape, plan.mesh_dims, strict=True))
    reshard = (
        "resharded after forward"
        if plan.reshard_after_forward
        else "kept gathered from forward to backward"
    )
    lines = [f"  FSDP2 units on mesh ({shape}); parameters {reshard}"]
    if plan.param_dtype:
        lines.append(
            f"  MixedPrecisionPolicy: gather in {plan.param_dtype}, reduce-scatter "
            f"gradients in {plan.reduce_dtype} (the gradient communication dtype)"
        )
    if plan.offload:
        lines.append(f"  CPUOffloadPolicy(pin_memory={plan.pin_memory})")
    rows = [("unit", "block", "parameters", "per rank")]
    for unit in plan.units:
        per_rank = unit.per_rank
        shown = " | ".join(f"{n:,}" for n in per_rank[:_SHOWN_RANKS])
        more = f" (+{len(per_rank) - _SHOWN_RANKS} ranks)" if len(per_rank) > _SHOWN_RANKS else ""
        rows.append((unit.path or "<root>", unit.block, f"{unit.parameters:,}", shown + more))
    return lines + _table(rows)


def _tp_lines(plan: TpPlan) -> list[str]:
    lines = [f"  {plan.describe()}"]
    rows = [("module", "style", "why")]
    for path, rule in plan.rules.items():
        parts = plan.fused.get(path, 1)
        style = rule.style + (f" ({parts} fused parts)" if parts > 1 else "")
        if path in plan.fused_widths:
            style += f" (fused parts of {list(plan.fused_widths[path])})"
        rows.append((path, style, rule.reason))
    lines += _table(rows)
    for path, fixes in plan.attribute_fixes.items():
        lines.append(f"  {path}: per rank " + ", ".join(f"{k}={v}" for k, v in fixes.items()))
    if plan.blocks:
        rows = [("block", "parameters", "per rank", "share")]
        for path, (mine, total) in plan.blocks.items():
            rows.append((path, f"{total:,}", f"{mine:,}", f"{mine / max(total, 1):.0%}"))
        lines += _table(rows)
    return lines


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "    " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
