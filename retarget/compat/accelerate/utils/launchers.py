"""notebook_launcher and debug_launcher: run a function on N local processes, as torchrun would.

    >>> def train(learning_rate):
    ...     accelerator = Accelerator(cpu=True)          # a process group of 2 over gloo
    ...     ...
    >>> notebook_launcher(train, args=(1e-3,), num_processes=2)

Each process is forked (so functions defined in a notebook or a test work, as in Accelerate)
with the variables torchrun sets: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT. Fork, as Accelerate's, needs the parent never to have started CUDA or a process
group. A process that raises fails the launch with its traceback (torch's ProcessRaisedException).
Only one machine is supported: the multi-node arguments of Accelerate's notebook_launcher are
refused when they ask for more than one node.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from retarget.execution.process import ProcessState


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Worker:
    """The body of one launched process: its environment, then `function(*args)`."""

    def __init__(self, function: Callable, world_size: int, env: dict[str, str]) -> None:
        self.function, self.world_size, self.env = function, world_size, env

    def __call__(self, rank: int, *args: Any) -> None:
        os.environ.update(self.env)
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.world_size),
        )
        ProcessState.reset()  # the parent's cached state (a world of one) was forked too
        try:
            self.function(*args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            ProcessState.reset()


def _launch(function: Callable, args: tuple, num_processes: int, env: dict[str, str]) -> None:
    if num_processes < 1:
        raise ValueError(f"num_processes={num_processes} must be at least 1")
    if dist.is_initialized():
        raise RuntimeError(
            "a process group already exists in this process: launch before anything starts one "
            "(no Accelerator() and no init_process_group before the launcher)"
        )
    mp.start_processes(
        _Worker(function, num_processes, env),
        args=tuple(args),
        nprocs=num_processes,
        join=True,
        start_method="fork",
    )


def notebook_launcher(
    function: Callable,
    args: tuple = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str = "29500",
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    **unsupported: Any,
) -> None:
    """Run `function(*args)` on `num_processes` processes of this machine (one: in this process).

    Precision is the Accelerator's (`Accelerator(mixed_precision=...)` inside `function`):
    `mixed_precision` other than "no" is refused, as are Accelerate's rendezvous options
    (rdzv_*, max_restarts, ...).
    """
    if mixed_precision != "no":
        raise NotImplementedError(
            f"notebook_launcher(mixed_precision={mixed_precision!r}): pass it to the "
            "Accelerator the function creates, Accelerator(mixed_precision=...)"
        )
    if num_nodes != 1 or node_rank != 0:
        raise NotImplementedError(
            f"notebook_launcher: num_nodes={num_nodes}, node_rank={node_rank}: one machine only; "
            "use `retarget launch` (torchrun) for several"
        )
    if unsupported:
        raise NotImplementedError(
            f"notebook_launcher: {', '.join(sorted(unsupported))} not supported (single-machine "
            "static launch only)"
        )
    if not num_processes or num_processes == 1:
        function(*args)
        return
    env = {
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(use_port),
    }
    _launch(function, args, num_processes, env)


def debug_launcher(function: Callable, args: tuple = (), num_processes: int = 2) -> None:
    """Run `function(*args)` on `num_processes` CPU processes over gloo, for tests and debugging
    (a free port is chosen, where Accelerate uses 29500)."""
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "CUDA_VISIBLE_DEVICES": "",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    _launch(function, args, num_processes, env)
