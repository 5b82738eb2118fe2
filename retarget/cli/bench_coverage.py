"""The coverage suite's figures: one row per zoo model, and its own table in bench/README.md.

bench/test_coverage.py writes bench/coverage.json (date, commit, machine, and per model: regions,
captured regions, frontends, capture seconds, bitwise equality with eager, a note); this module
turns it into rows for `retarget bench`'s terminal table and into the markdown section that
`--write-readme` puts between the coverage markers.
"""

from __future__ import annotations

from typing import Any


def _captured(model: dict[str, Any]) -> str:
    return f"{model['captured']}/{model['regions']} regions ({model['repeats']} repeats)"


def coverage_rows(data: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(suite, figure, value) per model: captured regions, frontends, seconds, bitwise."""
    rows = []
    for model in data["models"]:
        if "error" in model:
            rows.append(("coverage", model["model"], f"error: {model['error']}"))
            continue
        frontends = "+".join(model["frontends"])
        bitwise = "bitwise" if model["bitwise"] else "NOT bitwise"
        value = f"{_captured(model)} by {frontends}, {model['capture_seconds']:.2f} s, {bitwise}"
        rows.append(("coverage", model["model"], value))
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def coverage_markdown(data: dict[str, Any]) -> str:
    """The coverage table with the date, commit and machine it was measured on."""
    source = data.get("source", {})
    commit = (source.get("commit") or "unknown")[:7]
    if source.get("retarget_dirty"):
        commit += " (retarget/ had uncommitted changes)"
    machine = data.get("machine", {})
    lines = [
        f"Date: {data['date']}. Commit: {commit}. Target: {data['target']}. "
        f"Models: {data['zoo']}. Machine: {machine.get('platform', '?')}, "
        f"{machine.get('cpus', '?')} CPUs, torch {machine.get('torch', '?')}, "
        f"transformers {machine.get('transformers', '?')}.",
        "",
        "| model | class | regions | captured | frontend | capture s | bitwise | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model in data["models"]:
        if "error" in model:
            cells = [model["model"], "", "", "", "", "", "no", f"error: {model['error']}"]
        else:
            cells = [
                model["model"],
                model["class"],
                f"{model['regions']} ({', '.join(model['blocks'])})",
                _captured(model),
                ", ".join(model["frontends"]),
                f"{model['capture_seconds']:.2f}",
                "yes" if model["bitwise"] else "no",
                model["note"],
            ]
        lines.append("| " + " | ".join(_cell(str(c)) for c in cells) + " |")
    return "\n".join(lines)
