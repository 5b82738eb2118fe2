"""Two pytest-xdist workers on two cores: in-process tests side by side, distributed ones alone.

The README's test command runs the suite in two xdist workers. An in-process test uses one core,
so two of them run at once; a test marked `distributed` starts ranks that already use both cores
(gloo ranks, `retarget launch`, scripts), and beside a second test its ranks would share the
cores three ways, run slower than their own timeouts allow, and slow the other test too. So
every test holds one lock around its whole run (setup, call, teardown): in-process tests hold it
shared, distributed tests hold it alone. A distributed test also marked `one_process` (its
processes run one at a time, each one compute process: a script in one process, a CLI command, a
pytest of its own) uses one core as an in-process test does: it holds the lock shared, and the
processes it starts get one intra-op thread (tests/conftest.py sets OMP_NUM_THREADS=1 for it).

A waiting distributed test must not starve behind a stream of in-process tests on the other
worker, so the lock is two files (a gate and a room): a shared holder passes the gate and
releases it at once, an exclusive holder keeps the gate closed while it waits for the room to
empty and while it runs. Both files are per test run (xdist's run id), in the temp folder, and
`flock` locks die with their process, so a killed worker never leaves a lock behind.

A worker whose next test runs alone too keeps the lock between the two (`keep=True`): released,
the other worker would pass the gate and start a test of its own, and the next distributed test
would wait for it with its own core idle (the suite's distributed tests come in runs of
consecutive ones in a file: 172 tests, 61 runs).

    share = CoreShare.for_run("3f2a")
    with share.hold(alone=True):     # a distributed test
        ...
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

#: Set in each worker (and so in what its tests start): the suite runs in two workers.
SHARED_CORES_ENV = "RETARGET_TEST_SHARED_CORES"
#: Set while a test holds the lock alone (tests/distributed.py refuses to start ranks without it
#: under xdist: an unmarked test starting ranks would run beside another test).
ALONE_ENV = "RETARGET_TEST_ALONE"


class CoreShare:
    """The shared/exclusive lock of one test run (see the module docstring)."""

    def __init__(self, folder: Path, run_id: str) -> None:
        self.gate = open(folder / f"retarget-tests-{run_id}.gate", "a+")  # noqa: SIM115
        self.room = open(folder / f"retarget-tests-{run_id}.room", "a+")  # noqa: SIM115
        #: This holder kept the lock alone after its last test (`hold(..., keep=True)`).
        self.kept = False
        #: Seconds spent waiting for the lock, alone and shared (what the run's report prints).
        self.waited = {True: 0.0, False: 0.0}

    @classmethod
    def for_run(cls, run_id: str) -> CoreShare:
        return cls(Path(tempfile.gettempdir()), run_id)

    def close(self) -> None:
        self._release_alone()
        self.gate.close()
        self.room.close()

    @contextlib.contextmanager
    def hold(self, *, alone: bool, keep: bool = False) -> Iterator[None]:
        """Hold the lock around one test; `keep`: an alone holder keeps it afterwards (its next
        test runs alone too) and its next `hold` takes it up without waiting."""
        started = time.monotonic()
        if alone:
            if not self.kept:
                fcntl.flock(self.gate, fcntl.LOCK_EX)
                try:
                    fcntl.flock(self.room, fcntl.LOCK_EX)
                except BaseException:
                    fcntl.flock(self.gate, fcntl.LOCK_UN)
                    raise
            self.kept = False
            self.waited[True] += time.monotonic() - started
            os.environ[ALONE_ENV] = "1"
            try:
                yield
            finally:
                os.environ.pop(ALONE_ENV, None)
                if keep:
                    self.kept = True
                else:
                    self._release_alone(held=True)
            return
        self._release_alone()
        fcntl.flock(self.gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.room, fcntl.LOCK_SH)
        finally:
            fcntl.flock(self.gate, fcntl.LOCK_UN)
        self.waited[False] += time.monotonic() - started
        try:
            yield
        finally:
            fcntl.flock(self.room, fcntl.LOCK_UN)

    def _release_alone(self, held: bool = False) -> None:
        """Give up the lock held alone (kept from the last test, or `held` by the one ending)."""
        if held or self.kept:
            fcntl.flock(self.room, fcntl.LOCK_UN)
            fcntl.flock(self.gate, fcntl.LOCK_UN)
        self.kept = False
