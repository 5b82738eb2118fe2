"""`retarget config default` (as `accelerate config default`) and `retarget test` (as
`accelerate test`: a distributed sanity run of retarget/cli/sanity_script.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from retarget.cli import sanity_script
from retarget.cli.main import main
from retarget.compat.accelerate.accelerator import Accelerator
from retarget.core.world import TARGET_ENV
from retarget.launch.config import CONFIG_ENV, read_launch_config
from retarget.launch.questions import default_launch_config
from tests.paths import REPO


@pytest.fixture(autouse=True)
def _isolated_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    monkeypatch.delenv(TARGET_ENV, raising=False)


def test_config_default_is_config_dash_dash_default(capsys, tmp_path):
    path = tmp_path / "d.yaml"
    assert main(["config", "default", "--config_file", str(path)]) == 0
    assert read_launch_config(path) == default_launch_config()
    capsys.readouterr()
    assert main(["config", "default", "--config_file", str(path)]) == 2  # never overwrites
    assert "exists; --default does not overwrite" in capsys.readouterr().err


def test_config_refuses_another_word(capsys):
    assert main(["config", "defaults"]) == 2
    assert "invalid choice: 'defaults'" in capsys.readouterr().err


def test_the_checks_pass_in_a_world_of_one():
    accelerator = Accelerator()
    names = [
        check(accelerator)
        for check in (
            sanity_script.check_ranks,
            sanity_script.check_all_reduce,
            sanity_script.check_data_shard,
            sanity_script.check_training_step,
        )
    ]
    assert names == ["ranks", "all_reduce", "data shard", "training step"]


def retarget(*argv: str, home: Path) -> subprocess.CompletedProcess:
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "retarget", *argv],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=180,
    )  # fmt: skip


@pytest.mark.distributed
def test_retarget_test_runs_the_checks_on_2_processes_by_default(tmp_path):
    done = retarget("test", home=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == (
        "retarget test: 4 checks passed on 2 processes (target ddp): "
        "ranks, all_reduce, data shard, training step"
    )
    assert "on 2 processes" in done.stderr


@pytest.mark.distributed
def test_retarget_test_follows_the_config_file(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("num_processes: 3\ntarget: ddp\n")
    done = retarget("test", "--config_file", str(config), home=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "4 checks passed on 3 processes (target ddp)" in done.stdout
    bad = retarget("test", "--num_processes", "zero", home=tmp_path)
    assert bad.returncode == 2 and "--num_processes" in bad.stderr
