"""Faults: a rank killed between two checkpoints, the job restarted by `retarget launch
--max_restarts`, resumed from the newest checkpoint, ends with the weights of an uninterrupted
run (bitwise), under ddp and fsdp on 2 gloo ranks."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "scripts" / "elastic_train.py"
STEPS, EVERY = 12, 4


def launch(folder: Path, target: str, kill_at: int, restarts: int, home: Path):
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [
            sys.executable, "-m", "retarget", "launch", "--num_processes", "2",
            "--target", target, "--max_restarts", str(restarts),
            str(SCRIPT), str(folder), str(STEPS), str(EVERY), str(kill_at),
        ],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize("target", ["ddp", "fsdp"])
def test_a_killed_rank_restarts_resumes_and_ends_bitwise_equal(target, tmp_path):
    straight = launch(tmp_path / "straight", target, kill_at=-1, restarts=0, home=tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    kill_at = random.Random(target).randrange(EVERY, STEPS - 1)  # between two checkpoints
    if (kill_at + 1) % EVERY == 0:
        kill_at -= 1
    killed = launch(tmp_path / "killed", target, kill_at=kill_at, restarts=1, home=tmp_path)
    assert killed.returncode == 0, killed.stderr[-3000:]
    attempt, start = (tmp_path / "killed" / "attempts.txt").read_text().split()
    assert attempt == "1"  # the run that finished is the restarted one
    assert int(start) == (kill_at + 1) // EVERY * EVERY  # it resumed from the newest checkpoint
    expected = load_file(tmp_path / "straight" / "final.safetensors")
    got = load_file(tmp_path / "killed" / "final.safetensors")
    assert expected.keys() == got.keys() and expected
    for key, value in expected.items():
        assert torch.equal(value, got[key]), key


def test_without_restarts_a_killed_rank_fails_the_job_naming_it(tmp_path):
    done = launch(tmp_path / "run", "ddp", kill_at=5, restarts=0, home=tmp_path)
    assert done.returncode != 0
    assert "rank 1" in done.stderr and "SIGKILL" in done.stderr
