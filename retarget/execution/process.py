"""Who am I among the processes: the process group, this rank's device, main-process helpers.

`ProcessState.current()` is the one place a process group is created. Under torchrun (or
`retarget launch`) the environment names the rank, world size and rendezvous; the group is
initialised once, gloo on a CPU-only machine and nccl when CUDA is present. Without that
environment the process is a world of one and nothing is initialised.

    >>> state = ProcessState.current()
    >>> state.rank, state.world_size, state.device
    (0, 1, device(type='cpu'))
    >>> with state.main_process_first():
    ...     dataset = load_or_download()     # rank 0 first, the others read its cache
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import datetime
import functools
import gc
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from retarget.core.world import launch_environment

F = TypeVar("F", bound=Callable[..., Any])

#: torchrun's variables; RANK and WORLD_SIZE decide whether this is a distributed run.
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

#: How long a collective may wait for a peer before the group gives up (a crashed peer must not
#: hang the others forever). `RETARGET_TIMEOUT_S` overrides it.
DEFAULT_TIMEOUT_S = 300.0


def _attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """After an elastic restart, the rendezvous store keyed by attempt; None before any restart.

    torchrun's agent keeps one store across restarts (static rendezvous), so the keys the group
    of attempt 0 wrote (gloo's peer addresses) are still there: without a prefix per attempt a
    restarted rank can read a dead peer's address and fail with "connection refused".
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0":
        return None
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=not agent_store and os.environ["RANK"] == "0",
        timeout=timeout,
        multi_tenant=not agent_store,
    )
    return dist.PrefixStore(f"retarget/attempt_{attempt}/", store)


@dataclass(frozen=True)
class ProcessState:
    """This process's place in the run. Build it with `ProcessState.current()`."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    backend: str | None = None
    device: torch.device = torch.device("cpu")
    group: Any = None
    """The process group collectives over this state use (None: every process; under tp the
    data-parallel view of `Applied.data_state` names the dp group)."""

    _current = None

    @classmethod
    def current(cls, *, backend: str | None = None, cpu: bool = False) -> ProcessState:
        """The state of this process, initialising the process group on first use.

        An existing default process group (the user's own `init_process_group`) is adopted as
        is. `cpu=True` keeps the model on the CPU even when CUDA is present (gloo then).
        """
        if cls._current is not None and (cls._current.world_size == 1 or dist.is_initialized()):
            return cls._current
        cls._current = cls._build(backend=backend, cpu=cpu)
        return cls._current

    @classmethod
    def reset(cls) -> None:
        """Forget the cached state (after `dist.destroy_process_group()`, in tests)."""
        cls._current = None

    @classmethod
    def _build(cls, *, backend: str | None, cpu: bool) -> ProcessState:
        use_cuda = torch.cuda.is_available() and not cpu
        env = launch_environment()
        if not dist.is_initialized():
            if not env.distributed:
                device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
                if use_cuda:
                    torch.cuda.set_device(device)
                return cls(device=device)
            missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
            if missing:
                raise RuntimeError(
                    f"RANK/WORLD_SIZE are set but {', '.join(missing)} is not: launch with "
                    "`retarget launch` or `torchrun`, which set all of "
                    f"{', '.join(_ENV)}"
                )
            backend = backend or ("nccl" if use_cuda else "gloo")
            timeout = float(os.environ.get("RETARGET_TIMEOUT_S", DEFAULT_TIMEOUT_S))
            if use_cuda:
                torch.cuda.set_device(env.local_rank or 0)
            pg_timeout = datetime.timedelta(seconds=timeout)
            store = _attempt_store(pg_timeout)
            extra = (
                {}
                if store is None
                else {"store": store, "rank": env.rank, "world_size": env.world_size}
            )
            dist.init_process_group(backend, timeout=pg_timeout, **extra)
            end_process_group_at_exit()
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = rank if env.local_rank is None else env.local_rank
        local_world = world if env.local_world_size is None else env.local_world_size
        device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
        return cls(rank, world, local_rank, local_world, dist.get_backend(), device)

    # -- who ------------------------------------------------------------------------------------

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_rank == 0

    @property
    def is_last_process(self) -> bool:
        return self.rank == self.world_size - 1

    # -- together -------------------------------------------------------------------------------

    def wait_for_everyone(self) -> None:
        """Barrier across all processes (no-op in a world of one)."""
        if self.distributed:
            dist.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the local main process only."""
        if self.is_local_main_process:
            builtins.print(*args, **kwargs)

    def on_main_process(self, fn: F) -> F:
        """Decorator: run `fn` on rank 0 only (others return None)."""
        return self._only(lambda: self.is_main_process, fn)

    def on_local_main_process(self, fn: F) -> F:
        """Decorator: run `fn` on local rank 0 of each machine only."""
        return self._only(lambda: self.is_local_main_process, fn)

    def on_process(self, process_index: int) -> Callable[[F], F]:
        """Decorator factory: run on the process with this global rank only."""
        return lambda fn: self._only(lambda: self.rank == process_index, fn)

    def on_local_process(self, local_process_index: int) -> Callable[[F], F]:
        """Decorator factory: run on the process with this local rank only (on every machine)."""
        return lambda fn: self._only(lambda: self.local_rank == local_process_index, fn)

    @staticmethod
    def _only(condition: Callable[[], bool], fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs) if condition() else None

        return wrapper  # type: ignore[return-value]

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Rank 0 runs the body first; the others run it after rank 0 has finished."""
        with self._first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Local rank 0 of each machine runs the body first."""
        with self._first(self.is_local_main_process):
            yield

    @contextlib.contextmanager
    def _first(self, leader: bool) -> Iterator[None]:
        if not leader:
            self.wait_for_everyone()
        yield
        if leader:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def split_between_processes(
        self, inputs: Sequence[Any] | dict[str, Any] | torch.Tensor, apply_padding: bool = False
    ) -> Iterator[Any]:
        """This rank's contiguous share of `inputs` (a list, tuple, str, tensor or dict of them).

        Shares differ by at most one element, the first ranks taking the extra ones. With
        `apply_padding` every share has the same length, padded with the last element, so the
        results can be gathered with equal sizes (and trimmed afterwards).
        """
        yield _split(inputs, self.rank, self.world_size, apply_padding)


class ProcessStateFacade:
    """Who-am-I properties and main-process helpers read from `self.state`, a ProcessState.

    The one definition the facades in front of a ProcessState share (Runtime, Accelerator).
    Accelerate's names are aliases: `process_index` is `rank`, `num_processes` `world_size`,
    `local_process_index` `local_rank`, `use_distributed` `distributed`.
    """

    state: ProcessState

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.state.rank

    @property
    def world_size(self) -> int:
        """Processes over all machines."""
        return self.state.world_size

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine."""
        return self.state.local_rank

    @property
    def device(self) -> torch.device:
        """The device this process trains on."""
        return self.state.device

    @property
    def distributed(self) -> bool:
        """Whether there is more than one process."""
        return self.state.distributed

    @property
    def is_main_process(self) -> bool:
        """Whether this is global rank 0."""
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        """Whether this is rank 0 of its machine."""
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        """Whether this is the last global rank."""
        return self.state.is_last_process

    process_index = rank
    num_processes = world_size
    local_process_index = local_rank
    use_distributed = distributed

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the local main process only."""
        self.state.print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        """Barrier across all processes (no-op in a world of one)."""
        self.state.wait_for_everyone()

    def on_main_process(self, function: F) -> F:
        """Decorator: run `function` on rank 0 only (others return None)."""
        return self.state.on_main_process(function)

    def on_local_main_process(self, function: F) -> F:
        """Decorator: run `function` on local rank 0 of each machine only."""
        return self.state.on_local_main_process(function)

    def on_last_process(self, function: F) -> F:
        """Decorator: run `function` on the last global rank only."""
        return self.state.on_process(self.state.world_size - 1)(function)

    def on_process(self, function: F | None = None, process_index: int | None = None) -> Any:
        """`@on_process(process_index=1)` or `on_process(fn, process_index=1)` (Accelerate's)."""
        if process_index is None:
            raise TypeError("on_process needs process_index=")
        decorate = self.state.on_process(process_index)
        return decorate if function is None else decorate(function)

    def on_local_process(
        self, function: F | None = None, local_process_index: int | None = None
    ) -> Any:
        """`@on_local_process(local_process_index=1)` or with the function first."""
        if local_process_index is None:
            raise TypeError("on_local_process needs local_process_index=")
        decorate = self.state.on_local_process(local_process_index)
        return decorate if function is None else decorate(function)

    def main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """Rank 0 runs the body first; the others run it after rank 0 has finished."""
        return self.state.main_process_first()

    def local_main_process_first(self) -> contextlib.AbstractContextManager[None]:
        """Local rank 0 of each machine runs the body first."""
        return self.state.local_main_process_first()

    def split_between_processes(
        self, inputs: Sequence[Any] | dict[str, Any] | torch.Tensor, apply_padding: bool = False
    ) -> contextlib.AbstractContextManager[Any]:
        """This rank's contiguous share of `inputs` (see ProcessState.split_between_processes)."""
        return self.state.split_between_processes(inputs, apply_padding=apply_padding)


def end_process_group() -> None:
    """Free what still holds the process group, then destroy it (no-op without a group).

    Scripts rarely destroy the group. A compiled model and its runtime refer to each other, so
    their DDP reducer (which holds the group) is freed by the cycle collector, and when that
    happens only during interpreter shutdown torch 2.13's gloo sometimes aborts the rank
    ("terminate called without an active exception": about 1 in 10 two-rank launches measured)
    after training succeeded. Collecting first, then destroying: 0 in 24.
    """
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    ProcessState.reset()


def end_process_group_at_exit() -> None:
    """Run `end_process_group` at interpreter exit, once however often this is called."""
    atexit.unregister(end_process_group)
    atexit.register(end_process_group)


def _split(inputs: Any, rank: int, world: int, pad: bool) -> Any:
    if isinstance(inputs, dict):
        return {k: _split(v, rank, world, pad) for k, v in inputs.items()}
    if not isinstance(inputs, (list, tuple, str, torch.Tensor)):
        raise TypeError(
            "split_between_processes takes a list, tuple, str, tensor or dict of them, got "
            f"{type(inputs).__name__}"
        )
    n = len(inputs)
    per, extra = divmod(n, world)
    start = rank * per + min(rank, extra)
    end = start + per + (1 if rank < extra else 0)
    share = inputs[start:end]
    if pad and n and len(share) < per + (1 if extra else 0):
        missing = per + 1 - len(share)
        last = inputs[-1:] if isinstance(inputs, torch.Tensor) else [inputs[-1]]
        if isinstance(inputs, torch.Tensor):
            share = torch.cat([share, *[last] * missing])
        elif isinstance(inputs, str):
            share = share + last * missing
        else:
            share = type(inputs)(list(share) + list(last) * missing)
    return share
