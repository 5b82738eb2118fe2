"""The one strategy table: every distribution strategy a target can name, and what it shards.

Every layer that asks "is this strategy sharded?", "does DDP own the gradients?" or "what does
this strategy do?" reads this table: the target rules (schema.py), the plan passes, the memory
estimate, Accelerate's DistributedType and kwargs handlers.

    >>> STRATEGY["zero2"].shards
    (False, True, True)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Strategy:
    name: str
    does: str
    """What it does, as a clause ("shards parameters"), for error messages."""
    shards: tuple[bool, bool, bool]
    """What it splits across ranks: (parameters, gradients, optimizer state)."""
    wrapper: str
    """Who realises it: 'ddp' (DistributedDataParallel), 'fsdp' (FSDP2), 'xla' or 'none'."""


_TABLE = (
    Strategy(name="single", does="runs one process", shards=(False, False, False), wrapper="none"),
    Strategy(name="ddp", does="replicates parameters", shards=(False, False, False), wrapper="ddp"),
    Strategy(name="fsdp", does="shards parameters", shards=(True, True, True), wrapper="fsdp"),
    Strategy(
        name="zero1",
        does="replicates parameters and shards optimizer state",
        shards=(False, False, True),
        wrapper="ddp",
    ),
    Strategy(
        name="zero2",
        does="shards gradients and optimizer state",
        shards=(False, True, True),
        wrapper="fsdp",
    ),
    Strategy(name="zero3", does="shards parameters", shards=(True, True, True), wrapper="fsdp"),
    Strategy(
        name="hsdp",
        does="shards within groups and replicates across them",
        shards=(True, True, True),
        wrapper="fsdp",
    ),
    Strategy(
        name="xla",
        does="runs one SPMD program over the XLA devices",
        shards=(False, False, False),
        wrapper="xla",
    ),
)

#: name -> Strategy, in the grammar's order.
STRATEGY: dict[str, Strategy] = {s.name: s for s in _TABLE}
#: Every strategy name.
STRATEGIES: tuple[str, ...] = tuple(STRATEGY)
#: Strategies realised by FSDP2 (fully_shard units).
FSDP_STRATEGIES: tuple[str, ...] = tuple(s.name for s in _TABLE if s.wrapper == "fsdp")
#: Strategies realised by DistributedDataParallel (comm hooks apply to them).
DDP_STRATEGIES: tuple[str, ...] = tuple(s.name for s in _TABLE if s.wrapper == "ddp")
