"""Each pass file opens with its machine-readable contract, equal to the class's declarations."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import retarget
from retarget.passes.facts import FACTS
from retarget.passes.pipeline import STAGES

PASSES = [pass_class for _, pass_class in STAGES]
PASSES_DIR = Path(retarget.__file__).parent / "passes"
FIELDS = ("requires", "provides", "after", "numerics", "options")
MAX_LINES = 400


def contract_line(pass_class: type) -> dict[str, str]:
    """The `Contract:` paragraph right after the module docstring's first line, by field."""
    doc = inspect.getmodule(pass_class).__doc__
    paragraphs = doc.split("\n\n")
    assert paragraphs[1].startswith("Contract: "), f"{pass_class.name}: no contract in line 3"
    text = " ".join(paragraphs[1].removeprefix("Contract: ").split())
    fields = dict(part.strip().split(" ", 1) for part in text.split(" | "))
    assert tuple(fields) == FIELDS, f"{pass_class.name}: fields {tuple(fields)}, not {FIELDS}"
    return fields


def declared(pass_class: type) -> dict[str, str]:
    """The class attributes, written as the contract line writes them."""
    listed = {key: ", ".join(getattr(pass_class, key)) or "-" for key in FIELDS[:3]}
    return {**listed, "numerics": str(pass_class.numerics), "options": pass_class.Options.__name__}


@pytest.mark.parametrize("pass_class", PASSES, ids=lambda c: c.name)
def test_contract_line_equals_the_class_declarations(pass_class):
    assert contract_line(pass_class) == declared(pass_class)


@pytest.mark.parametrize("pass_class", PASSES, ids=lambda c: c.name)
def test_docstring_opens_with_the_pass_name(pass_class):
    first_line = inspect.getmodule(pass_class).__doc__.splitlines()[0]
    assert re.match(rf"{pass_class.name}[ :]", first_line), first_line


def test_one_pass_per_file():
    modules = [pass_class.__module__ for pass_class in PASSES]
    assert len(set(modules)) == len(modules)


def test_declarations_name_what_exists():
    names = {pass_class.name for pass_class in PASSES}
    tokens = {token for pass_class in PASSES for token in pass_class.provides}
    for pass_class in PASSES:
        assert set(pass_class.provides) <= set(FACTS), pass_class.name
        assert set(pass_class.after) <= names, pass_class.name
        assert set(pass_class.requires) <= tokens | names, pass_class.name
    assert tokens == set(FACTS)


def test_every_pass_file_is_under_the_line_limit():
    long = {
        str(path.relative_to(PASSES_DIR)): n
        for path in sorted(PASSES_DIR.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"
