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

    share = CoreShare.for_run("3f2a")
    with share.hold(alone=True):     # a distributed test
        ...
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
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

    @classmethod
    def for_run(cls, run_id: str) -> CoreShare:
        return cls(Path(tempfile.gettempdir()), run_id)

    def close(self) -> None:
        self.gate.close()
        self.room.close()

    @contextlib.contextmanager
    def hold(self, *, alone: bool) -> Iterator[None]:
        if alone:
            fcntl.flock(self.gate, fcntl.LOCK_EX)
            try:
                fcntl.flock(self.room, fcntl.LOCK_EX)
                os.environ[ALONE_ENV] = "1"
                try:
                    yield
                finally:
                    os.environ.pop(ALONE_ENV, None)
                    fcntl.flock(self.room, fcntl.LOCK_UN)
            finally:
                fcntl.flock(self.gate, fcntl.LOCK_UN)
            return
        fcntl.flock(self.gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.room, fcntl.LOCK_SH)
        finally:
            fcntl.flock(self.gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self.room, fcntl.LOCK_UN)
