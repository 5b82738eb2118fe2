"""Start-up cost: `import retarget` and `retarget --help` load no torch (seconds on a cold
start), and the choices the CLI writes out equal the library's own constants."""

from __future__ import annotations

import subprocess
import sys

import pytest

from retarget.cli import choices


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code` (which prints nothing)."""
    probe = f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return set(done.stdout.split())


@pytest.mark.distributed  # starts a fresh interpreter
def test_import_retarget_loads_no_torch():
    assert "torch" not in _modules_after("import retarget")


@pytest.mark.distributed  # starts a fresh interpreter
def test_help_of_every_command_loads_no_torch():
    code = (
        "import contextlib, io\n"
        "from retarget.cli.main import build_parser, main\n"
        "from retarget.cli.commands import COMMANDS\n"
        "build_parser()\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    for name in ['--version', '--help', *COMMANDS]:\n"
        "        assert main([name] if name.startswith('--') else [name, '--help']) == 0, name"
    )
    loaded = _modules_after(code)
    assert "retarget.cli.model_commands" in loaded  # the probe did build every command
    assert "torch" not in loaded


#: torch modules a one-process fp32 script never needs, together about 0.7 s to import: DCP
#: (which imports DTensor and FSDP), DTensor, FSDP.
HEAVY = ("torch.distributed.checkpoint", "torch.distributed.tensor", "torch.distributed.fsdp")


@pytest.mark.distributed  # starts a fresh interpreter
def test_the_accelerator_and_compile_for_load_no_checkpointing_or_dtensor():
    code = "import retarget\nretarget.Accelerator\nretarget.compile_for"
    loaded = _modules_after(code)
    assert "retarget.compat.accelerate.accelerator" in loaded  # the names were loaded
    assert "retarget.driver.compile" in loaded
    assert [m for m in HEAVY if m in loaded] == []


@pytest.mark.distributed  # starts a fresh interpreter
def test_a_name_read_from_retarget_is_the_library_object():
    code = (
        "import retarget\n"
        "from retarget.driver.compile import compile_for\n"
        "assert retarget.compile_for is compile_for\n"
        "assert 'compile_for' in dir(retarget)"
    )
    assert "retarget.driver.compile" in _modules_after(code)


def test_the_cli_choices_equal_the_library_constants():
    from retarget.passes.capture.capture_regions import MODES as CAPTURE_MODES
    from retarget.passes.place.device_map import MODES as DEVICE_MAP_MODES
    from retarget.report import render
    from retarget.report.memory_estimate import OPTIMIZERS

    assert choices.CAPTURE_MODES == tuple(CAPTURE_MODES)
    assert choices.FORMATS == tuple(render.FORMATS)
    assert choices.GRAPH_NODE_CAP == render.GRAPH_NODE_CAP
    assert choices.OPTIMIZERS == tuple(OPTIMIZERS)
    assert choices.DEVICE_MAP_MODES == tuple(DEVICE_MAP_MODES)
