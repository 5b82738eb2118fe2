"""Accelerate's N-D parallelism sizes (ParallelismConfig, `--parallelism_config_*` launch flags,
TorchTensorParallelPlugin's tp_size) as the target parts that lay out the same mesh.

    dp_replicate  dp_shard  tp   ->  target
    1             1         N    ->  tp[size=N]
    1             S         N    ->  fsdp+tp[size=N]          (a (dp=S, tp=N) mesh)
    1             S         1    ->  fsdp
    R             S         1    ->  hsdp[replicate=R,shard=S]
    R             1         1    ->  ddp

    and cp_size C (or sp_size C)    ->  the above + cp[size=C] (sp: cp[attention=ulysses]);
                                        FSDP2 over the cp ranks when nothing else is set

Sizes of 1 (or unset) are absent dims. Anything else is refused with the reason: cp beside tp
or hsdp, cp and sp both set, replication beside tp (DDP does not take tp's DTensors; hsdp+tp
needs a 3-D mesh, not implemented).

Accelerate reads these sizes only beside FSDP2 (`distributed_type: FSDP` with a
`parallelism_config:` section, or `--use_fsdp --use_parallelism_config`), so the FSDP settings
come along: `with_layout` puts the layout in place of the strategy that fsdp_config chose and
keeps that strategy's options (SHARD_GRAD_OP stays zero2, and becomes hsdp[reshard=false] when
the sizes replicate too).

    >>> str(parallelism_target({"dp_shard_size": 2, "tp_size": 2}, "ParallelismConfig"))
    'fsdp+tp[size=2]'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from retarget.targets.errors import TargetError
from retarget.targets.grammar import Target

#: The data-parallel and tensor-parallel sizes; the context-parallel ones are CONTEXT_SIZES.
SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size")
#: Accelerate's context-parallel sizes: cp (ring attention under FSDP2) and sp (DeepSpeed's
#: Ulysses sequence parallelism), both the `cp` part here.
CONTEXT_SIZES = ("cp_size", "sp_size")
#: Accelerate's cp_comm_strategy (its TorchContextParallelConfig) -> cp's attention: torch's
#: "alltoall" rotates keys and values round the group, as our ring does.
COMM_STRATEGIES = {"allgather": "allgather", "alltoall": "ring"}


def parallelism_target(sizes: Mapping[str, Any], where: str) -> Target:
    """The target for Accelerate's sizes (see the module docstring); TargetError names `where`."""
    cp, sp = (_size(sizes, key, where) for key in CONTEXT_SIZES)
    if cp > 1 and sp > 1:
        raise TargetError(
            f"{where}: cp_size={cp} and sp_size={sp} both split the sequence; set one", where
        )
    if max(cp, sp) == 1:
        return _data_and_tensor_target(sizes, where)
    strategy = sizes.get("cp_comm_strategy")
    if strategy is not None and str(strategy).lower() not in COMM_STRATEGIES:
        raise TargetError(
            f"{where}.cp_comm_strategy={strategy!r}: one of {', '.join(COMM_STRATEGIES)}", where
        )
    attention = COMM_STRATEGIES[str(strategy).lower()] if strategy is not None else "ring"
    if sp > 1:
        attention = "ulysses"
    part = f"cp[size={max(cp, sp)},attention={attention}]"
    replicate, shard, tp = (_size(sizes, key, where) for key in SIZES)
    if tp > 1 or (replicate > 1 and shard > 1):
        raise TargetError(
            f"{where}: {'cp' if cp > 1 else 'sp'}_size={max(cp, sp)} beside "
            f"{'tp_size' if tp > 1 else 'dp_replicate_size and dp_shard_size'}: context "
            "parallelism composes with one data-parallel dim (dp_shard_size: fsdp, or "
            "dp_replicate_size: ddp) here, not yet with tp or hsdp",
            where,
        )
    base = "ddp" if replicate > 1 else "fsdp"
    return Target.parse(f"{base}+{part}")


def _data_and_tensor_target(sizes: Mapping[str, Any], where: str) -> Target:
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


#: FSDP options that describe what ddp and tp alone do anyway (tp's checkpoints are sharded,
#: and both start from rank 0's weights): accepted beside a layout that shards no dp dim.
_SAME_WITHOUT_SHARDING = {"state_dict": "sharded", "sync_module_states": True}
#: The strategies an fsdp_config section can choose (NO_SHARD is ddp).
_FSDP_STRATEGIES = ("fsdp", "zero2", "zero3", "hsdp", "ddp")


def with_layout(parts: dict[str, dict[str, Any]], layout: Target, where: str) -> None:
    """Replace the FSDP strategy in `parts` (from fsdp_config) by the sizes' `layout`, keeping
    the strategy's options; TargetError naming `where` when the two disagree."""
    chosen = next((name for name in parts if name in _FSDP_STRATEGIES), None)
    options = parts.pop(chosen, {}) if chosen else {}
    base, *rest = layout.parts
    if base.name == "hsdp":
        if chosen == "ddp":
            raise TargetError(f"{where}: fsdp_sharding_strategy NO_SHARD with dp_shard_size > 1")
        merged = {**options, **dict(base.options)}
        if chosen == "zero2":
            merged["reshard"] = False
        parts["hsdp"] = merged
    elif base.name == "fsdp":
        if chosen in ("hsdp", "ddp"):
            raise TargetError(
                f"{where}: fsdp_config asks for {chosen}, but the sizes lay out {layout} "
                "(no dp_replicate_size); keep one",
                where,
            )
        parts[chosen or "fsdp"] = options
    else:  # ddp (dp_replicate_size alone) or tp alone: no sharded dim for FSDP's options
        meaningless = {k: v for k, v in options.items() if _SAME_WITHOUT_SHARDING.get(k) != v}
        if meaningless or chosen not in (None, "fsdp", base.name):
            asked = ", ".join(f"{k}={v}" for k, v in meaningless.items()) or chosen
            raise TargetError(
                f"{where}: the sizes lay out {layout}, which shards nothing over data-parallel "
                f"ranks, so fsdp_config's {asked} has no meaning; set dp_shard_size or drop it",
                where,
            )
        parts[base.name] = dict(base.options)
    for part in rest:
        parts[part.name] = dict(part.options)


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
