"""place_xla (`xla[spmd=true|false, sharding=fsdp|replicate]`): the model on XLA devices.

Contract: requires blocks | provides xla | after swap_fp8, insert_autocast, checkpoint_blocks
    | numerics approx(rtol=1e-05, atol=1e-06) | options XlaOptions

XLA traces each step lazily and compiles it whole, so nothing here rewrites graphs: the pass
decides where every parameter lives and records it (`program.plan.xla`); the driver applies it
(`execution.xla_placement`): SPMD switched on, the model moved to the XLA device, each parameter
annotated, inputs moved and sharded on the batch dim, a step boundary at each call.

- spmd=false: one XLA device holds the whole model (PJRT's first device).
- spmd=true (default): one program over every device of the process (a 1-D mesh, axis
  "fsdp"), the batch dim of each input sharded over it. With sharding=fsdp (default) the
  parameters of every repeated block (find_blocks) whose dim 0 divides by the device count are
  sharded on dim 0, the plan our fsdp pass makes, and everything else (embeddings, norms, heads,
  biases that do not divide) is replicated; XLA inserts the all-gathers and reduce-scatters.
  sharding=replicate keeps every parameter whole on every device (data parallel).

The captured regions run as they are: their graphs are plain aten ops, traced by XLA like eager.

    >>> compiled = retarget.compile_for(model, "xla[spmd=true]+bf16", example_inputs=batch)
    >>> print(compiled.report)   # per parameter: sharded on dim 0 or replicated
"""

from __future__ import annotations

from dataclasses import dataclass

from retarget.core.errors import TargetNotSupportedError
from retarget.core.plans import XlaPlan
from retarget.execution import xla_device as xla
from retarget.ir.program import Program
from retarget.passes.base import Numerics, Pass, PassResult
from retarget.targets.grammar import Target

SHARDINGS = ("fsdp", "replicate")


@dataclass(frozen=True, kw_only=True)
class XlaOptions:
    spmd: bool = True
    """One SPMD program over every device of the process, or one device."""
    sharding: str = "fsdp"
    """fsdp: dim 0 of the repeated blocks' parameters over the devices; replicate: none."""

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise ValueError(
                f"place_xla: sharding must be fsdp or replicate, not {self.sharding!r}"
            )


class PlaceXla(Pass):
    name = "place_xla"
    summary = "the model on XLA devices: one device, or SPMD with dim-0 sharded blocks (plan)"
    requires = ("blocks",)
    provides = ("xla",)
    after = ("swap_fp8", "insert_autocast", "checkpoint_blocks")
    # XLA:CPU's fused kernels reorder float sums (measured: loss within 2e-6 of eager).
    numerics = Numerics("approx", rtol=1e-5, atol=1e-6)
    Options = XlaOptions

    @classmethod
    def stage(cls, target: Target) -> list[Pass]:
        """The pipeline's xla stage: this pass when the target names `xla`."""
        part = target.get("xla")
        if part is None:
            return []
        bf16 = target.get("bf16")
        if bf16 is not None and bf16.get("downcast"):
            raise TargetNotSupportedError(
                "xla: bf16[downcast=true] is torch-xla's XLA_DOWNCAST_BF16 (float32 stored as "
                "bf16), which torch-xla deprecates and no pass implements; drop downcast: bf16 "
                "runs autocast on the XLA device"
            )
        xla.torch_xla_or_refuse()  # before anything is captured: say how to install it
        return [cls(XlaOptions(spmd=part.get("spmd"), sharding=part.get("sharding")))]

    def run(self, program: Program) -> PassResult:
        spmd = self.options.spmd
        devices = xla.device_count() if spmd else 1
        in_blocks = _block_parameters(program)
        shards: dict[str, tuple[str | None, ...]] = {}
        replicated, sharded_numel, total = [], 0, 0
        for name, param in program.module.named_parameters():
            total += param.numel()
            shard = (
                spmd
                and self.options.sharding == "fsdp"
                and devices > 1
                and name in in_blocks
                and param.dim() >= 1
                and param.shape[0] % devices == 0
            )
            if shard:
                shards[name] = (xla.MESH_AXIS,) + (None,) * (param.dim() - 1)
                sharded_numel += param.numel()
            else:
                replicated.append(name)
        plan = XlaPlan(
            spmd=spmd,
            sharding=self.options.sharding,
            devices=devices,
            platform=xla.platform(),
            shards=shards,
            replicated=tuple(replicated),
            sharded_numel=sharded_numel,
            total_numel=total,
        )
        program.plan.xla = plan
        stats = {"devices": devices, "sharded": len(shards), "replicated": len(replicated)}
        return PassResult(changed=True, stats=stats, notes=(plan.describe(),))


def _block_parameters(program: Program) -> set[str]:
    """Names (from the root) of the parameters inside repeated blocks."""
    names = set()
    for group in program.blocks:
        for path in group.paths:
            module = program.submodule(path)
            names.update(f"{path}.{n}" for n, _ in module.named_parameters())
    return names
