"""tests/distributed.py's pooled worlds: a case sees what a freshly spawned rank sees, whatever
the cases before it did, and a failed case never leaves its world to the next one."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from tests import distributed
from tests.distributed import run_ranks


def _warn() -> None:
    warnings.warn("shown once per location", UserWarning, stacklevel=1)


def _view(rank: int, world: int) -> dict:
    """What a case starts with."""
    import torch.distributed as dist

    from retarget.execution.process import ProcessState

    caught = []
    shown, warnings.showwarning = warnings.showwarning, lambda *a, **k: caught.append(a[0])
    try:
        _warn()  # shown unless an earlier case showed it (the registry of this location)
    finally:
        warnings.showwarning = shown
    state = ProcessState.current()
    return {
        "rank": (state.rank, state.world_size, os.environ["RANK"], os.environ["WORLD_SIZE"]),
        "group": dist.get_world_size(),
        "left_behind": os.environ.get("LEFT_BEHIND"),
        "sent": os.environ.get("SENT_BY_THE_TEST"),
        "cwd": os.getcwd(),
        "first_random": torch.rand(3).tolist(),
        "threads": torch.get_num_threads(),
        "dtype": str(torch.get_default_dtype()),
        "warned": len(caught),
    }


def _mess(rank: int, world: int) -> None:
    """Everything a case could leave behind."""
    import torch.distributed as dist

    from retarget.execution.process import ProcessState

    ProcessState.current()
    dist.new_group([0, 1])
    os.environ["LEFT_BEHIND"] = "yes"
    os.chdir("/")
    torch.rand(100)
    torch.set_num_threads(2)
    torch.set_default_dtype(torch.float64)
    _warn()


@pytest.mark.distributed
def test_a_pooled_case_starts_as_a_fresh_rank_whatever_came_before(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SENT_BY_THE_TEST", "1")
    fresh = run_ranks(_view, 2, fresh=True)
    run_ranks(_mess, 2)
    world = distributed._worlds[2]
    pooled = run_ranks(_view, 2)
    assert distributed._worlds[2] is world  # the same processes served both cases
    # Generators newly seeded from the OS, as in a new interpreter: no two ranks draw alike.
    draws = [tuple(v.pop("first_random")) for v in (*fresh, *pooled)]
    assert len(set(draws)) == 4
    assert pooled == fresh
    assert fresh[0]["sent"] == "1" and fresh[0]["cwd"] == str(tmp_path)
    assert fresh[0]["left_behind"] is None and fresh[0]["warned"] == 1
    assert [v["rank"] for v in pooled] == [(0, 2, "0", "2"), (1, 2, "1", "2")]


def _fail_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one fails")
    import torch.distributed as dist

    from retarget.execution.process import ProcessState

    ProcessState.current()
    dist.barrier()  # left waiting for a peer that will not come
    return rank


@pytest.mark.distributed
def test_a_failed_case_fails_the_test_and_the_next_case_gets_a_new_world():
    run_ranks(_view, 2)
    before = distributed._worlds[2]
    with pytest.raises(AssertionError, match="rank 1 failed:(.|\n)*rank one fails"):
        run_ranks(_fail_on_rank_one, 2)
    assert 2 not in distributed._worlds and not any(p.is_alive() for p in before.procs)
    assert [v["rank"][0] for v in run_ranks(_view, 2)] == [0, 1]
    assert distributed._worlds[2] is not before


def _accelerate_ddp(rank: int, world: int) -> int:
    """Accelerate's own Accelerator, as a script makes it: its state singletons are set here."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    return accelerator.num_processes + isinstance(model, torch.nn.parallel.DistributedDataParallel)


@pytest.mark.distributed
def test_accelerates_singletons_of_a_case_do_not_reach_the_next_case():
    """Accelerate's state singletons remember a distributed state whose group the case's end
    destroyed: without their clearing the second case fails ("Default process group has not
    been initialized")."""
    for _ in range(2):
        assert run_ranks(_accelerate_ddp, 2) == [3, 3]


def _pid(rank: int, world: int) -> int:
    return os.getpid()


#: A test process that leaves as an xdist worker does (os._exit: no atexit handler runs).
LEAVES_ABRUPTLY = """
import os, sys
sys.path.insert(0, sys.argv[1])
from tests.distributed import run_ranks
from tests.test_distributed import _pid
print(*run_ranks(_pid, 2), flush=True)
os._exit(0)
"""


@pytest.mark.distributed
def test_a_pooled_world_ends_when_its_test_process_is_gone(tmp_path):
    """The ranks notice their test process is gone and exit: without it, a worker's pooled
    ranks outlived the run, one interpreter with torch loaded each."""
    import subprocess
    import sys
    import time

    from tests.paths import REPO

    done = subprocess.run(
        [sys.executable, "-c", LEAVES_ABRUPTLY, str(REPO)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    deadline = time.monotonic() + 60
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(alive(p) for p in pids), pids


def _server_environment(rank: int, world: int) -> bool:
    """Whether the fork server this rank came from (its parent) has SET_BY_THE_FIRST_TEST."""
    with open(f"/proc/{os.getppid()}/environ", "rb") as server:
        return b"SET_BY_THE_FIRST_TEST=" in server.read()


STARTS_THE_FIRST_WORLD = """
import os, sys
sys.path.insert(0, sys.argv[1])
from tests.distributed import close_worlds, run_ranks
from tests.test_distributed import _server_environment, _view
os.environ["SET_BY_THE_FIRST_TEST"] = "1"
print(*run_ranks(_server_environment, 2))
print(*[v["sent"] for v in run_ranks(_view, 2)])
close_worlds()
"""


@pytest.mark.distributed
def test_the_fork_server_starts_in_the_environment_of_collection_not_of_a_test(tmp_path):
    """A variable set by the test that starts the first world reaches that test's cases (each
    case gets the sender's environment) but not the fork server, whose imports would read it
    and whose later worlds would keep it."""
    import subprocess
    import sys

    from tests.paths import REPO

    env = {**os.environ, "SENT_BY_THE_TEST": "yes"}
    done = subprocess.run(
        [sys.executable, "-c", STARTS_THE_FIRST_WORLD, str(REPO)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    in_server, sent = done.stdout.splitlines()[-2:]
    assert in_server == "False False"
    assert sent == "yes yes"
