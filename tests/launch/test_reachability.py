"""Launch faults around the network and the first moments of a run, each one line naming the
thing, in seconds: a port already in use, a main machine that does not answer or whose name does
not resolve, a rank that crashes before the first collective."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from retarget.launch.config import LaunchError
from retarget.launch.reachability import check_port_free, wait_for_main
from tests.distributed import free_port
from tests.paths import REPO


def _launch(tmp_path: Path, *argv: str, script: str) -> tuple[subprocess.CompletedProcess, float]:
    path = tmp_path / "train.py"
    path.write_text(script)
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "retarget", "launch", *argv, str(path)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=180,
    )  # fmt: skip
    return done, time.monotonic() - started


ALL_REDUCE = """
import torch, torch.distributed as dist
from retarget.execution.process import ProcessState
from tests.paths import REPO
ProcessState.current()
dist.all_reduce(torch.ones(1))
print("all_reduce done", flush=True)
"""


def _listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("", 0))
    sock.listen(1)
    return sock


@pytest.mark.distributed
def test_a_port_in_use_is_refused_before_anything_starts(tmp_path):
    with _listening() as held:
        port = str(held.getsockname()[1])
        done, seconds = _launch(
            tmp_path, "--num_processes", "2", "--main_process_port", port, script=ALL_REDUCE
        )
    assert done.returncode == 2 and seconds < 30
    assert f"--main_process_port {port} is already in use on this machine" in done.stderr
    assert "Traceback" not in done.stderr and "all_reduce done" not in done.stdout


@pytest.mark.distributed
def test_a_main_machine_that_does_not_answer_times_out_naming_the_address(tmp_path):
    port = str(free_port())
    done, seconds = _launch(
        tmp_path,
        *("--num_machines", "2", "--machine_rank", "1", "--num_processes", "2"),
        *("--main_process_ip", "127.0.0.1", "--main_process_port", port, "--join_timeout", "3"),
        script=ALL_REDUCE,
    )
    assert done.returncode == 1 and 3 <= seconds < 30, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"retarget launch: the main machine at 127.0.0.1:{port}"), last
    assert "did not answer within 3 s" in last and "Traceback" not in done.stderr


@pytest.mark.distributed
def test_a_main_machine_name_that_does_not_resolve_fails_at_once(tmp_path):
    done, seconds = _launch(
        tmp_path,
        *("--num_machines", "2", "--machine_rank", "1", "--num_processes", "2"),
        *("--main_process_ip", "no-such-host.invalid"),
        script=ALL_REDUCE,
    )
    assert done.returncode == 1 and seconds < 30
    assert "'no-such-host.invalid' does not resolve to an address" in done.stderr


@pytest.mark.distributed
def test_a_rank_that_crashes_before_the_first_collective_ends_the_job_naming_it(tmp_path):
    script = "import os\nif os.environ['RANK'] == '1':\n    raise OSError('no data on rank 1')\n"
    done, seconds = _launch(tmp_path, "--num_processes", "2", script=script + ALL_REDUCE)
    assert done.returncode == 1 and seconds < 60
    lines = done.stderr.strip().splitlines()
    assert lines[-2] == "retarget launch: rank 1 failed: OSError: no data on rank 1", lines[-2:]
    assert lines[-1].startswith("retarget launch: rank 0 stopped after it")
    assert "all_reduce done" not in done.stdout


def test_wait_for_main_waits_until_the_main_machine_starts_listening():
    port = free_port()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def start_later() -> None:
        time.sleep(1.5)
        server.bind(("127.0.0.1", port))
        server.listen(1)

    starter = threading.Thread(target=start_later)
    starter.start()
    try:
        waited = wait_for_main("127.0.0.1", port, 20, "main_process_ip")
    finally:
        starter.join()
        server.close()
    assert 1.0 <= waited < 10


def test_check_port_free_takes_a_free_port_and_names_a_held_one():
    check_port_free(free_port(), "--main_process_port")
    with _listening() as held:
        port = held.getsockname()[1]
        with pytest.raises(LaunchError, match=f"^--main_process_port {port} is already in use"):
            check_port_free(port, "--main_process_port")
