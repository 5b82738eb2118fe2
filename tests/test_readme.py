"""Every code block of README.md runs as written, so the README cannot drift from the code.

- `python` blocks run in document order, in one namespace, in a fresh interpreter whose working
  folder is a scratch folder (a block may use what an earlier one defined); a block fenced
  ```python xla``` needs torch_xla: it runs after the first block where torch_xla imports (the
  xla venv, which CI runs it in), and is skipped elsewhere.
- `bash` blocks run command by command (`\\`-continued lines joined) through bash, in a scratch
  folder holding a `train.py` and an Accelerate config, each command with a fresh HOME (as on a
  new machine: `retarget config` writes nowhere else, and one command's config is not the
  next one's) and this interpreter's scripts first on PATH. The install commands, and those run
  in the xla venv, are not run here: they are checked to be the ones `.ci/run` runs.
- `yaml` blocks (a launch config) go through `retarget launch --config_file`.
- `text` blocks are diagrams and grammar, not code; no other fence is allowed.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.paths import REPO

README = REPO / "README.md"
FENCE = re.compile(r"^```([a-z]*)([^\n]*)\n(.*?)^```\s*$", re.M | re.S)
LANGUAGES = {"python", "bash", "yaml", "text"}
TRAIN_PY = """\
import argparse, os
import retarget
parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=1e-3)
args = parser.parse_args()
print(f"rank {os.environ.get('RANK', '0')} target {retarget.launched_target()} lr {args.lr}")
"""
ACCELERATE_CONFIG = "distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: 'no'\n"


@dataclass(frozen=True)
class Block:
    language: str
    tags: tuple[str, ...]
    code: str
    line: int

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.language})"


def readme_blocks() -> list[Block]:
    text = README.read_text()
    return [
        Block(m[1], tuple(m[2].split()), m[3], text.count("\n", 0, m.start()) + 1)
        for m in FENCE.finditer(text)
    ]


BLOCKS = readme_blocks()


def _of(language: str) -> list[Block]:
    return [b for b in BLOCKS if b.language == language]


def test_every_block_is_python_bash_yaml_or_text():
    assert BLOCKS and {b.language for b in BLOCKS} <= LANGUAGES, [str(b) for b in BLOCKS]


def _xla_available() -> bool:
    try:
        import torch_xla  # noqa: F401
    except Exception:  # absent, or present but broken beside this torch
        return False
    return True


RUNNER = """\
import sys, traceback
blocks = {blocks!r}
namespace = {{"__name__": "__readme__"}}
for line, code in blocks:
    try:
        exec(compile(code, f"README.md:{{line}}", "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        sys.exit(f"README.md:{{line}}: this block failed")
"""


def _run_python(blocks: list[Block], tmp_path: Path) -> None:
    script = tmp_path / "readme_blocks.py"
    script.write_text(RUNNER.format(blocks=[(b.line, b.code) for b in blocks]))
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]


@pytest.mark.distributed  # a fresh interpreter
def test_python_blocks_run_in_order(tmp_path):
    blocks = [b for b in _of("python") if not b.tags]
    assert len(blocks) >= 10
    _run_python(blocks, tmp_path)


@pytest.mark.distributed  # a fresh interpreter
@pytest.mark.skipif(not _xla_available(), reason="needs torch_xla (the xla venv runs it)")
def test_xla_blocks_run_after_the_first(tmp_path):
    """The blocks fenced ```python xla```, after the README's first block (the model and batch)."""
    blocks = [b for b in _of("python") if "xla" in b.tags]
    assert blocks
    _run_python([_of("python")[0], *blocks], tmp_path)


def _commands(block: Block) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", block.code)
    return [c for c in (line.strip() for line in joined.splitlines()) if c and c[0] != "#"]


def _is_install(command: str) -> bool:
    """An install, or a command of the xla venv (CI makes it and runs these there)."""
    return bool(re.search(r"(pip install|-m venv|\.venv-xla/)", command))


def test_install_commands_are_the_ones_ci_runs():
    ci = (REPO / ".ci" / "run").read_text()
    installs = [c for b in _of("bash") for c in _commands(b) if _is_install(c)]
    assert installs
    for command in installs:
        steps = [s.strip() for s in re.split(r"&&", command.split("  #")[0])]
        for step in steps:
            if ".venv-xla/bin/python -m pytest" in step:  # the xla tests CI runs in that venv
                files = [w for w in shlex.split(step) if w.startswith("tests/")]
                assert files and all(f in ci for f in files), command
            if "pip install" in step:
                words = shlex.split(step)
                assert "-c" in words, f"{command}: installs without constraints"
                constraints = words[words.index("-c") + 1]
                assert (REPO / constraints).is_file() and constraints in ci, command
                target = words[-1]
                assert target.strip('"') in ci or target in ci, f"{command}: CI installs otherwise"
    quick_test = next(c for c in installs if "pytest" in c)
    assert quick_test in ci  # the README's test command, verbatim


def _scratch(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "train.py").write_text(TRAIN_PY)
    (tmp_path / "accelerate_config.yaml").write_text(ACCELERATE_CONFIG)
    scripts = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "HOME": str(tmp_path),
        "PATH": f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(REPO),
        "RETARGET_CONFIG": "",
    }


def _run(command: str, tmp_path: Path, env: dict[str, str], stdin: str = "") -> None:
    run = subprocess.run(
        ["bash", "-c", command],
        cwd=tmp_path,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, f"{command}\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"


#: The CLI commands that run in the one process they start.
ONE_PROCESS_COMMANDS = ("demo", "inspect", "estimate-memory", "device-map", "env", "config")


def _one_process(block: Block) -> bool:
    """Every command of `block` runs in one process (no launch, no `retarget test`)."""
    single = rf"(retarget|python -m retarget) ({'|'.join(ONE_PROCESS_COMMANDS)}|--version)(\s|$)"
    return all(_is_install(c) or re.match(single, c) for c in _commands(block))


BASH = [
    pytest.param(b, id=str(b), marks=[pytest.mark.one_process] if _one_process(b) else [])
    for b in _of("bash")
    if any(not _is_install(c) for c in _commands(b))
]


@pytest.mark.distributed  # `retarget launch` and `retarget test` start ranks
@pytest.mark.parametrize("block", BASH)
def test_bash_commands_run(block, tmp_path):
    env = _scratch(tmp_path)
    for index, command in enumerate(_commands(block)):
        if _is_install(command):
            continue
        home = tmp_path / f"home{index}"
        home.mkdir()
        # `retarget config` asks; an empty answer takes each default.
        stdin = "\n" * 40 if re.fullmatch(r"retarget config(\s+#.*)?", command) else ""
        _run(command, tmp_path, {**env, "HOME": str(home)}, stdin)


@pytest.mark.distributed  # the config's processes are launched
@pytest.mark.parametrize("block", _of("yaml"), ids=str)
def test_yaml_configs_launch(block, tmp_path):
    env = _scratch(tmp_path)
    (tmp_path / "config.yaml").write_text(textwrap.dedent(block.code))
    _run("retarget launch --config_file config.yaml train.py", tmp_path, env)
