"""find_executable_batch_size and release_memory: Accelerate's helpers for running out of memory.

    >>> @find_executable_batch_size(starting_batch_size=128)
    ... def train(batch_size, model, optimizer):
    ...     ...
    >>> train(model, optimizer)      # 128, then 115, 103, ... until one fits

The out-of-memory errors recognised are the ones torch raises: `torch.OutOfMemoryError` (CUDA,
a RuntimeError subclass whose message has " out of memory."), "MPS backend out of memory",
the CPU allocator's "DefaultCPUAllocator: can't allocate memory", and cuDNN's "not supported".
"""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

import torch

#: Phrases of torch's out-of-memory errors (the same list as Accelerate's).
_OOM_PHRASES = (
    " out of memory.",  # CUDA, HIP, XPU (torch.OutOfMemoryError)
    "MPS backend out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",  # HPU
)


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether `exception` is an out-of-memory error a smaller batch may avoid."""
    if isinstance(exception, RuntimeError) and len(exception.args) == 1:
        return any(phrase in str(exception.args[0]) for phrase in _OOM_PHRASES)
    return False


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Collect garbage (when asked) and give cached device memory back."""
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def release_memory(*objects: Any) -> list[None]:
    """One None per object, after collecting garbage and emptying the device caches.

    >>> a, b = release_memory(a, b)      # reassign: the caller's names hold the last refs
    """
    released: list[None] = [None] * len(objects)
    del objects
    clear_device_cache(garbage_collection=True)
    return released


def find_executable_batch_size(
    function: Callable | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Callable:
    """Call `function(batch_size, *args, **kwargs)`, retrying with a smaller batch size after
    each out-of-memory error (times 0.9, as Accelerate 1.15 does, or `reduce_batch_size_fn()`).

    The batch size found is kept for the next call. Other errors propagate; a batch size of 0
    raises RuntimeError("No executable batch size found, reached zero.").
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    batch_size = starting_batch_size
    if reduce_batch_size_fn is None:

        def reduce_batch_size_fn() -> int:
            return int(batch_size * 0.9)

    @functools.wraps(function)
    def with_batch_size(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        clear_device_cache(garbage_collection=True)
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            given = ", ".join(f"{p}={v}" for p, v in zip(params[1:], args[1:], strict=False))
            raise TypeError(
                f"Batch size was passed into `{function.__name__}` as the first argument when "
                f"called. Remove this as the decorator already does so: "
                f"`{function.__name__}({given})`"
            )
        while True:
            if batch_size == 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as error:
                if not should_reduce_batch_size(error):
                    raise
                clear_device_cache(garbage_collection=True)
                batch_size = reduce_batch_size_fn()

    return with_batch_size
