"""The package's layout rules, checked on the source tree (import layering is lint-imports' job).

- no module in retarget/ is over 400 lines;
- no private name (`_name`) of one retarget module is imported by another;
- values kept in a module's `__dict__` go through the declared slots (core/slots.py);
- every file docs/architecture.md points to exists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "retarget"
SOURCES = sorted(PACKAGE.rglob("*.py"))
MAX_LINES = 400


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", SOURCES, ids=_relative)
def test_module_is_at_most_400_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{_relative(path)} has {lines} lines; split it along a seam"


def _private_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("retarget"):
            found += [
                f"{node.module}.{a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.endswith("__")
            ]
    return found


def test_no_private_name_is_imported_across_modules():
    found = {_relative(p): _private_imports(p) for p in SOURCES}
    assert {path: names for path, names in found.items() if names} == {}


def test_module_dict_values_go_through_declared_slots():
    # Class markers (`_retarget_mixin` read from a class's own __dict__) are not module slots.
    pattern = re.compile(r"__dict__(\[|\.get\(|\.pop\(|\.setdefault\()\s*[\"']_retarget_(?!mixin)")
    offenders = [
        _relative(p) for p in SOURCES if p.name != "slots.py" and pattern.search(p.read_text())
    ]
    assert offenders == []


def test_files_named_in_the_architecture_doc_exist():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:[a-z_]+/)+[a-z_]+\.py)", doc))
    assert named, "the doc names no files"
    missing = sorted(
        name for name in named if not (PACKAGE / name).exists() and not (ROOT / name).exists()
    )
    assert missing == []
