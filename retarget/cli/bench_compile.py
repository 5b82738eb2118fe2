"""The compile suites' figures: rows for `retarget bench`'s table, and their own README tables.

bench/test_compile_step.py writes bench/compile_step.json (per row: median step seconds of each
arm and their ratios), bench/test_compile_time.py bench/compile_time.json (median cold first-step
and compile seconds per arm and depth, their ratios) and bench/test_compile_dist.py
bench/compile_dist.json (2 ranks, compiled / by hand). Each JSON also says when, on which commit
and under what load it was measured. Each figure is shown beside the goal issue #18 sets for it.
"""

from __future__ import annotations

from typing import Any

Row = tuple[str, str, str]

#: figure (or "case: figure") -> the most it may be (issue #18; 1.02 for the 2-rank rows is its
#: point 7's overhead limit); a figure without one is shown without a goal.
GOALS = {
    "fp32: compile / uncompiled": 0.60,
    "compile / by hand": 1.02,
    "retarget Accelerator / Accelerate": 1.00,
    "first step, 4 layers: retarget Accelerator / Accelerate": 1.00,
    "compile seconds: regions 32 / 2 layers": 1.5,
    "compile seconds: regions 32 layers / whole model 32 layers": 0.5,
    "compiled / by hand": 1.02,
}
DIST_KEY = "ratio compiled / by hand (median of rounds)"


def _goal(figure: str, value: float, case: str = "") -> str:
    limit = GOALS.get(f"{case}: {figure}", GOALS.get(figure))
    if limit is None:
        return ""
    return f"<= {limit:.2f}: {'met' if value <= limit else 'missed'}"


def compile_step_rows(data: dict[str, Any]) -> list[Row]:
    return [
        ("compile: step, 1 process", f"{row}: {name}", f"{value:.3f}")
        for row, r in data.items()
        for name, value in r["ratios"].items()
    ]


def compile_time_rows(data: dict[str, Any]) -> list[Row]:
    return [("compile: cold compile", k, f"{v:.3f}") for k, v in data["ratios"].items()]


def compile_dist_rows(data: dict[str, Any]) -> list[Row]:
    return [
        ("compile: 2 ranks", f"{k}: compiled / by hand", f"{v[DIST_KEY]:.3f}")
        for k, v in data.items()
    ]


def _header(record: dict[str, Any], rounds: Any) -> str:
    commit = (record.get("commit") or "unknown")[:7]
    if record.get("retarget_dirty"):
        commit += " (retarget/ had uncommitted changes)"
    return (
        f"Date: {record.get('date', '?')}. Commit: {commit}. Rounds: {rounds}. Machine: "
        f"{record.get('cpus', '?')} CPUs, torch {record.get('torch', '?')}, load average "
        f"{record.get('load_average', '?')} when the figures were written."
    )


def _table(rows: list[tuple[str, str, float]]) -> list[str]:
    lines = ["| case | figure | value | goal |", "|---|---|---|---|"]
    lines += [
        f"| {case} | {figure} | {value:.3f} | {_goal(figure, value, case)} |"
        for case, figure, value in rows
    ]
    return lines


def compile_step_markdown(data: dict[str, Any]) -> str:
    """Step-time ratios per row, each arm's median step, the goals."""
    first = next(iter(data.values()))
    rows = [(row, name, value) for row, r in data.items() for name, value in r["ratios"].items()]
    lines = [_header(first, first["rounds"]), "", *_table(rows), ""]
    for row, r in data.items():
        steps = ", ".join(f"{arm} {s:.4f}" for arm, s in r["median_step_seconds"].items())
        lines.append(f"- {row} median step seconds: {steps}.")
    return "\n".join(lines)


def compile_time_markdown(data: dict[str, Any]) -> str:
    """Cold compile ratios, and the median first-step / compile seconds of each measurement."""
    rows = [("cold, fresh process", k, v) for k, v in data["ratios"].items()]
    lines = [_header(data, data["rounds"]), "", *_table(rows), ""]
    lines += ["| arm@layers | first step s | compile s | later step s |", "|---|---|---|---|"]
    for name, s in data["median_seconds"].items():
        lines.append(f"| {name} | {s['first']:.2f} | {s['compile']:.2f} | {s['step']:.4f} |")
    return "\n".join(lines)


def compile_dist_markdown(data: dict[str, Any]) -> str:
    """2-rank ratios compiled / by hand, with the geometric mean and both medians."""
    first = next(iter(data.values()))
    lines = [
        _header(first, first["rounds"]),
        "",
        "| configuration | compiled / by hand (median of rounds) | geometric mean | median step s "
        "compiled, by hand | goal |",
        "|---|---|---|---|---|",
    ]
    for config, r in data.items():
        value = r[DIST_KEY]
        steps = r["median_step_seconds"]
        lines.append(
            f"| {config} | {value:.3f} | "
            f"{r['ratio compiled / by hand (geometric mean of rounds)']:.3f} | "
            f"{steps['compiled']:.4f}, {steps['by_hand']:.4f} | "
            f"{_goal('compiled / by hand', value)} |"
        )
    return "\n".join(lines)
