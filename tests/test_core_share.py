"""The suite's lock between its two xdist workers: in-process tests together, distributed alone
(a `one_process` distributed test together with the in-process ones, its processes on one thread).

Each CoreShare below is its own pair of open files, as each worker's is, so flock treats them
as different holders even in one process (threads stand in for the workers).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time

import pytest

from tests.core_share import ALONE_ENV, SHARED_CORES_ENV, CoreShare
from tests.distributed import run_ranks


def _thread(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def _wait_until_held(path: str, timeout: float = 60) -> None:
    """Until some holder has `path` locked (a non-blocking lock of our own fails)."""
    deadline = time.monotonic() + timeout
    with open(path, "a+") as probe:
        while time.monotonic() < deadline:
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            fcntl.flock(probe, fcntl.LOCK_UN)
            time.sleep(0.01)
    raise AssertionError(f"nobody took {path} in {timeout} s")


def test_shared_holders_run_together(tmp_path):
    first, second = CoreShare(tmp_path, "run"), CoreShare(tmp_path, "run")
    inside = threading.Barrier(2, timeout=10)  # both must be inside at once to pass it

    def hold(share):
        with share.hold(alone=False):
            inside.wait()

    threads = [_thread(lambda s=s: hold(s)) for s in (first, second)]
    for thread in threads:
        thread.join(timeout=20)
    assert not inside.broken and not any(t.is_alive() for t in threads)


def test_an_alone_holder_waits_for_the_shared_ones_and_goes_before_later_ones(tmp_path):
    shared, alone, late = (CoreShare(tmp_path, "run") for _ in range(3))
    events: list[str] = []
    first_inside = threading.Event()

    def first():
        with shared.hold(alone=False):
            first_inside.set()
            time.sleep(0.4)
            events.append("shared ends")

    def exclusive():
        with alone.hold(alone=True):
            events.append("alone starts")
            time.sleep(0.3)
            events.append("alone ends")

    def later():
        with late.hold(alone=False):
            events.append("later shared starts")

    threads = [_thread(first)]
    assert first_inside.wait(10)
    threads.append(_thread(exclusive))
    _wait_until_held(alone.gate.name)  # the alone holder is waiting in the gate now
    threads.append(_thread(later))
    for thread in threads:
        thread.join(timeout=20)
    assert events == ["shared ends", "alone starts", "alone ends", "later shared starts"]


def test_the_alone_holder_is_marked_in_the_environment(tmp_path):
    share = CoreShare(tmp_path, "run")
    with share.hold(alone=True):
        assert ALONE_ENV in os.environ
    assert ALONE_ENV not in os.environ


def test_an_alone_holder_keeps_the_lock_into_its_next_alone_test(tmp_path):
    """Kept between two tests run alone, the lock lets no shared holder in between them; the
    next test takes it up at once, and a hold without `keep` gives it back."""
    alone, shared = CoreShare(tmp_path, "run"), CoreShare(tmp_path, "run")
    events: list[str] = []
    with alone.hold(alone=True, keep=True):
        events.append("first alone test")

    def other():
        with shared.hold(alone=False):
            events.append("shared test")

    thread = _thread(other)
    _wait_until_held(alone.gate.name)
    time.sleep(0.3)  # time enough for the shared holder to pass, were the lock free
    with alone.hold(alone=True):
        events.append("second alone test")
    thread.join(timeout=20)
    assert events == ["first alone test", "second alone test", "shared test"]
    assert not thread.is_alive() and not alone.kept


def test_a_kept_lock_is_given_back_before_a_shared_test_of_its_own(tmp_path):
    """A kept lock ends with the next test that runs beside the other worker's: a later test run
    alone waits for the room to empty again, as a first one would."""
    share, other = CoreShare(tmp_path, "run"), CoreShare(tmp_path, "run")
    events: list[str] = []
    with share.hold(alone=True, keep=True):
        pass
    with share.hold(alone=False):
        pass
    inside, leave = threading.Event(), threading.Event()

    def beside():
        with other.hold(alone=False):
            inside.set()
            leave.wait(10)
            events.append("other's shared test ends")

    thread = _thread(beside)
    assert inside.wait(10)
    threading.Timer(0.3, leave.set).start()
    with share.hold(alone=True):
        events.append("alone test")
    thread.join(timeout=20)
    assert events == ["other's shared test ends", "alone test"]


def _rank(rank, world):
    return rank


@pytest.mark.distributed  # run_ranks refuses before it starts any rank
def test_ranks_are_refused_in_a_test_not_marked_distributed_under_xdist(monkeypatch):
    monkeypatch.setenv(SHARED_CORES_ENV, "1")
    monkeypatch.delenv(ALONE_ENV, raising=False)
    with pytest.raises(AssertionError, match="mark it @pytest.mark.distributed"):
        run_ranks(_rank, 2)


@pytest.mark.distributed  # starts an interpreter,
@pytest.mark.one_process  # one
def test_a_one_process_test_holds_the_lock_shared_and_its_processes_take_one_thread():
    if not os.environ.get(SHARED_CORES_ENV):
        pytest.skip("the lock exists under the suite's xdist workers (the README's command)")
    assert ALONE_ENV not in os.environ  # beside the other worker's tests, not alone
    done = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.stdout.strip() == "1", done.stderr[-2000:]
