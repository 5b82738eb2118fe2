"""shard_fsdp (`fsdp`, `zero3`, `zero2`, `hsdp`, `+offload`): shard parameters with FSDP2.

Contract: requires regions | provides fsdp
    | after swap_fp8, quantize_linears, insert_autocast, checkpoint_blocks, compile_regions,
    shard_tp, split_stages
    | numerics exact | options FsdpOptions

Units: every repeated block find_blocks found (`program.blocks`: each LlamaDecoderLayer, each
BasicBlock of a ResNet stage) is one `fully_shard` unit, and the root is the last unit, holding
everything else (embeddings, heads, norms). With `capture="whole"` the root's one graph reads
every parameter itself rather than calling the blocks, so the root is the only unit. A unit's
parameters are all-gathered just before it runs and freed after (`reshard_after_forward`), so a
rank holds whole parameters of one block at a time. A block whose parameters are also used
outside it (tied weights) stays in the root unit, as does one with fewer than `min_params`
parameters.

Variants, all FSDP2 with a different mesh or reshard setting:
- fsdp / zero3: 1-D mesh over all ranks, parameters resharded after forward (ZeRO-3);
- zero2: parameters stay gathered from forward to backward (`reshard_after_forward=False`),
  gradients and optimizer state sharded;
- hsdp: 2-D mesh (replicate, shard): shard within a group, replicate across groups;
  `hsdp[replicate=R,shard=S]`, by default one group per machine;
- fsdp+pp[size=N]: a (pp, dp) mesh; each pipeline stage is one unit sharded over the
  world / N ranks that run it (`stage_units`, PP_UNITS says why not per block);
- offload: FSDP2's CPUOffloadPolicy; parameters, gradients and the optimizer step live on the
  CPU. Memory is pinned only when an accelerator is present (pinning needs one: docs/facts.md).

`cpu_ram_efficient_loading=true` (Accelerate's name): only rank 0 needs the weights. The other
ranks may build the model on the meta device (transformers' from_pretrained does under
`retarget launch`), get storage-free placeholders for capture, and receive their shards of
rank 0's values after sharding (execution/rank0_loading.py), so no rank but 0 ever holds the
whole model. Not under tp, and not with sync_module_states=false (rank 0's values are the point).

Mixed precision: with bf16/fp16 in the target the MixedPrecisionPolicy gathers parameters in that
dtype (`param_dtype`) and reduce-scatters gradients in float32 (`reduce_dtype`); not under pp,
whose stage graphs were traced in float32 and assert their dtypes (fsdp+pp+bf16 gathers float32
parameters and computes under autocast, split_stages). Under FSDP the
gradient communication dtype is this reduce dtype; DDP comm hooks (fp16-comm, bf16-comm,
powersgd) do not apply and the target refuses them.

The record, `program.plan.fsdp` (an `FsdpPlan`), lists the units with their parameter count
and the elements each rank holds (FSDP2 shards dim 0 of every parameter in torch.chunk
pieces); the runtime applies it (`retarget.execution.apply_plan`).

    >>> compiled = retarget.compile_for(model, "fsdp+bf16", example_inputs=batch, world_size=8)
    >>> print(compiled.report)        # units, per-rank counts, mixed-precision policy
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from retarget.core.errors import TargetNotSupportedError
from retarget.core.plans import FsdpPlan, FsdpUnit
from retarget.core.world import World
from retarget.ir.program import Program
from retarget.kernels.quant.linear import QuantizedLinear
from retarget.passes.base import Pass, PassResult
from retarget.passes.shard.fsdp_units import (
    PP_UNITS,
    Unit,
    plan_units,
    stage_units,
    unit_note,
)
from retarget.targets.grammar import Target
from retarget.targets.precisions import LOW_DTYPES, dtype_name
from retarget.targets.strategies import FSDP_STRATEGIES
from retarget.targets.values import parse_dtype

#: The dtype gradients are reduce-scattered in when the target has a precision part.
REDUCE_DTYPE = "float32"


@dataclass(frozen=True, kw_only=True)
class FsdpOptions:
    """What `fsdp[...]`, `zero2/zero3[...]`, `hsdp[...]` and `offload[...]` ask for."""

    strategy: str = "fsdp"
    """fsdp | zero3 | zero2 | hsdp (the target part's name)."""
    reshard_after_forward: bool = True
    """Free gathered parameters after each unit's forward (false for zero2)."""
    min_params: int = 0
    """Blocks with fewer parameters are not their own unit (they stay in the root unit)."""
    sync_module_states: bool = True
    """Broadcast rank 0's parameters and buffers before sharding, so every rank starts equal."""
    state_dict: str = "sharded"
    """sharded: state_dict() holds DTensor shards (FSDP2's own); full: whole tensors, gathered
    on every rank (a collective), and load_state_dict takes whole tensors."""
    replicate: int = 0
    """hsdp: number of replica groups (0: one per machine)."""
    shard: int = 0
    """hsdp: processes per shard group (0: processes per machine)."""
    offload: bool = False
    """CPUOffloadPolicy: parameters, gradients and the optimizer step on the CPU."""
    pin_memory: str = "auto"
    """offload: pin the CPU copies (auto: only when an accelerator is present)."""
    load_from_rank0: bool = False
    """cpu_ram_efficient_loading: the other ranks take their shards of rank 0's values after
    sharding, so they need no weights of their own (meta models get placeholders)."""
    param_dtype: str | None = None
    """Dtype parameters are gathered and computed in (MixedPrecisionPolicy.param_dtype)."""
    reduce_dtype: str | None = None
    """Dtype gradients are reduce-scattered in (MixedPrecisionPolicy.reduce_dtype)."""

    def __post_init__(self) -> None:
        if self.strategy not in FSDP_STRATEGIES:
            raise ValueError(
                f"shard_fsdp: strategy must be one of {FSDP_STRATEGIES}, not {self.strategy!r}"
            )

    @classmethod
    def from_target(cls, target: Target) -> FsdpOptions:
        """Options from the target's sharded part, its offload part and its precision part."""
        part = next(target.get(n) for n in FSDP_STRATEGIES if n in target)
        values = part.as_dict()
        _refuse_unsupported(part, "tp" in target, "pp" in target)
        precision = next((n for n in LOW_DTYPES if n in target), None)
        if "pp" in target:
            # A stage's graph was traced in float32 and asserts its dtypes: its parameters are
            # gathered as they are and autocast computes in bf16 (split_stages).
            precision = None
        kwargs: dict[str, Any] = {
            "strategy": part.name,
            "reshard_after_forward": values.get("reshard", part.name != "zero2"),
            "min_params": values["min_params"],
            "sync_module_states": values["sync_module_states"],
            "load_from_rank0": values["cpu_ram_efficient_loading"],
            "state_dict": values["state_dict"],
            "replicate": values.get("replicate", 0),
            "shard": values.get("shard", 0),
            "param_dtype": dtype_name(LOW_DTYPES[precision]) if precision else None,
            "reduce_dtype": REDUCE_DTYPE if precision else None,
        }
        offload = target.get("offload")
        if offload is not None:
            if not (offload.get("params") and offload.get("optimizer")):
                raise TargetNotSupportedError(
                    f"'{offload}': FSDP2's CPUOffloadPolicy moves parameters, gradients and the "
                    "optimizer step to the CPU together; write offload (params and optimizer "
                    "both true)"
                )
            kwargs.update(offload=True, pin_memory=offload.get("pin_memory"))
        return cls(**kwargs)

    def pin(self) -> bool:
        if self.pin_memory == "auto":
            return torch.cuda.is_available()
        return self.pin_memory == "true"


def _refuse_unsupported(part: Any, with_tp: bool, with_pp: bool = False) -> None:
    if not part.get("cpu_ram_efficient_loading"):
        return
    if with_pp:
        raise TargetNotSupportedError(
            f"'{part}' with pp: loading the weights on rank 0 only is not implemented under "
            "pipeline parallelism; drop cpu_ram_efficient_loading (every rank then builds the "
            "model, and the stages start from rank 0's values)"
        )
    if not part.get("sync_module_states"):
        raise TargetNotSupportedError(
            f"'{part}': cpu_ram_efficient_loading=true gives every rank rank 0's weights, which "
            "sync_module_states=false says not to do; drop one of the two"
        )
    if with_tp:
        raise TargetNotSupportedError(
            f"'{part}' with tp: loading the weights on rank 0 only is not implemented under "
            "tensor parallelism; drop cpu_ram_efficient_loading (every rank then builds the "
            "model, and tp starts from rank 0's values)"
        )


class ShardFsdp(Pass):
    name = "shard_fsdp"
    reads_graphs = False
    summary = "FSDP2 units: each repeated block plus the root, sharded over a mesh (plan)"
    requires = ("regions",)
    provides = ("fsdp",)
    # FSDP shards the swapped modules' parameters, and each unit recomputes (ac) and casts
    # (autocast) inside its own all-gather.
    # fsdp+tp: fully_shard over the dp dim of the blocks tp split (torchtitan's order).
    after = (
        "swap_fp8",
        "quantize_linears",
        "insert_autocast",
        "checkpoint_blocks",
        "compile_regions",
        "shard_tp",
        "split_stages",
    )
    Options = FsdpOptions

    @classmethod
    def stage(cls, target: Target) -> list[Pass]:
        """The pipeline's FSDP stage: this pass when the target has a sharded strategy."""
        if not any(n in target for n in FSDP_STRATEGIES):
            return []
        return [cls(FsdpOptions.from_target(target))]

    def run(self, program: Program) -> PassResult:
        world, dims = program.world, program.parallel_dims()
        # FSDP2 shards over dp x cp (cp's ranks hold other positions, not copies); hsdp's mesh
        # is (replicate, shard)
        beside = dims.tp > 1 or "pp" in dims.used  # named "dp" of a (pp, dp, tp) mesh
        mesh = (
            (dims.dp_replicate, dims.dp_shard)
            if self.options.strategy == "hsdp"
            else (dims.dp_shard * dims.cp,)
        )
        if program.plan.pp is not None:
            units, kept = stage_units(program), [PP_UNITS]
        else:
            units, kept = plan_units(program, self.options.min_params, mesh[-1])
        before = program.plan.fsdp
        program.plan.fsdp = fsdp_plan(self.options, world, mesh, units, beside)
        notes = [unit_note(u, mesh) for u in units]
        notes += kept
        notes.append(mixed_precision_note(self.options))
        restored = restore_quantized(program, self.options.param_dtype)
        if restored:
            notes.append(
                f"{restored} quantized weights re-stored as {self.options.param_dtype} (the same "
                "bytes), the dtype FSDP gathers in, so its MixedPrecisionPolicy leaves them be"
            )
        if self.options.offload:
            notes.append(f"offload: CPUOffloadPolicy(pin_memory={self.options.pin()})")
        if self.options.load_from_rank0:
            notes.append(
                "cpu_ram_efficient_loading: rank 0's weights; every other rank receives its "
                "shards after sharding and never holds the whole model"
            )
        stats = {"units": len(units), "mesh": list(mesh), "world_size": world.size}
        changed = program.plan.fsdp != before or bool(restored)
        return PassResult(changed=changed, stats=stats, notes=tuple(notes))


def restore_quantized(program: Program, param_dtype: str | None) -> int:
    """Quantized Linears (a model loaded quantized) whose packed buffer is not stored in the
    gather dtype: a MixedPrecisionPolicy would cast its bytes as numbers. Re-view them."""
    if param_dtype is None:
        return 0
    dtype = parse_dtype(param_dtype)
    modules = [m for m in program.module.modules() if isinstance(m, QuantizedLinear)]
    # torchao's weights gather themselves (their FSDP2 hooks), in their own storage dtypes.
    changed = [m for m in modules if m.backend == "native" and m.weight.dtype != dtype]
    for module in changed:
        module.store_as(dtype)
    return len(changed)


def fsdp_plan(
    options: FsdpOptions,
    world: World,
    mesh: tuple[int, ...],
    units: list[Unit],
    beside_tp_or_pp: bool = False,
) -> FsdpPlan:
    """program.plan.fsdp: everything the runtime needs to call fully_shard."""
    return FsdpPlan(
        strategy=options.strategy,
        world=world,
        mesh_shape=tuple(mesh),
        mesh_dims=("dp",) if beside_tp_or_pp else ("replicate", "shard")[-len(mesh) :],
        reshard_after_forward=options.reshard_after_forward,
        sync_module_states=options.sync_module_states,
        load_from_rank0=options.load_from_rank0,
        state_dict=options.state_dict,
        param_dtype=options.param_dtype,
        reduce_dtype=options.reduce_dtype,
        offload=options.offload,
        pin_memory=options.offload and options.pin(),
        units=tuple(
            FsdpUnit(
                path=u.path,
                block=u.block_type,
                parameters=u.parameters,
                per_rank=tuple(u.per_rank(mesh)),
                shapes=u.shapes,
            )
            for u in units
        ),
    )


def mixed_precision_note(options: FsdpOptions) -> str:
    if options.param_dtype is None:
        return "no MixedPrecisionPolicy: parameters gathered and gradients reduced in float32"
    return (
        f"MixedPrecisionPolicy(param_dtype={options.param_dtype}, "
        f"reduce_dtype={options.reduce_dtype}): gradient communication runs in the reduce dtype "
        "(FSDP's counterpart of a DDP comm hook)"
    )
