"""insert_autocast: run the matmul class in bf16/fp16, keep numerically sensitive ops in float32.

Contract: requires regions | provides autocast | after swap_fp8, quantize_linears
    | numerics approx(rtol=0.02, atol=0.02) | options AutocastOptions

Three forms, one per kind of code, so that every part of the model honours the target:

- Graph form (captured regions). Each matmul-class op (autocast_rules.LOWER_OPS: linear, mm,
  addmm, bmm, conv, scaled_dot_product_attention ...) gets its floating inputs cast to the low
  dtype and keeps its output in it, so consecutive matmuls chain in low precision. Every other
  op runs in the dtype its inputs have, like under torch.autocast; ops of the island kinds in
  `keep_fp32` (autocast_rules.ISLANDS, and patterns such as Llama's pow -> mean -> rsqrt) get
  their inputs cast back to float32. Values leaving the region are cast back to the dtype eager
  gives (float32), so no fp32 op after the region sees a bf16 tensor. Weights stay float32
  parameters: the casts are graph nodes, so autograd hands float32 gradients to the parameters.
  A Linear's weight cast goes inside `cast_weight_linear` (execution/autocast.py), which for a
  frozen weight saves the float32 parameter for backward and casts again there: a cast node's
  output, saved by the matmul, would keep a bf16 copy of every frozen weight from forward to
  backward (under LoRA, the whole model). Not under tp or selective/budget ac
  (`recast_weights`).
  The rewrite is a region transform: later captures (a new batch size, eval mode) get it too.
  The casts are `aten.to.dtype` nodes; casts that are provably no-ops are not inserted, and
  export's `_assert_tensor_metadata` checks on values whose dtype changed are dropped.
- Eager form (regions no frontend captured, or a call signature that failed to capture): the
  forward runs under torch.autocast(device of its inputs, dtype) and bf16/fp16 outputs are cast
  to float32, as Accelerate's convert_outputs_to_fp32 does. The float32 islands are then
  torch.autocast's own per-device lists (on CPU softmax is not among them): the report says so.
- Glue (leaf modules outside every region: lm_head, a classifier head, a stem conv): each
  Linear/Conv leaf (autocast_rules.LOWER_MODULES) runs its forward under torch.autocast with its
  outputs cast to float32 (a plain Linear through cast_weight_linear: autocast's numbers, no
  bf16 weight copy kept); every other glue op (embeddings, final norm, the loss) stays float32.
  Wrapping leaves rather than the root forward keeps region calls out of any ambient autocast:
  their inputs keep the dtype they were captured with, so no signature changes and no region
  runs two precision policies at once. Matmuls written inline in a glue forward stay float32.

The pass plans and reports; the graph form is autocast_graph.py; the eager and glue forms run
at step time from the execution layer (execution/autocast.py: the LowPrecision policy the pass
records in each glue leaf's record, or installs as a region's eager form).

`autocast_eval=false` runs eval mode in float32: graphs captured in eval mode are left as
captured (the train/eval flags are part of a graph's call signature), and the eager and glue
forms check `module.training` at each call.

fp16 also records the dynamic loss scaler's options in `program.plan.loss_scaler`, which
`retarget.runtime.scaler.make_loss_scaler` turns into a LossScaler; bf16 needs none.

    >>> compiled = retarget.compile_for(model, "bf16[keep_fp32=softmax|norm|loss|exp]", ...)
    >>> print(compiled.report)   # per region: form, ops lowered, fp32 islands
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from retarget.core.module_record import record_of
from retarget.core.modules import original_class
from retarget.core.plans import LossScalerPlan
from retarget.execution.autocast import LowPrecision
from retarget.ir.program import Program
from retarget.ir.region import Region
from retarget.passes.base import Numerics, Pass, PassResult
from retarget.passes.precision import autocast_rules as rules
from retarget.passes.precision.autocast_graph import plan_graph, rewrite_graph
from retarget.targets.grammar import Target
from retarget.targets.precisions import LOW_DTYPES

#: Loss-scaler options of the fp16 target part, recorded in program.plan.loss_scaler.
SCALER_OPTIONS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")


@dataclass(frozen=True, kw_only=True)
class AutocastOptions:
    dtype: str = "bf16"
    """bf16 | fp16: the dtype matmul-class ops run in."""
    keep_fp32: tuple[str, ...] = ("loss", "norm", "softmax")
    """Island kinds kept in float32 (autocast_rules.KINDS)."""
    autocast_eval: bool = True
    """Low precision in eval mode too; false runs eval-mode forwards in float32."""
    init_scale: float = 65536.0
    """fp16 only, like the three below: the loss scaler's initial scale."""
    growth_factor: float = 2.0
    """Scale multiplier after growth_interval steps without inf/nan gradients."""
    backoff_factor: float = 0.5
    """Scale multiplier after a step with inf/nan gradients (that step is skipped)."""
    growth_interval: int = 2000
    """Steps without inf/nan gradients before the scale grows."""
    recast_weights: bool = True
    """Graph form: a Linear's float32 weight is cast inside `cast_weight_linear`, again in
    backward, rather than kept as a low-precision copy from forward to backward. Off under tp
    (its split weights are DTensors, whose gradients torch's own linear computes) and under
    selective or budget ac (their scoped graphs take aten calls only)."""

    def __post_init__(self):
        if self.dtype not in LOW_DTYPES:
            raise ValueError(
                f"insert_autocast: dtype must be one of {tuple(LOW_DTYPES)}, not {self.dtype!r}"
            )
        unknown = [k for k in self.keep_fp32 if k not in rules.KINDS]
        if unknown:
            raise ValueError(
                f"insert_autocast: keep_fp32 has unknown island kind {unknown[0]!r}; "
                f"kinds: {', '.join(rules.KINDS)}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return LOW_DTYPES[self.dtype]

    def loss_scaler(self) -> LossScalerPlan | None:
        """The loss scaler's options (program.plan.loss_scaler); None for bf16."""
        if self.dtype != "fp16":
            return None
        return LossScalerPlan(**{key: getattr(self, key) for key in SCALER_OPTIONS})


class InsertAutocast(Pass):
    name = "insert_autocast"
    summary = "matmul-class ops in bf16/fp16, float32 islands by table, float32 at region exits"
    requires = ("regions",)
    provides = ("autocast",)
    # FP8 Linears keep their own precision: the rewrite must see them already swapped.
    after = (
        "swap_fp8",
        "quantize_linears",
    )
    # Measured on the zoo at batch 2, train and eval: largest |output(bf16) - output(fp32)| is
    # 6.2e-3 (transformer_encoder); fp16 4.7e-4. The tolerance leaves 3x room.
    numerics = Numerics("approx", rtol=2e-2, atol=2e-2)
    Options = AutocastOptions

    @classmethod
    def stage(cls, target: Target) -> list[Pass]:
        """The pass for the target's bf16 or fp16 part; [] when it has neither.

        `bf16[downcast=true]` is XLA's XLA_DOWNCAST_BF16, which the target only admits beside
        xla: the xla stage realises it, not this pass. Under pp the stages run, not the region
        graphs: split_stages realises bf16 there (each stage under torch.autocast).
        """
        name = next((n for n in LOW_DTYPES if n in target), None)
        if name is None or "pp" in target:  # under pp split_stages runs each stage in bf16
            return []
        part = target.get(name)
        keys = ("keep_fp32", "autocast_eval", *(SCALER_OPTIONS if name == "fp16" else ()))
        options = {key: part.get(key) for key in keys}
        ac = target.get("ac")
        selective = ac is not None and ac.get("policy") != "full"
        recast = "tp" not in target and not selective
        return [cls(AutocastOptions(dtype=name, recast_weights=recast, **options))]

    def run(self, program: Program) -> PassResult:
        policy = LowPrecision(self.options.torch_dtype, self.options.autocast_eval)
        dtype = str(policy.dtype).removeprefix("torch.")
        glue = _glue_leaves(program)
        lowered = [r.name for r in program.regions if r.rewritten_by(self.name)]
        lowered += [p for p, m in glue.items() if record_of(m).autocast]
        if lowered:  # a second run: the casts are in place
            return PassResult(changed=False, notes=(f"already in {dtype}: {', '.join(lowered)}",))
        notes: list[str] = []
        per_region: dict[str, dict[str, Any]] = {}
        for region in program.regions:
            entry = self._plan_region(program, region)
            if entry is None:
                notes.append(f"{region.name}: no matmul-class op; runs as captured, in float32")
                continue
            per_region[region.name] = entry
            notes.append(_region_note(region.name, entry, dtype))
        if glue:
            notes.append(_glue_note(glue, dtype))
        if not per_region and not glue:
            nothing = f"no matmul-class op in any region or glue module: nothing runs in {dtype}"
            return PassResult(changed=False, notes=(nothing,))
        for module in glue.values():
            policy.install(module)
        for region in program.regions:
            if region.name in per_region:
                self._rewrite_region(program, region, policy, per_region[region.name])
        scaler = self.options.loss_scaler()
        if scaler is not None:
            program.plan.loss_scaler = scaler
            notes.append(f"fp16: dynamic loss scaling, plan.loss_scaler = {scaler.options()}")
        if not self.options.autocast_eval:
            notes.append("autocast_eval=false: eval-mode forwards run in float32")
        stats = {
            "dtype": dtype,
            "keep_fp32": list(self.options.keep_fp32),
            "regions": per_region,
            "glue": sorted(glue),
        }
        return PassResult(changed=True, stats=stats, notes=tuple(notes))

    def _plan_region(self, program: Program, region: Region) -> dict[str, Any] | None:
        """What the rewrite will do to a region; None when it has nothing to lower."""
        if region.eager_only:
            return {"form": "eager"}
        graphs = list(region.graphs.values())
        if not graphs:
            return {"form": "graph", "lazy": True}
        modules = functools.partial(_repeat_modules, program, region)
        preview = [plan_graph(g.gm, self.options, modules) for g in graphs]
        if not any(p["lowered"] for p in preview):
            return None
        return {"form": "graph", **preview[0]}

    def _rewrite_region(
        self, program: Program, region: Region, policy: LowPrecision, entry: dict[str, Any]
    ) -> None:
        modules = functools.partial(_repeat_modules, program, region)
        transform = functools.partial(rewrite_graph, options=self.options, modules=modules)
        first = program.submodule(region.paths[0])
        region.add_transform(self.name, transform, eager_form=policy.eager_form(first))
        graph = region.representative()
        if graph is not None:
            entry["casts"] = graph.gm.meta["autocast"]["casts"]
            # Linears whose weight is cast in cast_weight_linear (none kept for backward)
            entry["recast"] = graph.gm.meta["autocast"].get("recast", 0)


def _region_note(name: str, entry: dict[str, Any], dtype: str) -> str:
    if entry["form"] == "eager":
        return (
            f"{name}: eager form (no frontend captured it, see regions); forward under "
            f"torch.autocast({dtype}), outputs cast to float32; fp32 islands are "
            "torch.autocast's own op lists there, keep_fp32 needs a graph"
        )
    if entry.get("lazy"):
        return f"{name}: graph form, applied when the region is captured at its first call"
    lowered = ", ".join(f"{op} x{n}" for op, n in entry["lowered_ops"].items())
    islands = ", ".join(f"{op} x{n}" for op, n in entry["islands"].items()) or "none"
    return (
        f"{name}: graph form; {entry['lowered']} ops in {dtype} ({lowered}); "
        f"fp32 islands: {islands}"
    )


def _glue_note(glue: dict[str, nn.Module], dtype: str, shown: int = 3) -> str:
    names = [f"{path} ({original_class(m).__name__})" for path, m in glue.items()]
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return (
        f"glue: {', '.join(names[:shown])}{more} under torch.autocast({dtype}), outputs cast to "
        "float32; the other glue ops (embeddings, norms, loss) run in float32"
    )


def _repeat_modules(program: Program, region: Region, target: str) -> list[nn.Module]:
    return [program.submodule(f"{path}.{target}" if path else target) for path in region.paths]


def _glue_leaves(program: Program) -> dict[str, nn.Module]:
    """Matmul-class leaf modules outside every region, by path."""
    covered = [path for region in program.regions for path in region.paths]
    if "" in covered:
        return {}
    glue = {}
    for path, module in program.module.named_modules():
        inside = any(path == c or path.startswith(c + ".") for c in covered)
        if not inside and rules.is_plain_leaf(module):
            glue[path] = module
    return glue
