"""comm_hook (`fp16-comm`, `bf16-comm`, `powersgd[...]`): how DDP's gradient all-reduce is sent.

Contract: requires ddp | provides comm_hook | after - | numerics approx(rtol=0.01, atol=0.001)
    | options CommHookOptions

- fp16-comm / bf16-comm: each bucket is cast to 16 bits, divided by the world size and
  all-reduced, halving the bytes on the wire (`execution.comm_hooks.cast_compress_hook`);
  gradients come back rounded to 16 bits, so training is close to, not equal to, float32 all-reduce.
- powersgd[rank=,start_iter=,min_compression_rate=,error_feedback=,warm_start=,wrapper=]:
  torch's PowerSGD low-rank compression after `start_iter` plain all-reduce steps; `wrapper`
  also casts what PowerSGD sends to fp16/bf16 (Accelerate's comm_wrapper).

DDP takes one hook, installed after the DDP wrap that owns it (so this pass requires shard_ddp);
the runtime builds it from `program.plan.comm_hook` (a `CommHookPlan`). Under FSDP there is no
DDP all-reduce: the gradient communication dtype is the MixedPrecisionPolicy's reduce dtype
(shard_fsdp), and the target refuses comm-hook parts next to fsdp/zero2/zero3/hsdp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from retarget.core.plans import CommHookPlan
from retarget.ir.program import Program
from retarget.passes.base import Numerics, Pass, PassResult
from retarget.targets.grammar import Target

HOOK_PARTS = ("fp16-comm", "bf16-comm", "powersgd")
_CAST = {"fp16-comm": "float16", "bf16-comm": "bfloat16"}


@dataclass(frozen=True, kw_only=True)
class CommHookOptions:
    part: str
    """fp16-comm | bf16-comm | powersgd: the target part that asked for the hook."""
    powersgd: tuple[tuple[str, Any], ...] = ()
    """powersgd's options (rank, start_iter, min_compression_rate, error_feedback, warm_start,
    wrapper), all filled in."""

    def __post_init__(self) -> None:
        if self.part not in HOOK_PARTS:
            raise ValueError(f"comm_hook: part must be one of {HOOK_PARTS}, not {self.part!r}")
        options = dict(self.powersgd)
        keeps_state = options.get("error_feedback") or options.get("warm_start")
        if self.part == "powersgd" and keeps_state and options["start_iter"] < 2:
            raise ValueError(
                f"powersgd[start_iter={options['start_iter']}]: with error_feedback or "
                "warm_start on, PowerSGD needs at least 2 plain all-reduce steps first; write "
                "powersgd[start_iter=2] or set error_feedback=false,warm_start=false"
            )

    def plan(self) -> CommHookPlan:
        """program.plan.comm_hook: what `execution.comm_hooks.build_hook` builds."""
        if self.part in _CAST:
            return CommHookPlan(part=self.part, kind="cast", dtype=_CAST[self.part])
        return CommHookPlan(part=self.part, kind="powersgd", powersgd=dict(self.powersgd))


class InstallCommHook(Pass):
    name = "comm_hook"
    reads_graphs = False
    summary = "DDP communication hook: 16-bit all-reduce or PowerSGD (plan; installed at run)"
    requires = ("ddp",)
    provides = ("comm_hook",)
    # Measured on the tiny Llama (2 gloo ranks, 3 SGD steps): bf16-comm moves parameters by at
    # most 4.1e-5 from float32 all-reduce, fp16-comm by 4.8e-6. PowerSGD is lossy by design.
    numerics = Numerics("approx", rtol=1e-2, atol=1e-3)
    Options = CommHookOptions

    @classmethod
    def stage(cls, target: Target) -> list[Pass]:
        """The pipeline's comm-hook stage: this pass when the target names a hook."""
        part = next((target.get(n) for n in HOOK_PARTS if n in target), None)
        if part is None:
            return []
        powersgd = tuple(sorted(part.as_dict().items())) if part.name == "powersgd" else ()
        return [cls(CommHookOptions(part=part.name, powersgd=powersgd))]

    def run(self, program: Program) -> PassResult:
        before = program.plan.comm_hook
        plan = program.plan.comm_hook = self.options.plan()
        stats, notes = {"hook": plan.part}, (plan.describe(),)
        return PassResult(changed=plan != before, stats=stats, notes=notes)
