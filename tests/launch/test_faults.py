"""Faults: a rank killed between two checkpoints, the job restarted by `retarget launch
--max_restarts`, resumed from the newest checkpoint, ends with the weights of an uninterrupted
run (bitwise), under ddp and fsdp on 2 gloo ranks. Preemption: SIGTERM or SIGUSR1 to the
launcher makes every rank save after the current step and the job exit 0; the next launch
resumes bitwise."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from retarget.launch.signals import children
from tests.paths import REPO

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


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The final weights of an uninterrupted STEPS-step run per target, launched once for the
    tests of this file that compare against it."""
    runs: dict[str, dict[str, torch.Tensor]] = {}

    def weights(target: str) -> dict[str, torch.Tensor]:
        if target not in runs:
            folder = tmp_path_factory.mktemp("straight")
            done = launch(folder / "run", target, kill_at=-1, restarts=0, home=folder)
            assert done.returncode == 0, done.stderr[-3000:]
            runs[target] = load_file(folder / "run" / "final.safetensors")
        return runs[target]

    return weights


@pytest.mark.distributed
@pytest.mark.parametrize("target", ["ddp", "fsdp"])
def test_a_killed_rank_restarts_resumes_and_ends_bitwise_equal(target, straight, tmp_path):
    kill_at = random.Random(target).randrange(EVERY, STEPS - 1)  # between two checkpoints
    if (kill_at + 1) % EVERY == 0:
        kill_at -= 1
    killed = launch(tmp_path / "killed", target, kill_at=kill_at, restarts=1, home=tmp_path)
    assert killed.returncode == 0, killed.stderr[-3000:]
    attempt, start = (tmp_path / "killed" / "attempts.txt").read_text().split()
    assert attempt == "1"  # the first restart finished the run
    assert int(start) == (kill_at + 1) // EVERY * EVERY  # it resumed from the newest checkpoint
    expected = straight(target)
    got = load_file(tmp_path / "killed" / "final.safetensors")
    assert expected.keys() == got.keys() and expected
    for key, value in expected.items():
        assert torch.equal(value, got[key]), key


@pytest.mark.distributed
def test_without_restarts_a_killed_rank_fails_the_job_naming_it(tmp_path):
    done = launch(tmp_path / "run", "ddp", kill_at=5, restarts=0, home=tmp_path)
    assert done.returncode != 0
    assert "rank 1" in done.stderr and "SIGKILL" in done.stderr


def launch_until(
    folder: Path, target: str, signum: int, after_step: int, home: Path, to: str = "launcher"
):
    """Launch a preemptible run, send `signum` to the launcher (or to the rank-1 process, with
    to="rank") once a rank printed STEP `after_step`; returns (exit code, seconds from the
    signal to the exit, output)."""
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "PREEMPTIBLE": "1"}
    command = [
        sys.executable, "-m", "retarget", "launch", "--num_processes", "2", "--target", target,
        str(SCRIPT), str(folder), "200", "1000", "-1",
    ]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env
    )
    lines = []
    for line in process.stdout:
        lines.append(line)
        # Both ranks print to one pipe: their lines can run together ("STEP 3STEP 3").
        if any(int(n) >= after_step for n in re.findall(r"STEP (\d+)", line)):
            break
    signalled = time.monotonic()
    if to == "launcher":
        process.send_signal(signum)
    else:  # one of the ranks: the launcher's children
        os.kill(sorted(children(process.pid))[-1], signum)
    lines += process.stdout.readlines()
    code = process.wait(timeout=120)
    return code, time.monotonic() - signalled, "".join(lines)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("signum", "to"),
    [(signal.SIGTERM, "launcher"), (signal.SIGUSR1, "launcher"), (signal.SIGTERM, "rank")],
)
def test_preemption_saves_on_every_rank_exits_0_and_resumes_bitwise(signum, to, straight, tmp_path):
    folder = tmp_path / "run"
    code, seconds, output = launch_until(folder, "ddp", signum, 3, home=tmp_path, to=to)
    assert code == 0, output[-3000:]
    assert seconds < 35, f"took {seconds:.1f} s to stop"  # torchrun's grace is 30 s
    assert (folder / "checkpoints").is_dir(), output[-3000:]
    saved = sorted((folder / "checkpoints").iterdir())
    assert len(saved) == 1 and not (folder / "final.safetensors").exists()
    # The next launch resumes where the preempted one stopped and finishes.
    resumed = subprocess.run(
        [
            sys.executable, "-m", "retarget", "launch", "--num_processes", "2", "--target",
            "ddp", str(SCRIPT), str(folder), str(STEPS), "1000", "-1",
        ],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    start = int((folder / "attempts.txt").read_text().split()[1])
    assert 3 <= start < 12
    expected = straight("ddp")  # resume ran STEPS steps, as the straight run did
    got = load_file(folder / "final.safetensors")
    assert expected.keys() == got.keys() and expected
    assert all(torch.equal(value, got[key]) for key, value in expected.items())


@pytest.mark.distributed
def test_a_rank_stuck_outside_a_collective_is_named_after_the_timeout(tmp_path):
    env = {
        "HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO),
        "HANG_AT": "2", "RETARGET_TIMEOUT_S": "5",
    }  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable, "-m", "retarget", "launch", "--num_processes", "2", "--target", "ddp",
            str(SCRIPT), str(tmp_path / "run"), "12", "100", "-1",
        ],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=240,
    )  # fmt: skip
    assert done.returncode != 0
    assert time.monotonic() - started < 120  # the timeout, not the 30-minute default
    assert "rank 1 stopped making progress: it was at" in done.stderr, done.stderr[-3000:]
    assert "elastic_train.py" in done.stderr and "outside any collective" in done.stderr
    assert "rank 0 waited inside torch" in done.stderr


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def two_machines(folder: Path, target: str, processes: int, backend: str, home: Path) -> list:
    """Two `retarget launch` invocations on this machine, as machine 0 and machine 1."""
    port = str(_free_port())
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    launchers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "retarget",
                "launch",
                "--num_machines",
                "2",
                "--machine_rank",
                str(rank),
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                port,
                "--rdzv_backend",
                backend,
                "--num_processes",
                str(processes),
                "--target",
                target,
                str(SCRIPT),
                str(folder),
                "6",
                "1000",
                "-1",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    return [(p.wait(timeout=300), p.stderr.read()) for p in launchers]


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory):
    """The final weights of a 6-step run on one machine per (target, processes), launched once
    for the rendezvous backends compared against it."""
    runs: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

    def weights(target: str, processes: int) -> dict[str, torch.Tensor]:
        if (target, processes) not in runs:
            folder = tmp_path_factory.mktemp("one")
            env = {"HOME": str(folder), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
            one = subprocess.run(
                [
                    sys.executable, "-m", "retarget", "launch", "--num_processes",
                    str(processes), "--target", target, str(SCRIPT), str(folder / "run"), "6",
                    "1000", "-1",
                ],
                capture_output=True, text=True, cwd=REPO, env=env, timeout=300,
            )  # fmt: skip
            assert one.returncode == 0, one.stderr[-3000:]
            runs[target, processes] = load_file(folder / "run" / "final.safetensors")
        return runs[target, processes]

    return weights


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("target", "processes", "backend"),
    [("ddp", 2, "static"), ("ddp", 2, "c10d"), ("hsdp[replicate=2,shard=2]", 4, "c10d")],
)
def test_two_machines_on_one_host_train_like_one_machine(
    target, processes, backend, one_machine, tmp_path
):
    results = two_machines(tmp_path / "two", target, processes, backend, tmp_path)
    assert all(code == 0 for code, _ in results), [err[-2000:] for _, err in results]
    expected = one_machine(target, processes)
    got = load_file(tmp_path / "two" / "final.safetensors")
    assert expected.keys() == got.keys() and expected
    assert all(torch.equal(value, got[key]) for key, value in expected.items())
