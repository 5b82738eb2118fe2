"""`retarget env` (retarget/launch/env.py): versions, devices, backends and the config in
effect, as a Markdown list; a broken config is shown with its error, never fails the report."""

from __future__ import annotations

import importlib.util
import os
import platform
from importlib import metadata
from pathlib import Path

import pytest
import torch

import retarget
from retarget.cli.main import main
from retarget.launch.config import CONFIG_ENV


@pytest.fixture(autouse=True)
def _isolated_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    monkeypatch.delenv("RETARGET_TARGET", raising=False)


def report(capsys, *argv: str) -> dict[str, str]:
    """`retarget env ARGV` as {key: value} for its "- key: value" lines (and the raw text)."""
    assert main(["env", *argv]) == 0
    out = capsys.readouterr().out
    items = dict(line[2:].split(": ", 1) for line in out.splitlines() if line.startswith("- "))
    return {**items, "_text": out}


def test_versions_platform_and_devices(capsys):
    items = report(capsys)
    assert items["_text"].startswith("Copy and paste the text below into your bug report.")
    assert items["retarget"] == retarget.__version__
    assert items["Python"].startswith(platform.python_version())
    assert items["torch"].startswith(torch.__version__)
    assert items["transformers"] == metadata.version("transformers")
    assert items["torchao"] == metadata.version("torchao")
    for optional in ("transformer_engine", "msamp"):
        assert optional in items  # a version or "not installed", never missing
    assert items["CPUs"].split()[0] == str(os.cpu_count())
    # tests/execution/test_xla.py checks the device line
    if importlib.util.find_spec("torch_xla") is None:
        assert items["torch-xla"] == "not installed" and "XLA devices" not in items
    assert items["CUDA available"].startswith("yes" if torch.cuda.is_available() else "no")
    if not torch.cuda.is_available():
        assert items["GPUs"] == "none"
    assert "gloo" in items["distributed backends"].split(", ")
    assert (items["RETARGET_TARGET"], items["launch config"]) == ("not set", "none")


def test_config_in_effect_is_shown_with_its_contents(capsys, monkeypatch):
    default = Path.home() / ".cache" / "retarget" / "default_config.yaml"
    default.parent.mkdir(parents=True)
    default.write_text("target: fsdp\nnum_processes: 2\n")
    monkeypatch.setenv("RETARGET_TARGET", "ddp")
    items = report(capsys)
    assert items["launch config"] == str(default)
    assert "    target: fsdp\n    num_processes: 2\n" in items["_text"]
    assert items["RETARGET_TARGET"] == "ddp"


def test_a_broken_config_is_reported_not_raised(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_process: 2\n")
    items = report(capsys, "--config_file", str(bad))
    assert items["launch config"] == str(bad)
    assert "(invalid: " in items["_text"] and "did you mean 'num_processes'?" in items["_text"]
    missing = report(capsys, "--config_file", str(tmp_path / "nope.yaml"))
    assert missing["launch config"].startswith("invalid: --config_file")
