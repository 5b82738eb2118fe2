"""insert_autocast: run the matmul class in bf16/fp16, keep numerically sensitive ops in float32.

Contract: requires regions | provides autocast | after swap_fp8
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
  The rewrite is a region transform: later captures (a new batch size, eval mode) get it too.
  The casts are `aten.to.dtype` nodes; casts that are provably no-ops are not inserted, and
  export's `_assert_tensor_metadata` checks on values whose dtype changed are dropped.
- Eager form (regions no frontend captured, or a call signature that failed to capture): the
  forward runs under torch.autocast(device of its inputs, dtype) and bf16/fp16 outputs are cast
  to float32, as Accelerate's convert_outputs_to_fp32 does. The float32 islands are then
  torch.autocast's own per-device lists (on CPU softmax is not among them): the report says so.
- Glue (leaf modules outside every region: lm_head, a classifier head, a stem conv): each
  Linear/Conv leaf (autocast_rules.LOWER_MODULES) runs its forward under torch.autocast with its
  outputs cast to float32; every other glue op (embeddings, final norm, the loss) stays float32.
  Wrapping leaves rather than the root forward keeps region calls out of any ambient autocast:
  their inputs keep the dtype they were captured with, so no signature changes and no region
  runs two precision policies at once. Matmuls written inline in a glue forward stay float32.

`autocast_eval=false` runs eval mode in float32: graphs captured in eval mode are left as
captured (the train/eval flags are part of a graph's call signature), and the eager and glue
forms check `module.training` at each call.

fp16 also records the dynamic loss scaler's options in `program.plan["loss_scaler"]`, which
`retarget.runtime.scaler.make_loss_scaler` turns into a LossScaler; bf16 needs none.

    >>> compiled = retarget.compile_for(model, "bf16[keep_fp32=softmax|norm|loss|exp]", ...)
    >>> print(compiled.report)   # per region: form, ops lowered, fp32 islands
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten, tree_map_only

from retarget.core.capturing import capturing
from retarget.core.modules import original_class, with_mixin
from retarget.ir.program import Program
from retarget.ir.region import Region
from retarget.passes.base import Numerics, Pass, PassResult
from retarget.passes.precision import autocast_rules as rules
from retarget.target.grammar import Target
from retarget.target.precisions import LOW_DTYPES

_AUTOCAST_ELIGIBLE = (torch.float32, torch.bfloat16, torch.float16)
#: Loss-scaler options of the fp16 target part, recorded in program.plan["loss_scaler"].
SCALER_OPTIONS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")

#: The live modules a graph's `call_module` target names: one per repeat of the region.
Modules = Callable[[str], list[nn.Module]]

# Dtype states of a graph value after the rewrite.
LOW = "low"  # the low dtype, for sure
EAGER = "eager"  # the dtype eager gives, for sure
MAYBE = "maybe"  # either: casts that need one or the other are inserted


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

    def loss_scaler(self) -> dict[str, Any] | None:
        """The loss scaler's options (program.plan["loss_scaler"]); None for bf16."""
        if self.dtype != "fp16":
            return None
        return {key: getattr(self, key) for key in SCALER_OPTIONS}


class InsertAutocast(Pass):
    name = "insert_autocast"
    summary = "matmul-class ops in bf16/fp16, float32 islands by table, float32 at region exits"
    requires = ("regions",)
    provides = ("autocast",)
    # FP8 Linears keep their own precision: the rewrite must see them already swapped.
    after = ("swap_fp8",)
    # Measured on the zoo at batch 2, train and eval: largest |output(bf16) - output(fp32)| is
    # 6.2e-3 (transformer_encoder); fp16 4.7e-4. The tolerance leaves 3x room.
    numerics = Numerics("approx", rtol=2e-2, atol=2e-2)
    Options = AutocastOptions

    @classmethod
    def stage(cls, target: Target, capture: Any) -> list[Pass]:
        """The pass for the target's bf16 or fp16 part; [] when it has neither.

        `bf16[downcast=true]` is XLA's XLA_DOWNCAST_BF16, which the target only admits beside
        xla: the xla stage realises it, not this pass.
        """
        name = next((n for n in ("bf16", "fp16") if n in target), None)
        if name is None:
            return []
        part = target.get(name)
        keys = ("keep_fp32", "autocast_eval", *(SCALER_OPTIONS if name == "fp16" else ()))
        return [cls(AutocastOptions(dtype=name, **{key: part.get(key) for key in keys}))]

    def run(self, program: Program) -> PassResult:
        policy = LowPrecision(self.options.torch_dtype, self.options.autocast_eval)
        dtype = str(policy.dtype).removeprefix("torch.")
        notes: list[str] = []
        per_region: dict[str, dict[str, Any]] = {}
        for region in program.regions:
            entry = self._plan_region(program, region)
            if entry is None:
                notes.append(f"{region.name}: no matmul-class op; runs as captured, in float32")
                continue
            per_region[region.name] = entry
            notes.append(_region_note(region.name, entry, dtype))
        glue = _glue_leaves(program)
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
            program.plan["loss_scaler"] = scaler
            notes.append(f"fp16: dynamic loss scaling, plan['loss_scaler'] = {scaler}")
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


# -- graph form --------------------------------------------------------------------------------
def plan_graph(
    gm: fx.GraphModule, options: AutocastOptions, modules: Modules | None = None
) -> dict[str, Any]:
    """Counts of what rewrite_graph would do, without changing `gm`."""
    modules = modules or _own_modules(gm)
    decisions = rules.classify(gm.graph, gm)
    lowered = Counter(rules.op_name(n) for n, d in decisions.items() if _lowers(n, d))
    for node in (n for n, d in decisions.items() if d == rules.MODULE):
        plain = [m for m in modules(node.target) if _plain_leaf(m)]
        if plain:
            lowered[rules.LOWER_MODULES[original_class(plain[0])] + " (module)"] += 1
    islands = Counter(
        f"{d}:{rules.op_name(n)}" for n, d in decisions.items() if d in options.keep_fp32
    )
    total = sum(lowered.values())
    return {"lowered": total, "lowered_ops": dict(lowered), "islands": dict(islands)}


def rewrite_graph(
    gm: fx.GraphModule, *, options: AutocastOptions, modules: Modules | None = None
) -> None:
    """The graph form (see the module docstring); a graph already rewritten is left alone.

    A `call_module` of a plain Linear/Conv leaf (a graph that routes calls to modules, as
    swap_fp8 does, keeping some Linears plain) runs that leaf under torch.autocast in every
    repeat (`modules` finds them; default: `gm`'s own submodules); modules of other classes,
    FP8 Linears among them, keep their own precision.

    Records what it did in `gm.meta["autocast"]` and each value's dtype state in
    `node.meta["autocast"]` (low / eager / maybe); `meta["val"]` keeps the fp32 trace.
    """
    if "autocast" in gm.meta:
        return
    if gm.meta.get("training") is False and not options.autocast_eval:
        gm.meta["autocast"] = {"skipped": "eval mode and autocast_eval=false", "casts": 0}
        return
    modules = modules or _own_modules(gm)
    summary = plan_graph(gm, options, modules)
    rewriter = _Rewriter(gm, options, modules)
    rewriter.run()
    gm.meta["autocast"] = {**summary, "casts": rewriter.casts}


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, options: AutocastOptions, modules: Modules):
        self.graph = gm.graph
        self.modules = modules
        self.policy = LowPrecision(options.torch_dtype, options.autocast_eval)
        self.low = options.torch_dtype
        self.keep = frozenset(options.keep_fp32)
        self.decisions = rules.classify(gm.graph, gm)
        self.state: dict[fx.Node, str] = {}
        self.cache: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
        self.casts = 0

    def run(self) -> None:
        for node in list(self.graph.nodes):
            decision = self.decisions.get(node)
            if node.op == "output":
                self._cast_inputs(node, self._restore)
                continue
            if _lowers(node, decision):
                self._cast_inputs(node, self._lower)
                state = LOW if _is_float32(node) else MAYBE  # multi-output ops: MAYBE
            elif decision in self.keep:
                self._cast_inputs(node, self._restore)
                state = EAGER
            elif decision == rules.MODULE:
                for module in self.modules(node.target):
                    if _plain_leaf(module):
                        self.policy.install(module)
                state = self._propagate(node)  # the leaf casts its outputs back
            elif rules.op_name(node) == "_assert_tensor_metadata":
                if self.state.get(node.args[0], EAGER) != EAGER:
                    self.graph.erase_node(node)  # export's check of a dtype we changed
                continue
            else:
                state = self._propagate(node)
            self.state[node] = state
            node.meta["autocast"] = state

    def _cast_inputs(self, node: fx.Node, cast) -> None:
        node.args = fx.node.map_arg(node.args, functools.partial(cast, user=node))
        node.kwargs = fx.node.map_arg(node.kwargs, functools.partial(cast, user=node))

    def _lower(self, value: fx.Node, user: fx.Node) -> fx.Node:
        if self.state.get(value) == LOW or not _may_be_float(value):
            return value
        return self._cast(value, self.low, user)

    def _restore(self, value: fx.Node, user: fx.Node) -> fx.Node:
        if self.state.get(value, EAGER) == EAGER or not _may_be_float(value):
            return value
        known = rules.value_of(value)
        eager = known.dtype if isinstance(known, torch.Tensor) else torch.float32
        return self._cast(value, eager, user)

    def _cast(self, value: fx.Node, dtype: torch.dtype, user: fx.Node) -> fx.Node:
        """`value` cast to `dtype`, once per value and dtype; before its first user."""
        key = (value, dtype)
        if key not in self.cache:
            # A value of unknown dtype (no traced value) may be an integer or bool tensor.
            known = isinstance(rules.value_of(value), torch.Tensor)
            cast_fn = torch.ops.aten.to.dtype if known else cast_floating
            with self.graph.inserting_before(user):
                cast = self.graph.call_function(cast_fn, (value, dtype))
            cast.meta["autocast"] = LOW if dtype == self.low else EAGER
            self.state[cast] = cast.meta["autocast"]
            self.cache[key] = cast
            self.casts += 1
        return self.cache[key]

    def _propagate(self, node: fx.Node) -> str:
        """The dtype state of an op this pass does not rewrite, from its inputs' states."""
        if not _may_be_float(node) or _explicit_dtype(node):
            return EAGER
        inputs = [x for x in node.all_input_nodes if _may_be_float(x)]
        states = [self.state.get(x, EAGER) for x in inputs]
        if all(s == EAGER for s in states):
            return EAGER
        if _is_inplace(node):
            return self.state.get(node.args[0], EAGER)
        name = rules.op_name(node)
        if name in rules.FOLLOWS and all(s == LOW for s in states):
            return LOW
        if name in rules.PROMOTES and _is_float32(node):
            pairs = zip(inputs, states, strict=True)
            if any(s == EAGER and _is_float32(x, dimensioned=True) for x, s in pairs):
                return EAGER
        return MAYBE


def _lowers(node: fx.Node, decision: str | None) -> bool:
    """A matmul-class op that eager runs in float32 (float64 stays, as under torch.autocast)."""
    if decision != rules.LOWER:
        return False
    value = rules.value_of(node)
    leaves = [v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor)]
    return value is None or any(v.dtype == torch.float32 for v in leaves)


def _own_modules(gm: fx.GraphModule) -> Modules:
    return lambda target: [gm.get_submodule(target)]


def _repeat_modules(program: Program, region: Region, target: str) -> list[nn.Module]:
    return [program.submodule(f"{path}.{target}" if path else target) for path in region.paths]


def _plain_leaf(module: nn.Module) -> bool:
    """A Linear/Conv of exactly a LOWER_MODULES class (not a subclass such as an FP8 Linear)."""
    return type(module) in rules.LOWER_MODULES or isinstance(module, AutocastModule)


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """`value.to(dtype)` for a float32/bf16/fp16 tensor, else `value` (float64 stays, as under
    torch.autocast). The cast of graph values whose traced dtype is unknown."""
    if isinstance(value, torch.Tensor) and value.dtype in _AUTOCAST_ELIGIBLE:
        return value.to(dtype)
    return value


def _is_float32(node: fx.Node, *, dimensioned: bool = False) -> bool:
    value = rules.value_of(node)
    if not isinstance(value, torch.Tensor):
        return value is None and not dimensioned  # unknown: a float32 value, as traced
    return value.dtype == torch.float32 and (value.dim() > 0 or not dimensioned)


def _may_be_float(node: fx.Node) -> bool:
    """False only when the traced value is known to hold no floating tensor."""
    value = rules.value_of(node)
    if value is None:
        return "val" not in node.meta and "example_value" not in node.meta
    leaves = tree_flatten(value)[0]
    return any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in leaves)


def _explicit_dtype(node: fx.Node) -> bool:
    """Whether the op's output dtype is an argument (`x.to(torch.float32)`, `dtype=`)."""
    if isinstance(node.kwargs.get("dtype"), torch.dtype):
        return True
    if node.op == "call_method":
        if node.target in ("float", "double", "half", "bfloat16"):
            return True
        return node.target in ("to", "type") and any(isinstance(v, torch.dtype) for v in node.args)
    if isinstance(node.target, torch._ops.OpOverload):
        names = [argument.name for argument in node.target._schema.arguments]
        index = names.index("dtype") if "dtype" in names else len(node.args)
        return index < len(node.args) and isinstance(node.args[index], torch.dtype)
    return False


def _is_inplace(node: fx.Node) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        first = target._schema.arguments[:1]
        return bool(first) and first[0].alias_info is not None and first[0].alias_info.is_write
    name = rules.op_name(node) or ""
    return name.endswith("_") and not name.startswith("_")


# -- eager form and glue -----------------------------------------------------------------------
@dataclass(frozen=True)
class LowPrecision:
    """Runs a forward under torch.autocast and casts its low-precision outputs to float32."""

    dtype: torch.dtype
    autocast_eval: bool = True

    def call(self, module: nn.Module, forward, args: tuple, kwargs: dict) -> Any:
        if not (module.training or self.autocast_eval):
            return forward(*args, **kwargs)
        with torch.autocast(_device_type(module, args, kwargs), dtype=self.dtype):
            out = forward(*args, **kwargs)
        return tree_map_only(torch.Tensor, self._to_float32, out)

    def install(self, module: nn.Module) -> None:
        """Run `module`'s forward under this policy (see AutocastModule)."""
        with_mixin(module, AutocastModule).__dict__["_retarget_autocast"] = self

    def _to_float32(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.float() if tensor.dtype == self.dtype else tensor

    def eager_form(self, fallback: nn.Module):
        """Region.add_transform's eager_form: wraps a region's eager forward."""

        def wrap(forward):
            # The innermost callable is the module's bound forward; other forms may wrap it.
            module = getattr(inspect.unwrap(forward), "__self__", fallback)

            @functools.wraps(forward)
            def run(*args, **kwargs):
                return self.call(module, forward, args, kwargs)

            return run

        return wrap


class AutocastModule(nn.Module):
    """Mixin of a Linear/Conv leaf that runs under torch.autocast (see LowPrecision).

    While a region is being captured it runs as the plain module, so the graph records the
    user's computation and the graph rewrite decides the precision again.
    """

    _retarget_mixin = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if capturing():
            return super().forward(*args, **kwargs)
        policy = self.__dict__["_retarget_autocast"]
        return policy.call(self, super().forward, args, kwargs)


def _device_type(module: nn.Module, args: tuple, kwargs: dict) -> str:
    for leaf in tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf.device.type
    parameter = next(module.parameters(), None)
    return "cpu" if parameter is None else parameter.device.type


def _glue_leaves(program: Program) -> dict[str, nn.Module]:
    """Matmul-class leaf modules outside every region, by path."""
    covered = [path for region in program.regions for path in region.paths]
    if "" in covered:
        return {}
    glue = {}
    for path, module in program.module.named_modules():
        inside = any(path == c or path.startswith(c + ".") for c in covered)
        if not inside and _plain_leaf(module):
            glue[path] = module
    return glue
