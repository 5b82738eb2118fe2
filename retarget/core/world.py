"""The world: how many processes a run has, read from the launcher's environment in one place.

`launch_environment()` is the only reader of torchrun's variables (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE) and of the target `retarget launch` exports (RETARGET_TARGET).

Passes run before (and without) a process group, so the plan is made for a `World` resolved
once by compile_for and carried on the Program (`program.world`): the stated size
(`compile_for(..., world_size=8)`, `retarget inspect --world-size 8`), else the one the
launcher's environment announces, else one process. `World.hsdp_mesh` is the one place that
decides HSDP's (replicate, shard) mesh, for the plan and for the memory estimate alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from retarget.targets.grammar import Target, TargetError, parse_target

#: The variable that carries the target in effect to a script `retarget launch` started.
TARGET_ENV = "RETARGET_TARGET"
#: Accumulation steps `retarget launch --gradient_accumulation_steps` exports (Accelerate's name).
ACCUMULATION_ENV = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"
#: Where `retarget launch` asks ranks to record a clean stop (one empty file per rank).
STOPPED_DIR_ENV = "RETARGET_STOPPED_DIR"


@dataclass(frozen=True, kw_only=True)
class LaunchEnvironment:
    """What the launcher (torchrun, `retarget launch`) told this process."""

    rank: int | None
    """This process's rank; None when no launcher set RANK (a plain `python script.py`)."""
    world_size: int
    """WORLD_SIZE, 1 when unset."""
    local_rank: int | None
    """LOCAL_RANK; None when unset (the caller picks its default)."""
    local_world_size: int | None
    """LOCAL_WORLD_SIZE; None when unset."""

    @property
    def distributed(self) -> bool:
        """Whether a launcher started this process as one of several."""
        return self.rank is not None and self.world_size > 1


def launch_environment() -> LaunchEnvironment:
    """Read torchrun's variables now (they do not change within a process, but tests set them)."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    rank = int(env["RANK"]) if "RANK" in env else None
    return LaunchEnvironment(
        rank=rank,
        world_size=world,
        local_rank=int(env["LOCAL_RANK"]) if "LOCAL_RANK" in env else None,
        local_world_size=int(env["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in env else None,
    )


@dataclass(frozen=True, kw_only=True)
class World:
    """The processes a plan is made for."""

    size: int
    """Number of processes."""
    local_size: int
    """Processes per machine (hsdp's default shard group)."""
    source: str
    """'stated', 'environment' or 'one process' (nothing said otherwise)."""

    @classmethod
    def resolve(cls, stated: int | None = None) -> World:
        """The stated size, else the launcher's, else one process (see the module docstring)."""
        env = launch_environment()
        env_local = env.local_world_size or env.world_size
        if stated is not None:
            local = env_local if env.world_size == stated else stated
            return cls(size=stated, local_size=local, source="stated")
        if env.world_size > 1:
            return cls(size=env.world_size, local_size=env_local, source="environment")
        return cls(size=1, local_size=1, source="one process")

    def describe(self) -> str:
        return f"{self.size} process{'es' if self.size != 1 else ''} ({self.source})"

    def hsdp_mesh(self, replicate: int = 0, shard: int = 0) -> tuple[int, int]:
        """HSDP's (replicate, shard) mesh: shard defaults to the processes per machine and
        replicate to what fills the world. ValueError when the product is not the world."""
        shard = shard or min(self.local_size, self.size)
        replicate = replicate or max(self.size // shard, 1)
        if replicate * shard != self.size:
            raise ValueError(
                f"hsdp[replicate={replicate},shard={shard}] needs replicate x shard = "
                f"{replicate * shard} processes, but the world has {self.size}; choose "
                f"replicate and shard whose product is {self.size}"
            )
        return (replicate, shard)


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
