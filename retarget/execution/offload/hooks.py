"""Forward hooks that bring a unit's tensors in before it runs and release them after.

Before a unit's module runs, its tensors are installed on the execution device (taken from the
prefetch thread when it already read them, else read now); after it returns they are replaced
by their meta placeholders again, so between calls an offloaded tensor takes no memory. A tensor
two running units share (a tie) is counted and released by the last one.

Prefetch: with `prefetch=k`, the next k units' tensors are read on one background thread while
the current unit computes, and when the model is called (`watch_calls`) the first k are, while
the resident modules before them compute. The order is learned: each unit remembers which
unit ran after it last time (the first pass follows module order), so an encoder-decoder's
generate loop, which runs the decoder again and again, prefetches decoder blocks rather than the
encoder. At most k
units are read ahead; a guess that turns out wrong is dropped, so memory stays bounded by the
running units plus k.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from retarget.execution.nested import send_to_device
from retarget.execution.offload.units import OffloadedTensor, OffloadUnit


class OffloadRuntime:
    """The hooks of one dispatched model (kept on it in slot `OFFLOAD`)."""

    def __init__(self, units: list[OffloadUnit], device: torch.device | str, prefetch: int = 0):
        if prefetch < 0:
            raise ValueError(f"prefetch={prefetch} must be >= 0 (the number of units read ahead)")
        self.units = units
        self.device = torch.device(device)
        self.prefetch = prefetch
        self._index = {id(u): i for i, u in enumerate(units)}
        self._after: dict[int, int] = {}
        self._last: int | None = None
        self._first: int | None = None
        self._starting = False
        self._pending: dict[int, Future] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="offload") if prefetch else None
        self._handles: list = []
        self.loads = 0
        self.prefetched = 0

    def attach(self) -> OffloadRuntime:
        for unit in self.units:
            self._handles.append(
                unit.module.register_forward_pre_hook(self._before(unit), with_kwargs=True)
            )
            self._handles.append(unit.module.register_forward_hook(self._after_hook(unit)))
        return self

    def watch_calls(self, root: nn.Module) -> OffloadRuntime:
        """Read the first offloaded units ahead as soon as `root` (the model) is called: they
        load while the resident modules before them compute, not when they are reached."""

        def hook(_module, _args):
            self._starting = True
            if self._pool is not None and self.units:
                first = self._first if self._first is not None else 0
                upcoming = [first, *self._predict(first)][: self.prefetch]
                self._drop_pending(keep=set(upcoming))
                for i in upcoming:
                    if i not in self._pending:
                        self._pending[i] = self._pool.submit(self._read_ahead, self.units[i])

        self._handles.append(root.register_forward_pre_hook(hook))
        return self

    @property
    def pending(self) -> int:
        """Units read ahead and not yet run."""
        return len(self._pending)

    def align_inputs(self, module: nn.Module, device: torch.device) -> None:
        """Move `module`'s tensor arguments to `device` (it lives there) before it runs."""

        def hook(_module, args, kwargs):
            return send_to_device(args, device), send_to_device(kwargs, device)

        self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def release(self) -> None:
        """Drop reads made ahead and close the open files (their memory maps go with them),
        so nothing of the offloaded weights stays mapped; the next call opens them again."""
        while self._pending:
            future = self._pending.pop(next(iter(self._pending)))
            if not future.cancel():
                future.exception()  # a read under way: let it finish, then drop its values
        for unit in self.units:
            for tensor in unit.tensors:
                files = getattr(tensor.source, "files", None)
                if files is not None:
                    files.close()

    def remove(self) -> None:
        """Take the hooks off; offloaded tensors stay as their meta placeholders."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._drop_pending(keep=set())
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _read(self, unit: OffloadUnit) -> dict[int, torch.Tensor]:
        return {id(t): t.source.load(self.device) for t in unit.tensors if t.users == 0}

    def _before(self, unit: OffloadUnit):
        index = self._index[id(unit)]

        def hook(module: nn.Module, args, kwargs):
            if self._last is not None:
                self._after[self._last] = index
            if self._starting:
                self._first, self._starting = index, False
            self._last = index
            future = self._pending.pop(index, None)
            values = future.result() if future is not None else self._read(unit)
            self.loads += future is None
            self.prefetched += future is not None
            for tensor in unit.tensors:
                self._acquire(tensor, values)
            self._schedule(index)
            if self.device.type != "cpu":
                return send_to_device(args, self.device), send_to_device(kwargs, self.device)
            return None

        return hook

    def _after_hook(self, unit: OffloadUnit):
        def hook(module: nn.Module, args, output):
            for tensor in unit.tensors:
                tensor.users -= 1
                if tensor.users == 0:
                    tensor.uninstall()

        return hook

    def _acquire(self, tensor: OffloadedTensor, values: dict[int, torch.Tensor]) -> None:
        if tensor.users == 0:
            value = values.get(id(tensor))
            tensor.install(value if value is not None else tensor.source.load(self.device))
        tensor.users += 1

    def _predict(self, index: int) -> list[int]:
        upcoming, current = [], index
        for _ in range(self.prefetch):
            current = self._after.get(current, (current + 1) % len(self.units))
            if current == index or current in upcoming:
                break
            upcoming.append(current)
        return upcoming

    def _schedule(self, index: int) -> None:
        if self._pool is None:
            return
        upcoming = self._predict(index)
        self._drop_pending(keep=set(upcoming))
        for i in upcoming:
            if i not in self._pending:
                self._pending[i] = self._pool.submit(self._read_ahead, self.units[i])

    def _read_ahead(self, unit: OffloadUnit) -> dict[int, torch.Tensor | None]:
        return {id(t): t.source.prefetch(self.device) for t in unit.tensors}

    def _drop_pending(self, keep: set[int]) -> None:
        for i in [i for i in self._pending if i not in keep]:
            self._pending.pop(i).cancel()
