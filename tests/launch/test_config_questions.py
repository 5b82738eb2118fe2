"""`retarget config` (retarget/launch/questions.py): questions answered on stdin,
bad answers asked again, --default, and the file `retarget launch` then reads."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from retarget.cli.main import main
from retarget.launch.config import CONFIG_ENV, read_launch_config
from retarget.launch.questions import default_launch_config
from retarget.targets.grammar import Target


@pytest.fixture(autouse=True)
def _isolated_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(CONFIG_ENV, raising=False)


def answer(monkeypatch, capsys, lines: list[str], *argv: str) -> tuple[int, str, str]:
    """Run `retarget config ARGV` with `lines` on stdin (what a user types, Enter after each)."""
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{line}\n" for line in lines)))
    code = main(["config", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_answers_are_written_to_the_default_location(monkeypatch, capsys):
    # machines (Enter = 1), processes, target, precision
    code, out, _ = answer(monkeypatch, capsys, ["", "2", "fsdp+ac", "bf16"])
    path = Path.home() / ".cache" / "retarget" / "default_config.yaml"
    assert code == 0 and f"wrote {path}" in out
    assert "How many machines take part? [1]" in out
    config = read_launch_config(path)
    assert config.settings() == {
        "target": Target.parse("fsdp+ac"),
        "num_processes": 2,
        "num_machines": 1,
        "mixed_precision": "bf16",
    }


def test_bad_answers_are_explained_and_asked_again(monkeypatch, capsys, tmp_path):
    path = tmp_path / "c.yaml"
    lines = ["0", "1", "many", "2", "single", "fsdpp", "ddp", "fp32", "ddp", ""]
    code, out, _ = answer(monkeypatch, capsys, lines, "--config_file", str(path))
    assert code == 0
    assert "num_machines: must be at least 1, got 0" in out
    assert "num_processes: expected an integer at least 1, got 'many'" in out
    assert "'single' has no distribution part" in out  # checked against 2 processes
    assert "did you mean 'fsdp'?" in out
    assert "'fp32' is not one of no, bf16, fp16, fp8" in out
    assert "'ddp' is not one of" in out
    assert read_launch_config(path).settings() == {
        "target": Target.parse("ddp"),
        "num_processes": 2,
        "num_machines": 1,
        "mixed_precision": "no",  # Enter: the target states no precision
    }


def test_several_machines_ask_for_rank_address_and_port(monkeypatch, capsys, tmp_path):
    path = tmp_path / "multi.yaml"
    lines = ["2", "1", "", "10.0.0.1", "", "4", "ddp+bf16", ""]
    code, out, _ = answer(monkeypatch, capsys, lines, "--config-file", str(path))
    assert code == 0 and "an answer is needed" in out  # the address has no default
    assert read_launch_config(path).settings() == {
        "target": Target.parse("ddp+bf16"),
        "num_processes": 4,
        "num_machines": 2,
        "machine_rank": 1,
        "main_process_ip": "10.0.0.1",
        "main_process_port": 29500,
        "mixed_precision": "bf16",  # the default follows the target's precision
    }


def test_end_of_input_is_a_one_line_error_and_nothing_is_written(monkeypatch, capsys, tmp_path):
    path = tmp_path / "c.yaml"
    code, _, err = answer(monkeypatch, capsys, ["1"], "--config_file", str(path))
    assert code == 2
    assert err.strip().count("\n") == 0
    assert "retarget config: error: no answer to" in err and "--default" in err
    assert not path.exists()


def test_default_writes_this_machine_and_never_overwrites(monkeypatch, capsys, tmp_path):
    path = tmp_path / "d.yaml"
    assert main(["config", "--default", "--config_file", str(path)]) == 0
    expected = default_launch_config()
    assert read_launch_config(path) == expected
    if not torch.cuda.is_available():  # CPU only: one process using every core
        assert (str(expected.target), expected.num_processes) == ("single", 1)
    before = path.read_text()
    capsys.readouterr()
    assert main(["config", "--default", "--config_file", str(path)]) == 2
    assert "exists; --default does not overwrite" in capsys.readouterr().err
    assert path.read_text() == before


def test_default_goes_to_retarget_config_when_set(monkeypatch, tmp_path):
    named = tmp_path / "named" / "c.yaml"
    monkeypatch.setenv(CONFIG_ENV, str(named))
    assert main(["config", "--default"]) == 0
    assert read_launch_config(named) == default_launch_config()
