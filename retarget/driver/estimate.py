"""Estimate a model's memory under a target without launching ranks (`retarget estimate-memory`).

The model is compiled for the target's local parts (precision, ac) in this process, so the
activations are measured as the model really runs; the distribution parts are then applied
arithmetically for `world_size` ranks by `retarget.report.memory_estimate`.

    >>> print(estimate_for_target(model, "fsdp+bf16+ac", batch, world_size=8))
"""

from __future__ import annotations

from typing import Any

from torch import nn

from retarget.driver.compile import compile_for
from retarget.report.memory_estimate import MemoryEstimate, estimate_memory
from retarget.targets.grammar import Target, parse_target
from retarget.targets.precisions import PRECISION_PART_NAMES

#: Target parts that change what one process computes; the others distribute it.
LOCAL_PARTS = (*PRECISION_PART_NAMES, "ac")


def estimate_for_target(
    model: nn.Module,
    target: str | Target,
    example_inputs: Any,
    *,
    world_size: int | None = None,
    optimizer: str = "adam",
) -> MemoryEstimate:
    """Estimate `model` under `target` for `world_size` ranks (default: this run's)."""
    target = parse_target(target)
    compiled = compile_for(model, local_target(target), example_inputs=example_inputs)
    return estimate_memory(
        compiled, target=target, world_size=world_size, optimizer=optimizer, run=True
    )


def local_target(target: Target) -> Target:
    """The parts of `target` that change what one process computes (`single` when none)."""
    parts = tuple(part for part in target.parts if part.name in LOCAL_PARTS)
    return Target(parts) if parts else parse_target("single")
