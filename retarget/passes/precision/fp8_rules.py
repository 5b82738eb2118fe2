"""Which nn.Linear modules become FP8: a table of rules, each with a name and a reason.

The rules are checked in table order; the first one that applies keeps the Linear in high
precision and is what the report shows. A Linear no rule keeps is swapped.

`include` / `exclude` are fnmatch patterns matched against a Linear's full module path or any
dotted suffix of it (`lm_head`, `*.q_proj`, `mlp.*` and `model.layers.0.*` all work). Decision:
a Linear that an `include` pattern names skips the *heuristic* rules (tied to an embedding, first,
last, below min_size): naming a layer is the user's informed choice. It never skips the *hard*
rules: excluded, not included, not a plain Linear forward, forward never called, dims not
multiples of 16 (the GEMM cannot run), a non-float weight, already FP8.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
from torch import nn

#: Parents that read a child Linear's weight themselves instead of calling it.
READS_CHILD_WEIGHT = (nn.MultiheadAttention,)
FLOAT_WEIGHTS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, kw_only=True)
class EligibilityOptions:
    min_size: int = 1048576
    """Linears whose weight has fewer elements stay in high precision (FP8 costs more there)."""
    include: tuple[str, ...] = ()
    """If given, only Linears matching one of these patterns are swapped."""
    exclude: tuple[str, ...] = ()
    """Linears matching one of these patterns are never swapped."""


@dataclass(frozen=True)
class LinearFacts:
    """What the rules look at for one Linear."""

    path: str
    module: nn.Linear
    position: int
    """Index among the model's Linears in module order."""
    count: int
    tied_to: str | None
    """Path of the nn.Embedding whose weight this Linear shares."""
    called: bool | None
    """Whether its forward ran on the example inputs (None: no example inputs)."""
    parent: nn.Module | None

    def matches(self, patterns: tuple[str, ...]) -> str | None:
        """The first pattern naming this Linear's path or a dotted suffix of it."""
        return next((p for p in patterns if names(p, self.path)), None)


def names(pattern: str, path: str) -> bool:
    """Whether an include/exclude pattern names `path` (the full path or a dotted suffix)."""
    return fnmatchcase(path, pattern) or fnmatchcase(path, f"*.{pattern}")


def unused_patterns(patterns: tuple[str, ...], paths: list[str]) -> list[str]:
    """Patterns (fp8's include/exclude, quant's skip) that name none of `paths` (a typo, most
    likely)."""
    return [p for p in patterns if not any(names(p, path) for path in paths)]


@dataclass(frozen=True)
class Rule:
    name: str
    keeps: Callable[[LinearFacts, EligibilityOptions], bool]
    reason: Callable[[LinearFacts, EligibilityOptions], str]
    heuristic: bool = False
    """An include pattern that names the Linear overrides it."""


def _is_fp8(f: LinearFacts, o: EligibilityOptions) -> bool:
    cls = type(f.module)
    return bool(getattr(cls, "_retarget_fp8", False)) or cls.__module__.startswith("torchao.")


def _custom_forward(f: LinearFacts, o: EligibilityOptions) -> bool:
    return type(f.module).forward is not nn.Linear.forward and not _is_fp8(f, o)


def _weight_read_directly(f: LinearFacts, o: EligibilityOptions) -> bool:
    return isinstance(f.parent, READS_CHILD_WEIGHT) or f.called is False


def _not_multiple_of_16(f: LinearFacts, o: EligibilityOptions) -> bool:
    return f.module.in_features % 16 != 0 or f.module.out_features % 16 != 0


def _dims(f: LinearFacts) -> str:
    return f"in_features={f.module.in_features}, out_features={f.module.out_features}"


#: The eligibility table, in priority order.
RULES: tuple[Rule, ...] = (
    Rule("already_fp8", _is_fp8, lambda f, o: f"already an FP8 module ({type(f.module).__name__})"),
    Rule(
        "exclude",
        lambda f, o: f.matches(o.exclude) is not None,
        lambda f, o: f"matches exclude pattern '{f.matches(o.exclude)}'",
    ),
    Rule(
        "not_included",
        lambda f, o: bool(o.include) and f.matches(o.include) is None,
        lambda f, o: f"matches no include pattern ({', '.join(o.include)})",
    ),
    Rule(
        "custom_forward",
        _custom_forward,
        lambda f, o: f"{type(f.module).__name__} overrides Linear.forward; swapping would drop it",
    ),
    Rule(
        "weight_read_directly",
        _weight_read_directly,
        lambda f, o: (
            f"{type(f.parent).__name__} reads its weight directly"
            if isinstance(f.parent, READS_CHILD_WEIGHT)
            else "its forward never ran on the example inputs (its weight is used directly)"
        ),
    ),
    Rule(
        "dims_multiple_of_16",
        _not_multiple_of_16,
        lambda f, o: f"{_dims(f)}: FP8 GEMMs need both dimensions divisible by 16",
    ),
    Rule(
        "float_weight",
        lambda f, o: f.module.weight.dtype not in FLOAT_WEIGHTS,
        lambda f, o: f"weight dtype {f.module.weight.dtype} is not float32/bfloat16/float16",
    ),
    Rule(
        "tied_embedding",
        lambda f, o: f.tied_to is not None,
        lambda f, o: f"weight is tied to embedding '{f.tied_to}' (an lm_head)",
        heuristic=True,
    ),
    Rule(
        "first",
        lambda f, o: f.position == 0,
        lambda f, o: "first Linear of the model (the input projection is FP8-sensitive)",
        heuristic=True,
    ),
    Rule(
        "last",
        lambda f, o: f.position == f.count - 1,
        lambda f, o: "last Linear of the model (the output projection is FP8-sensitive)",
        heuristic=True,
    ),
    Rule(
        "min_size",
        lambda f, o: f.module.weight.numel() < o.min_size,
        lambda f, o: f"weight has {f.module.weight.numel():,} elements < min_size={o.min_size:,}",
        heuristic=True,
    ),
)


@dataclass(frozen=True)
class Decision:
    """One Linear's verdict: swapped, or the rule that kept it and why."""

    path: str
    swapped: bool
    rule: str | None = None
    reason: str = ""

    def to_dict(self) -> dict[str, object]:
        return {"swapped": self.swapped, "rule": self.rule, "reason": self.reason}


def decide(facts: LinearFacts, options: EligibilityOptions) -> Decision:
    """Apply the table to one Linear."""
    included = bool(options.include) and facts.matches(options.include) is not None
    for rule in RULES:
        if rule.heuristic and included:
            continue
        if rule.keeps(facts, options):
            return Decision(facts.path, False, rule.name, rule.reason(facts, options))
    return Decision(facts.path, True)


def linear_facts(root: nn.Module, called: set[str] | None = None) -> list[LinearFacts]:
    """Facts about every nn.Linear under `root`, in module order (each module once)."""
    embeddings = {
        id(m.weight): path for path, m in root.named_modules() if isinstance(m, nn.Embedding)
    }
    linears = [(p, m) for p, m in root.named_modules() if isinstance(m, nn.Linear)]
    facts = []
    for position, (path, module) in enumerate(linears):
        parent_path = path.rpartition(".")[0]
        facts.append(
            LinearFacts(
                path=path,
                module=module,
                position=position,
                count=len(linears),
                tied_to=embeddings.get(id(module.weight)),
                called=None if called is None else path in called,
                parent=root.get_submodule(parent_path) if path else None,
            )
        )
    return facts


def decide_all(
    root: nn.Module, options: EligibilityOptions, called: set[str] | None = None
) -> list[Decision]:
    """The table applied to every Linear of `root`, in module order."""
    return [decide(facts, options) for facts in linear_facts(root, called)]
