"""Accelerate's N-D parallelism sizes (ParallelismConfig, `--parallelism_config_*` launch flags,
TorchTensorParallelPlugin's tp_size) as the target parts that lay out the same mesh.

    dp_replicate  dp_shard  tp   ->  target
    1             1         N    ->  tp[size=N]
    1             S         N    ->  fsdp+tp[size=N]          (a (dp=S, tp=N) mesh)
    1             S         1    ->  fsdp
    R             S         1    ->  hsdp[replicate=R,shard=S]
    R             1         1    ->  ddp

Sizes of 1 (or unset) are absent dims. Anything else is refused with the reason: context or
sequence parallelism (not implemented), replication beside tp (DDP does not take tp's
DTensors; hsdp+tp needs a 3-D mesh, not implemented).

    >>> str(parallelism_target({"dp_shard_size": 2, "tp_size": 2}, "ParallelismConfig"))
    'fsdp+tp[size=2]'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from retarget.target.errors import TargetError
from retarget.target.grammar import Target

#: The sizes read; the others Accelerate has (cp, sp) are refused when above 1.
SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size")
UNSUPPORTED = {
    "cp_size": "context parallelism is not implemented",
    "sp_size": "sequence parallelism (Ulysses) is not implemented",
}


def parallelism_target(sizes: Mapping[str, Any], where: str) -> Target:
    """The target for Accelerate's sizes (see the module docstring); TargetError names `where`."""
    for key, why in UNSUPPORTED.items():
        if _size(sizes, key, where) > 1:
            raise TargetError(f"{where}.{key}={sizes[key]}: {why}; leave it at 1", where)
    replicate, shard, tp = (_size(sizes, key, where) for key in SIZES)
    if tp > 1 and replicate > 1:
        raise TargetError(
            f"{where}: dp_replicate_size={replicate} with tp_size={tp}: replication beside "
            "tensor parallelism is not implemented (DDP takes no DTensors, hsdp+tp needs a 3-D "
            f"mesh); use dp_shard_size={replicate * max(shard, 1)} (fsdp+tp)",
            where,
        )
    if tp > 1:
        return Target.parse(f"fsdp+tp[size={tp}]" if shard > 1 else f"tp[size={tp}]")
    if replicate > 1 and shard > 1:
        return Target.parse(f"hsdp[replicate={replicate},shard={shard}]")
    if shard > 1:
        return Target.parse("fsdp")
    if replicate > 1:
        return Target.parse("ddp")
    raise TargetError(f"{where}: every size is 1; there is nothing to lay out", where)


def _size(sizes: Mapping[str, Any], key: str, where: str) -> int:
    value = sizes.get(key)
    if value is None:
        return 1
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise TargetError(f"{where}.{key}={value!r}: expected a whole number", where) from None
    if size < 1:
        raise TargetError(f"{where}.{key}={value!r}: expected a whole number >= 1", where)
    return size
