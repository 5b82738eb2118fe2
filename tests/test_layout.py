"""The package's layout rules, checked on the source tree (import layering is lint-imports' job;
a function's complexity is ruff's C901, a smell to look at rather than a line count).

- every package's `__init__` says what it is; each layer's says what it may import;
- `retarget.__all__` is the compiler's API; Accelerate's names import from their compat home
  and from where users import them;
- tests/ mirrors retarget/: every test file sits in the folder of the package it tests;
- a test that starts other processes is marked `distributed` (so `-m "not distributed"`, the
  GPU machine's one-process suite, leaves it out);
- no private name (`_name`) of one retarget module is imported by another;
- values kept in a module's `__dict__` go through the declared slots (core/slots.py);
- no pass reads `program.target`: what a pass needs of the target is in its options, set by its
  `stage(target)`;
- every file docs/architecture.md points to exists, and every source file or document named
  anywhere in retarget/ (docstrings, comments, messages).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "retarget"
SOURCES = sorted(PACKAGE.rglob("*.py"))
PACKAGES = sorted(PACKAGE.rglob("__init__.py"))
#: The layers of pyproject.toml's import-linter contract that are packages.
LAYERS = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", PACKAGES, ids=_relative)
def test_every_package_says_what_it_is(path):
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and len(doc.split()) >= 8, f"{_relative(path)} has no docstring worth the name"


@pytest.mark.parametrize("layer", LAYERS)
def test_each_layer_says_what_it_may_import(layer):
    doc = ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text())) or ""
    assert re.search(r"\b(layer|imports?|above|below)\b", doc, re.I), layer


def test_the_top_level_api_is_the_compilers():
    import retarget
    from retarget.compat import accelerate

    assert set(retarget.__all__) == {
        *("compile_for", "CompiledModule", "launched_target", "Target", "parse_target"),
        *("Pass", "PassResult", "__version__"),
        *("CheckpointError", "ConfigError", "EagerRegionWarning", "OptimizerNotPrepared"),
        *("PassError", "PassOrderError", "RegionCompileError", "TargetError"),
        *("TargetNotSupportedError", "UncompiledRegionWarning", "VerificationError"),
        "XlaRecompileWarning",
    }
    assert all(getattr(retarget, name) is not None for name in retarget.__all__)
    from retarget.compat.accelerate.accelerator import Accelerator
    from retarget.compat.accelerate.utils import set_seed
    from retarget.local_sgd import LocalSGD
    from retarget.utils import LocalSGD as FromUtils
    from retarget.utils import set_seed as from_utils

    assert retarget.Accelerator is Accelerator and from_utils is set_seed
    assert LocalSGD is FromUtils and accelerate.__doc__


def test_tests_mirror_the_package():
    """A test file in a folder of tests/ tests the package of the same path."""
    tests = ROOT / "tests"
    for path in tests.rglob("test_*.py"):
        folder = path.parent.relative_to(tests)
        if str(folder) != ".":
            assert (PACKAGE / folder).is_dir(), f"{_relative(path)}: no package retarget/{folder}"
    top = sorted(p.name for p in tests.glob("test_*.py"))
    # whole-repository checks only: the layout, the README, the test device switch (conftest.py),
    # the suite's time and memory report (tests/memory_report.py), its two workers' lock
    # (tests/core_share.py), its pooled gloo worlds (tests/distributed.py) and the prepared GPU
    # script (bench/gpu/run.sh)
    whole = [
        "test_core_share.py",
        "test_device_switch.py",
        "test_distributed.py",
        "test_gpu_script.py",
        "test_layout.py",
        "test_memory_report.py",
        "test_readme.py",
    ]
    assert top == whole, top


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


def test_no_pass_reads_the_target_from_the_program():
    passes = PACKAGE / "passes"
    readers = [
        _relative(p) for p in sorted(passes.rglob("*.py")) if "program.target" in p.read_text()
    ]
    assert readers == []


#: A path-like name of a source file or document: `a/b/c.py`, `c.py`, `README.md`.
_NAMED_FILE = re.compile(r"(?<![\w./*-])((?:[\w.-]+/)*[\w-]+\.(?:py|md))\b")
#: The user's own script, as the launch commands' examples and messages call it.
_USERS_FILES = {"train.py", "script.py"}


def _exists_in_repository(name: str, near: Path) -> bool:
    """`name` is a file beside `near`, under the repository or retarget/, or the end of the path
    of one (`memory/profile.py` written inside passes/ names passes/memory/profile.py)."""
    if any(p.is_file() for p in (near.parent / name, ROOT / name, PACKAGE / name)):
        return True
    return any(p.as_posix().endswith("/" + name) for p in _REPOSITORY_FILES)


_REPOSITORY_FILES = [
    p
    for top in ("retarget", "tests", "bench", "docs", "examples")
    for p in (ROOT / top).rglob("*")
    if p.suffix in (".py", ".md") and "__pycache__" not in p.parts
] + sorted(ROOT.glob("*.md"))


def test_files_named_in_the_package_exist():
    missing = sorted(
        f"{_relative(source)}: {name}"
        for source in SOURCES
        for name in set(_NAMED_FILE.findall(source.read_text()))
        if name not in _USERS_FILES and not _exists_in_repository(name, source)
    )
    assert missing == []


#: What starts other processes: a spawn context, the launchers, a subprocess, and the test
#: helpers that call them (found the same way in tests/*.py).
SPAWNERS = {"notebook_launcher", "debug_launcher", "get_context", "Popen"}


def _functions(tree: ast.Module) -> dict[str, tuple[ast.FunctionDef, set[str]]]:
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names = set()
            for inner in ast.walk(node):
                if isinstance(inner, ast.Name):
                    names.add(inner.id)
                elif isinstance(inner, ast.Attribute):
                    names.add(inner.attr)
                    if isinstance(inner.value, ast.Name) and inner.value.id == "subprocess":
                        names.add("Popen")
            found[node.name] = (node, names)
    return found


def _reaching(functions: dict, spawners: set[str]) -> set[str]:
    """Names of the functions that call a spawner, directly or through each other."""
    reach: set[str] = set()
    grew = True
    while grew:
        grew = False
        for name, (_, names) in functions.items():
            if name not in reach and names & (spawners | reach):
                reach.add(name)
                grew = True
    return reach


def _helper_spawners() -> dict[str, set[str]]:
    tests = ROOT / "tests"
    helpers = {
        p.stem: _functions(ast.parse(p.read_text()))
        for p in tests.glob("*.py")
        if not p.name.startswith("test_")
    }
    found = {stem: _reaching(functions, SPAWNERS) for stem, functions in helpers.items()}
    found["distributed"].add("run_ranks")
    return found


def test_tests_that_start_processes_are_marked_distributed():
    helpers = _helper_spawners()
    unmarked = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        spawners = set(SPAWNERS)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests."):
                stem = node.module.rpartition(".")[2]
                spawners |= {a.asname or a.name for a in node.names} & helpers.get(stem, set())
        functions = _functions(tree)
        for name in _reaching(functions, spawners):
            node = functions[name][0]
            marks = [ast.unparse(d) for d in node.decorator_list]
            if name.startswith("test_") and not any("mark.distributed" in m for m in marks):
                unmarked.append(f"{_relative(path)}::{name}")
    assert unmarked == []


def test_one_process_tests_are_distributed_tests():
    """`one_process` relaxes the lock of a test that starts processes (tests/core_share.py);
    on any other test it would mean nothing."""
    loose = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for name, (node, *_) in _functions(ast.parse(path.read_text())).items():
            marks = [ast.unparse(d) for d in getattr(node, "decorator_list", [])]
            if any("mark.one_process" in m for m in marks) and not any(
                "mark.distributed" in m for m in marks
            ):
                loose.append(f"{_relative(path)}::{name}")
    assert loose == []
