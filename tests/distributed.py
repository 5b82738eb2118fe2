"""Run a test function on N real processes over gloo, as torchrun would, and collect results.

    def _body(rank, world_size, scale):            # module level: spawned processes import it
        state = ProcessState.current()             # reads the torchrun-style environment
        return state.rank * scale

    def test_ranks():
        assert run_ranks(_body, 2, 10) == [0, 10]

The ranks are a world of processes kept for the whole pytest process, one world per rank count:
starting an interpreter and importing torch and transformers costs ~3-6 s a rank, more than most
cases, so a world serves every case of its size. Its ranks are forked from multiprocessing's fork
server, a clean interpreter started once per pytest process that has imported torch, transformers
and retarget's compile_for (`PRELOADED`): a 4-rank world then starts in ~1 s, not ~18 s (measured on
2 cores, each rank importing a pp test module), and a world that a failed case ended comes back as
cheaply. The fork server has started no thread and run no parallel region, so its children start as
clean as a spawned interpreter, with those modules loaded. Each case starts as a fresh rank would:
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (a free port per
case, so the case's process group is its own), the test process's environment and working folder as
they are when the case is sent (as a spawned child inherits them), the warning filters as the
interpreter had them at its start, torch's, Python's and NumPy's generators newly seeded from the OS
(as a new interpreter seeds them: no two ranks or cases draw alike unless the case seeds them), one
intra-op thread, the default dtype float32, no cached ProcessState; at its end the process group is
destroyed and dynamo's caches are reset. `fresh=True` runs a case in new `spawn`ed interpreters
instead, for what lasts a process's life (torch_xla's SPMD switch, counting every object alive, a
process's whole memory).

A rank that raises fails the test with that rank's traceback; a run that exceeds `timeout` fails it
too; a rank killed by a signal (a segmentation fault) fails it at once, and its threads' Python
stacks are in the test's captured stderr (faulthandler). Either way the world's processes are killed
and the next case gets a new world (a peer may be stuck in a collective), so a hang never stalls the
suite and no broken state carries on. `timeout` bounds a hang, not the work: on a loaded 2-core
machine a case takes several times what it takes alone, so the defaults are generous (a dead rank is
noticed at once by its exit code, whatever the timeout).
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import random
import socket
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

from tests.core_share import ALONE_ENV, SHARED_CORES_ENV

#: What the fork server of the pooled worlds imports before it forks a rank (module docstring).
PRELOADED = ["torch", "torch.distributed", "transformers", "retarget.driver.compile"]
#: The environment the fork server starts in: this process's when this module was imported
#: (at collection), not whatever the test that happens to start the first world has set, which
#: the server's imports would read and every later world's ranks keep.
_SERVER_ENVIRONMENT = dict(os.environ)

#: run_ranks' default bound on a case, and the process group's bound on one collective wait.
DEFAULT_TIMEOUT_S = 900.0
COLLECTIVE_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for one rank on one machine."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        # The process group's own bound on a wait for a peer: a stuck peer fails the case
        # before run_ranks' timeout, never because one rank is slow on a loaded machine.
        "RETARGET_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S),
    }


class _FreshState:
    """What a rank's interpreter held at its start, put back before every case."""

    def __init__(self) -> None:
        self.filters = list(warnings.filters)

    def enter(self, rank: int, world: int, port: int, environ: dict, cwd: str) -> None:
        import numpy
        import torch

        from retarget.execution.process import ProcessState

        os.environ.clear()
        os.environ.update(environ)
        os.environ.update(rank_env(rank, world, port))
        os.chdir(cwd)
        warnings.filters[:] = self.filters
        warnings._filters_mutated()  # forget which warnings were shown already
        # A new interpreter seeds its generators from the OS: so does every case.
        torch.seed()
        random.seed()
        numpy.random.seed()
        torch.set_num_threads(1)
        torch.set_default_dtype(torch.float32)
        ProcessState.reset()

    def leave(self) -> None:
        import torch
        import torch.distributed as dist

        from retarget.execution.process import ProcessState

        if dist.is_initialized():
            dist.destroy_process_group()
        ProcessState.reset()
        _forget_process_singletons()
        torch._dynamo.reset()
        gc.collect()


def _forget_process_singletons() -> None:
    """Process-wide caches that would outlive the case's process group (a new interpreter has
    none of them): DTensor's sharding and redistribution plans, which hold the meshes (and so
    the group names) they were computed for and are looked up by a mesh's shape and names, so a
    later case with an equal mesh would run collectives on a destroyed group (torch's own
    DTensor tests clear them between tests); and Accelerate's state singletons, which remember
    a distributed state whose group is gone."""
    if "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor import _redistribute, debug

        debug._clear_sharding_prop_cache()
        _redistribute.clear_redistribute_planner_cache()
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def _run_case(case: bytes, rank: int, world: int) -> tuple[bool, Any]:
    try:
        fn, args = pickle.loads(case)  # here, so that a failing import is reported too
        # Plain pickle to bytes: the queue's own pickler would send tensors as shared-memory
        # handles that die with this process.
        return True, pickle.dumps(fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - report anything to the parent
        return False, traceback.format_exc()


def _serve(rank: int, world: int, inbox: Any, results: Any, lifeline: Any) -> None:
    """A pooled rank: run each case sent to it, as a fresh rank would, until told to stop."""
    import torch  # noqa: F401 - imported before the state is taken, as in a fresh rank

    faulthandler.enable(all_threads=True)  # a rank killed by a signal leaves its stacks

    fresh = _FreshState()
    while (case := _next_case(inbox, lifeline)) is not None:
        case_id, body, port, environ, cwd = case
        fresh.enter(rank, world, port, environ, cwd)
        try:
            ok, value = _run_case(body, rank, world)
        finally:
            fresh.leave()
        results.put((case_id, rank, ok, value))


def _next_case(inbox: Any, lifeline: Any) -> Any:
    """The next case, or None once told to stop or once the test process is gone (`lifeline`,
    the read end of a pipe whose write end only that process holds, reads as ready then): a
    pytest process that ends without closing its worlds, killed or leaving by os._exit, must not
    leave its ranks waiting for ever. (Not the parent's pid: a rank's parent is the fork server,
    which lives as long as any process it forked.)"""
    while True:
        try:
            return inbox.get(timeout=5)
        except queue.Empty:
            if lifeline.poll():
                return None


def _once(body: bytes, rank: int, world: int, port: int, results: Any) -> None:
    """A fresh rank for one case (`fresh=True`)."""
    os.environ.update(rank_env(rank, world, port))
    import torch
    import torch.distributed as dist

    faulthandler.enable(all_threads=True)  # a rank killed by a signal leaves its stacks
    torch.set_num_threads(1)
    try:
        ok, value = _run_case(body, rank, world)
        results.put((0, rank, ok, value))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _start_fork_server(ctx: Any) -> None:
    """Start the fork server (once per process: later calls find it running), importing
    PRELOADED in `_SERVER_ENVIRONMENT`."""
    from multiprocessing import forkserver

    ctx.set_forkserver_preload(PRELOADED)
    now = dict(os.environ)
    os.environ.clear()
    os.environ.update(_SERVER_ENVIRONMENT)
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(now)


class _World:
    """`size` processes: `pooled` ones forked from the fork server serve case after case, the
    others are spawned for one case (see the module docstring)."""

    _ids = itertools.count(1)

    def __init__(self, size: int, *, pooled: bool, body: bytes = b"") -> None:
        if pooled:
            ctx = mp.get_context("forkserver")
            _start_fork_server(ctx)
        else:
            ctx = mp.get_context("spawn")
        self.size = size
        self.results = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(size)] if pooled else []
        # Only this process holds its write end (and never writes): the ranks see it close
        # when this process ends.
        lifeline, self.lifeline = ctx.Pipe(duplex=False)
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_serve if pooled else _once,
                args=(r, size, self.inboxes[r], self.results, lifeline)
                if pooled
                else (body, r, size, port, self.results),
                daemon=True,
            )
            for r in range(size)
        ]
        for p in self.procs:
            p.start()
        lifeline.close()  # the ranks have their own copies

    def send(self, body: bytes) -> int:
        case_id = next(self._ids)
        port = free_port()
        environ, cwd = dict(os.environ), os.getcwd()
        for inbox in self.inboxes:
            inbox.put((case_id, body, port, environ, cwd))
        return case_id

    def collect(self, case_id: int, timeout: float) -> list[Any]:
        values: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(values) < self.size:
            try:
                got_id, rank, ok, value = self.results.get(timeout=1)
            except queue.Empty:
                # A rank killed by a signal reports nothing: notice it, do not wait it out.
                dead = [r for r, p in enumerate(self.procs) if p.exitcode is not None]
                dead = [r for r in dead if r not in values]
                if dead:
                    codes = {r: self.procs[r].exitcode for r in dead}
                    raise AssertionError(
                        f"ranks died without a result (exit codes {codes})"
                    ) from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.size)) - values.keys())
                    raise TimeoutError(
                        f"ranks {missing} gave no result within {timeout} s"
                    ) from None
                continue
            assert got_id in (case_id, 0), f"a result of case {got_id} in case {case_id}"
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            values[rank] = pickle.loads(value)
        return [values[r] for r in range(self.size)]

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)


#: The pooled world of each rank count, kept until the pytest process exits.
_worlds: dict[int, _World] = {}


@atexit.register
def close_worlds() -> None:
    """End every pooled world (at the session's end: tests/conftest.py, and at exit)."""
    while _worlds:
        _worlds.popitem()[1].close()


def _check_alone() -> None:
    """Under the suite's two xdist workers ranks start only in a test marked `distributed`,
    which runs alone (tests/core_share.py); elsewhere the marker is what selects them."""
    if os.environ.get(SHARED_CORES_ENV) and not os.environ.get(ALONE_ENV):
        raise AssertionError(
            "run_ranks in a test not marked distributed: mark it @pytest.mark.distributed so "
            "that it does not run beside another test"
        )


def run_ranks(
    fn: Callable,
    world_size: int = 2,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    fresh: bool = False,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks; their return values by rank."""
    _check_alone()
    body = pickle.dumps((fn, args))
    if fresh:
        world = _World(world_size, pooled=False, body=body)
        try:
            return world.collect(0, timeout)
        finally:
            world.kill()
    world = _worlds.get(world_size)
    if world is None or any(p.exitcode is not None for p in world.procs):
        world = _worlds[world_size] = _World(world_size, pooled=True)
    try:
        return world.collect(world.send(body), timeout)
    except BaseException:
        # A failed rank may leave its peers inside a collective: end the world; the next case
        # gets a new one.
        del _worlds[world_size]
        world.kill()
        raise
