"""The world a distribution plan is made for: how many processes, and where that number came from.

Passes run before (and without) a process group, so they plan for a stated world size
(`compile_for(..., world_size=8)`, `retarget inspect --world-size 8`), else for the one torchrun's
environment announces (WORLD_SIZE, LOCAL_WORLD_SIZE), else for one process. The runtime re-plans
per-rank numbers when the group it finds has another size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from retarget.target.grammar import Target, TargetError, parse_target

if TYPE_CHECKING:
    from retarget.ir.program import Program

#: The variable that carries the target in effect to a script `retarget launch` started.
TARGET_ENV = "RETARGET_TARGET"

#: program.analysis key where compile_for records a stated world size.
WORLD_SIZE = "world_size"


@dataclass(frozen=True, kw_only=True)
class World:
    size: int
    """Number of processes."""
    local_size: int
    """Processes per machine (hsdp's default shard group)."""
    source: str
    """'stated', 'environment' or 'one process' (nothing said otherwise)."""

    def describe(self) -> str:
        return f"{self.size} process{'es' if self.size != 1 else ''} ({self.source})"


def planned_world(program: Program) -> World:
    """The world this program's plan is for (see the module docstring)."""
    stated = program.analysis.get(WORLD_SIZE)
    env_size = int(os.environ.get("WORLD_SIZE", "1"))
    env_local = int(os.environ.get("LOCAL_WORLD_SIZE", env_size))
    if stated is not None:
        local = env_local if env_size == stated else stated
        return World(size=stated, local_size=local, source="stated")
    if env_size > 1:
        return World(size=env_size, local_size=env_local, source="environment")
    return World(size=1, local_size=1, source="one process")


def launched_target() -> Target | None:
    """The target `retarget launch` exported to this process, or None when not launched by it.

    >>> os.environ["RETARGET_TARGET"] = "ddp+bf16"
    >>> launched_target()
    Target('ddp+bf16')
    """
    spec = os.environ.get(TARGET_ENV)
    if not spec:
        return None
    try:
        return parse_target(spec)
    except TargetError as err:
        raise TargetError(f"${TARGET_ENV}={spec!r}: {err}", part=err.part) from None
