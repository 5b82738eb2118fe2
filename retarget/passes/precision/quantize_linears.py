"""quantize_linears: swap eligible nn.Linear modules for frozen 4/8-bit quantized ones (QLoRA).

Contract: requires regions, shapes | provides quant | after - | numerics approx(rtol=0.1, atol=0.1)
    | options QuantizeOptions

1. Decide per Linear with the rule table (`quant_rules.py`, beside this pass): quantized, or the
   rule that kept it and why (output head, tied weights, PEFT adapters, `skip=` patterns, ...).
   The report lists every Linear (`program.analysis.quant`).
2. Check the backend before touching anything: `native` (retarget.kernels.quant, torch ops on any
   device, nf4 / fp4 / int8), or `torchao` (kernels/quant/torchao_linear.py: torchao's NF4Tensor
   and Int8Tensor; its nf4 always quantizes the block scales, and needs a weight's element
   count to be a multiple of block_size x 256, x the ranks under fsdp, which the rule table
   checks). FSDP2 shards nf4 weights through NF4Tensor's own FSDP hooks (fsdp, zero3, zero2).
   Or `bnb` (kernels/quant/bnb_linear.py: bitsandbytes' 4-bit and LLM.int8 formats and
   matmuls, an optional package, in one process only). Refused by name, before anything is
   swapped: what torchao cannot do here (fp4, int8 under fsdp: Int8Tensor has no split,
   ddp/zero1/hsdp), bnb under any strategy but single, a block size bitsandbytes lacks.
3. Swap in the structural copy (`program.module`): a QuantizedLinear at the Linear's path, its
   weight one frozen packed buffer stored in the dtype FSDP2 gathers in (bf16/fp16 under
   fsdp+bf16/fp16, else the weight's dtype), computed in `compute` (auto: the target's bf16/fp16,
   else the input's dtype). The bias stays the same Parameter. state_dict keys do not change
   (`<path>.weight` holds the packed buffer); `unwrap()` (and save_model) give the original
   model back with the dequantized weights.
4. Route region graphs through the swapped modules, as swap_fp8 does (`route_regions`): each
   `linear(x, <get_attr P.weight>, ...)` of a quantized P becomes `call_module P`.
5. Release the user model's replaced weights (`core.modules.release_replaced`): the full-size
   weights would otherwise stay pinned beside the quantized ones and the memory saving would
   not exist. unwrap() fills them again.

A model with PEFT adapters keeps them trainable (they are never quantized); a model with no
trainable parameter left gets a warning (quant freezes what it quantizes: add adapters).

    compile_for(peft_model, "quant[bits=4,double_quant=true]", example_inputs=batch)
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from retarget.core.errors import TargetNotSupportedError
from retarget.core.modules import release_replaced
from retarget.ir.program import Program
from retarget.kernels.quant.bnb_linear import BNB_BLOCK_SIZES, BnbLinear, bnb_api
from retarget.kernels.quant.formats import BITS, QuantLayout
from retarget.kernels.quant.linear import QuantizedLinear
from retarget.kernels.quant.torchao_linear import NF4_SCALER_BLOCK, TorchaoLinear, torchao_api
from retarget.passes.base import Numerics, Pass, PassResult, coerce_options
from retarget.passes.precision.fp8_rules import unused_patterns
from retarget.passes.precision.quant_rules import QuantDecision, decide_all
from retarget.passes.precision.swap_fp8 import called_paths, compress_paths, route_regions
from retarget.targets.grammar import PARTS, Target
from retarget.targets.precisions import LOW_DTYPES
from retarget.targets.strategies import FSDP_STRATEGIES

_SCHEMA = PARTS["quant"].options
_COMPUTE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: The strategies that may shard torchao's nf4 weights (FSDP2 over the whole world: NF4Tensor's
#: own FSDP hooks gather it).
TORCHAO_SHARDED = ("fsdp", "zero3", "zero2")


def _default(key: str) -> Any:
    return _SCHEMA[key].default


@dataclass(frozen=True, kw_only=True)
class QuantizeOptions:
    """The options of `quant[...]`; defaults come from the target schema."""

    bits: str = _default("bits")
    """4 | 8."""
    type: str = _default("type")
    """auto (nf4 for 4 bits, int8 for 8) | nf4 | fp4 | int8."""
    backend: str = _default("backend")
    """auto | native | bnb | torchao."""
    compute: str = _default("compute")
    """auto | bf16 | fp16 | fp32: the dtype of the dequantized matmul."""
    double_quant: bool = _default("double_quant")
    """4-bit: the block scales as int8 too."""
    block_size: int = _default("block_size")
    """4-bit: weights per scale block."""
    skip: tuple[str, ...] = _default("skip")
    """Never quantize Linears matching one of these patterns."""
    precision: str | None = None
    """bf16 | fp16 when the target has one (the compute dtype of `compute=auto`)."""
    fsdp: bool = False
    """Whether FSDP2 shards the model (the storage dtype is then the one it gathers in)."""
    strategy: str = "single"
    """The target's strategy (what replicates or shards the quantized weights)."""
    compiled: bool = False
    """Whether the target compiles the blocks (torchao's nf4 breaks their graphs)."""

    def __post_init__(self) -> None:
        coerce_options(self, _SCHEMA, "quantize_linears")

    @classmethod
    def from_target(cls, target: Target) -> QuantizeOptions:
        part = target.get("quant")
        values = part.as_dict() if part is not None else {}
        precision = next((p for p in ("bf16", "fp16") if p in target), None)
        fsdp = any(name in target for name in FSDP_STRATEGIES)
        return cls(
            **values,
            precision=precision,
            fsdp=fsdp,
            strategy=target.strategy,
            compiled="compile" in target,
        )

    @property
    def format(self) -> str:
        if self.type != "auto":
            return self.type
        return "nf4" if self.bits == "4" else "int8"

    def compute_dtype(self) -> torch.dtype | None:
        if self.compute != "auto":
            return _COMPUTE[self.compute]
        return LOW_DTYPES[self.precision] if self.precision else None

    def storage_dtype(self, weight: torch.Tensor) -> torch.dtype:
        if self.fsdp and self.precision:
            return LOW_DTYPES[self.precision]
        return weight.dtype


class QuantizeLinears(Pass):
    name = "quantize_linears"
    summary = "swap eligible nn.Linear modules for frozen 4/8-bit quantized ones"
    requires = ("regions", "shapes")
    provides = ("quant",)
    # Outputs of the zoo's tiny random models move by up to ~6% under nf4 (int8: < 1%).
    numerics = Numerics("approx", rtol=0.1, atol=0.1)
    Options = QuantizeOptions

    @classmethod
    def stage(cls, target: Target) -> list[Pass]:
        """The pipeline's quant stage: this pass when the target has a quant part."""
        return [cls(QuantizeOptions.from_target(target))] if "quant" in target else []

    def run(self, program: Program) -> PassResult:
        if program.analysis.quant is not None:  # a second run: every Linear is decided
            return PassResult(changed=False, notes=("already quantized",))
        options = self.options
        backend = "native" if options.backend == "auto" else options.backend
        if backend == "bnb":
            _check_bnb(options, program)
        multiple = _check_torchao(options, program) if backend == "torchao" else 1
        decisions = decide_all(program.module, options.skip, called_paths(program), multiple)
        chosen = [d.path for d in decisions if d.quantized]
        layouts = {path: self._layout(program.submodule(path)) for path in chosen}
        report = program.analysis.quant = {
            "backend": backend,
            "format": options.format,
            "bits": BITS[options.format],
            "double_quant": self._double_quant(backend),
            "linears": {d.path: d.to_dict() for d in decisions},
        }
        stats: dict[str, Any] = {"backend": backend, "linears": len(decisions)}
        stats["quantized"] = len(chosen)
        stats["kept"] = dict(Counter(d.rule for d in decisions if not d.quantized))
        kept_notes = _kept_notes(decisions, options.skip)
        if not chosen:
            what = "no eligible Linear" if decisions else "the model has no nn.Linear"
            return PassResult(False, stats, (f"{what}: nothing quantized", *kept_notes))
        before = after = 0
        compute = options.compute_dtype()
        stored: set[str] = set()
        for path in chosen:
            linear = program.submodule(path)
            weight = linear.weight
            swapped: QuantizedLinear
            if backend == "torchao":
                swapped = TorchaoLinear(linear, layouts[path], compute_dtype=compute)
                stored.add(f"torchao's {type(swapped.weight).__name__}")
            elif backend == "bnb":
                swapped = BnbLinear(linear, layouts[path], compute_dtype=compute)
                stored.add("bitsandbytes' sections in one uint8 buffer")
            else:
                swapped = QuantizedLinear(
                    linear,
                    layouts[path],
                    storage_dtype=options.storage_dtype(weight),
                    compute_dtype=compute,
                )
                stored.add(_dtype_name(swapped.weight.dtype))
            program.module.set_submodule(path, swapped)
            before += weight.numel() * weight.element_size()
            after += swapped.quantized_bytes()
            report["linears"][path].update(bytes=swapped.quantized_bytes(), format=options.format)
        report["weight_bytes"] = {"before": before, "after": after}
        released = release_replaced(program.original, program.module)
        calls = route_regions(self.name, program, set(chosen))
        stats["graph_module_calls"] = sum(calls.values())
        stats["ratio"] = round(after / before, 4)
        trainable = sum(p.numel() for p in program.module.parameters() if p.requires_grad)
        notes = [
            f"{options.format} ({BITS[options.format]} bits) by the {backend} backend, compute "
            f"in {_dtype_name(compute)}, stored as {', '.join(sorted(stored))}",
            f"quantized {len(chosen)} of {len(decisions)} Linears: {compress_paths(chosen)}",
            f"their weights: {before:,} bytes -> {after:,} ({after / before:.3f}x); "
            f"{released} full-size weights of the original model released",
            *kept_notes,
            *(
                ["torchao's nf4 quantizes its block scales too (double_quant), asked or not"]
                if backend == "torchao" and options.format == "nf4" and not options.double_quant
                else []
            ),
            *(
                f"region {name}: {n} calls now run the quantized modules"
                for name, n in calls.items()
            ),
        ]
        if backend == "torchao" and options.format == "nf4" and options.compiled:
            message = (
                "quant[backend=torchao,type=nf4] under compile: dynamo cannot trace torchao's "
                "NF4 matmul, so each block's graph breaks at every quantized Linear (the "
                "report's compile line counts them); backend=native or bnb compile each block "
                "whole"
            )
            warnings.warn(message, stacklevel=2)
            notes.append(message)
        if trainable == 0:
            message = (
                "quant froze every quantized weight and no parameter is trainable any more: "
                "add adapters (e.g. peft.get_peft_model with a LoraConfig) before compile_for "
                "to fine-tune, or use the model for inference"
            )
            warnings.warn(message, stacklevel=2)
            notes.append(message)
        return PassResult(True, stats, tuple(notes))

    def _double_quant(self, backend: str) -> bool:
        """Whether the block scales are quantized too: as asked, and always by torchao's nf4."""
        options = self.options
        if backend == "torchao" and options.format == "nf4":
            return True
        return options.double_quant and BITS[options.format] == 4

    def _layout(self, linear: nn.Linear) -> QuantLayout:
        options = self.options
        backend = "native" if options.backend == "auto" else options.backend
        return QuantLayout(
            options.format,
            (linear.out_features, linear.in_features),
            options.block_size,
            self._double_quant(backend),
        )


def _check_torchao(options: QuantizeOptions, program: Program) -> int:
    """Refuse what backend=torchao cannot do here (before anything is swapped); the element
    count its format needs a weight to be a multiple of."""
    where = f"quant[backend=torchao,type={options.format}]"
    if options.format not in ("nf4", "int8"):
        raise TargetNotSupportedError(
            f"{where}: torchao has no {options.format} weight-only format here; use type=nf4 "
            "or int8, or backend=native (which has fp4)"
        )
    strategy = options.strategy
    sharded = strategy in TORCHAO_SHARDED
    if strategy != "single" and not (sharded and options.format == "nf4"):
        why = (
            "torchao's Int8Tensor has no split for FSDP2 to shard it by; use type=nf4"
            if sharded
            else "replicating or sharding torchao's tensor subclasses that way (DDP's "
            "broadcast and buckets, hsdp's 2-D mesh) is not wired in; use fsdp"
        )
        raise TargetNotSupportedError(
            f"{where} with {strategy}: {why}, or backend=native, whose packed weights are "
            "plain tensors every strategy handles"
        )
    try:
        torchao_api()
    except ImportError as error:
        raise TargetNotSupportedError(str(error)) from error
    if options.format != "nf4":
        return 1
    # NF4Tensor's FSDP2 split divides its blocks of block scales among the ranks.
    shards = program.world.size if sharded else 1
    return options.block_size * NF4_SCALER_BLOCK * shards


def _check_bnb(options: QuantizeOptions, program: Program) -> None:
    """Refuse what backend=bnb cannot do here, before anything is swapped."""
    where = f"quant[backend=bnb,type={options.format}]"
    strategy = options.strategy
    if strategy != "single":
        raise TargetNotSupportedError(
            f"{where} with {strategy}: sharding or replicating bitsandbytes' quantized weights "
            "is not wired in; use backend=native (packed plain tensors every strategy "
            "handles) or, under fsdp, backend=torchao"
        )
    if BITS[options.format] == 4 and options.block_size not in BNB_BLOCK_SIZES:
        raise TargetNotSupportedError(
            f"{where}: block_size={options.block_size} is not one of bitsandbytes' block sizes "
            f"{list(BNB_BLOCK_SIZES)}; pick one of them, or use backend=native"
        )
    try:
        bnb_api()
    except ImportError as error:
        raise TargetNotSupportedError(str(error)) from error


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "the input's dtype" if dtype is None else str(dtype).removeprefix("torch.")


def _kept_notes(decisions: list[QuantDecision], skip: tuple[str, ...]) -> list[str]:
    by_rule: dict[str, list[str]] = {}
    for d in decisions:
        if not d.quantized:
            by_rule.setdefault(d.rule, []).append(d.path)
    notes = [f"kept by '{rule}': {compress_paths(paths)}" for rule, paths in by_rule.items()]
    for pattern in unused_patterns(skip, [d.path for d in decisions]):
        notes.append(f"skip pattern '{pattern}' names no Linear of this model")
    return notes
