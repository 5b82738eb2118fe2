"""Which nn.Linear modules get quantized weights: a table of rules, each with a name and a reason.

The rules are checked in table order; the first that applies keeps the Linear as it is and is
what the report shows. A Linear no rule keeps is quantized. The defaults follow what QLoRA and
Accelerate's bitsandbytes loading do: the output head (the model's output embeddings, or the
last Linear) and any weight tied to an embedding stay in high precision, adapters (a Linear
under a PEFT tuner layer, other than its `base_layer`) are what trains and are never touched.
`skip` patterns are matched like fp8's include/exclude (the full path or a dotted suffix).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from retarget.kernels.quant.linear import QuantizedLinear
from retarget.passes.precision.fp8_rules import (
    FLOAT_WEIGHTS,
    READS_CHILD_WEIGHT,
    LinearFacts,
    names,
)
from retarget.passes.precision.fp8_rules import linear_facts as _linear_facts


@dataclass(frozen=True, kw_only=True)
class QuantEligibility:
    skip: tuple[str, ...] = ()
    """Linears matching one of these patterns are never quantized."""
    head: str | None = None
    """Path of the model's output head (its output embeddings), when the model says."""
    adapters: frozenset[str] = frozenset()
    """Paths of Linears inside PEFT tuner layers other than their base layers."""
    element_multiple: int = 1
    """The backend's kernel needs a weight's element count to be a multiple of this (torchao's
    nf4: block_size x 256, its blocks of block scales); 1: any size."""


@dataclass(frozen=True)
class Rule:
    name: str
    keeps: Callable[[LinearFacts, QuantEligibility], bool]
    reason: Callable[[LinearFacts, QuantEligibility], str]


def _skip_pattern(f: LinearFacts, o: QuantEligibility) -> str | None:
    return next((p for p in o.skip if names(p, f.path)), None)


def _is_head(f: LinearFacts, o: QuantEligibility) -> bool:
    return f.path == o.head if o.head is not None else f.position == f.count - 1


#: The table, in priority order.
RULES: tuple[Rule, ...] = (
    Rule(
        "already_quantized",
        lambda f, o: isinstance(f.module, QuantizedLinear),
        lambda f, o: f"already quantized ({f.module.layout.format})",
    ),
    Rule(
        "skip",
        lambda f, o: _skip_pattern(f, o) is not None,
        lambda f, o: f"matches skip pattern '{_skip_pattern(f, o)}'",
    ),
    Rule(
        "adapter",
        lambda f, o: f.path in o.adapters,
        lambda f, o: "an adapter of a PEFT layer (it trains; its base layer is quantized)",
    ),
    Rule(
        "custom_forward",
        lambda f, o: type(f.module).forward is not nn.Linear.forward,
        lambda f, o: f"{type(f.module).__name__} overrides Linear.forward; swapping would drop it",
    ),
    Rule(
        "weight_read_directly",
        lambda f, o: isinstance(f.parent, READS_CHILD_WEIGHT) or f.called is False,
        lambda f, o: (
            f"{type(f.parent).__name__} reads its weight directly"
            if isinstance(f.parent, READS_CHILD_WEIGHT)
            else "its forward never ran on the example inputs (its weight is used directly)"
        ),
    ),
    Rule(
        "float_weight",
        lambda f, o: f.module.weight.dtype not in FLOAT_WEIGHTS,
        lambda f, o: f"weight dtype {f.module.weight.dtype} is not float32/bfloat16/float16",
    ),
    Rule(
        "tied_embedding",
        lambda f, o: f.tied_to is not None,
        lambda f, o: (
            f"weight is tied to embedding '{f.tied_to}': quantizing it would change "
            "the embedding too"
        ),
    ),
    Rule(
        "output_head",
        _is_head,
        lambda f, o: (
            "the model's output head (kept in high precision, as QLoRA does)"
            if o.head is not None
            else "the last Linear of the model (taken as its output head)"
        ),
    ),
    Rule(
        "kernel_size",
        lambda f, o: f.module.weight.numel() % o.element_multiple != 0,
        lambda f, o: (
            f"{f.module.weight.numel()} weight elements are not a multiple of "
            f"{o.element_multiple}, which the backend's format needs"
        ),
    ),
)


@dataclass(frozen=True)
class QuantDecision:
    """One Linear's verdict: quantized, or the rule that kept it and why."""

    path: str
    quantized: bool
    rule: str | None = None
    reason: str = ""

    def to_dict(self) -> dict[str, object]:
        return {"quantized": self.quantized, "rule": self.rule, "reason": self.reason}


def decide(facts: LinearFacts, options: QuantEligibility) -> QuantDecision:
    for rule in RULES:
        if rule.keeps(facts, options):
            return QuantDecision(facts.path, False, rule.name, rule.reason(facts, options))
    return QuantDecision(facts.path, True)


def decide_all(
    root: nn.Module,
    skip: tuple[str, ...],
    called: set[str] | None = None,
    element_multiple: int = 1,
) -> list[QuantDecision]:
    """The table applied to every nn.Linear of `root`, in module order."""
    options = QuantEligibility(
        skip=skip,
        head=output_head(root),
        adapters=adapter_paths(root),
        element_multiple=element_multiple,
    )
    return [decide(facts, options) for facts in _linear_facts(root, called)]


def output_head(root: nn.Module) -> str | None:
    """The path of the model's output embeddings (HF's get_output_embeddings), if it says."""
    getter = getattr(root, "get_output_embeddings", None)
    try:
        head = getter() if callable(getter) else None
    except (AttributeError, NotImplementedError, TypeError):
        return None
    if not isinstance(head, nn.Module):
        return None
    return next((path for path, m in root.named_modules() if m is head), None)


def adapter_paths(root: nn.Module) -> frozenset[str]:
    """Linears under a PEFT tuner layer (a module with a `base_layer`), other than the base."""
    found = set()
    for path, module in root.named_modules():
        base = getattr(module, "base_layer", None)
        if not isinstance(base, nn.Module):
            continue
        for sub, child in module.named_modules(prefix=path):
            if isinstance(child, nn.Linear) and child is not base and sub != path:
                found.add(sub)
    return frozenset(found)


__all__ = ["QuantDecision", "RULES", "decide_all"]
