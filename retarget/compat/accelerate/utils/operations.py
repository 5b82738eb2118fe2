"""gather_object and broadcast_object_list with Accelerate's signatures (no state argument)."""

from __future__ import annotations

from typing import Any

from retarget.execution.process import ProcessState
from retarget.runtime import collectives


def gather_object(object: Any) -> Any:  # noqa: A002 - Accelerate's parameter name
    """Every process's list (or tuple) of picklable objects, concatenated in rank order, on
    every process. In a world of one the object comes back as it is, as in Accelerate.

        >>> gather_object([f"rank {rank}"])    # ["rank 0", "rank 1"] on 2 processes
    """
    state = ProcessState.current()
    if not state.distributed:
        return object
    return collectives.gather_object(state, object)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """`object_list` filled in place, on every process, with process `from_process`'s objects."""
    return collectives.broadcast_object_list(ProcessState.current(), object_list, from_process)
