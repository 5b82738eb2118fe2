"""The target schema: every part name, its options (type, default, allowed values, doc), the
conflict rules between parts, and how option values are read and printed.

Tables, not if-chains: `retarget.target.grammar` parses specs against them and `accelerate_config`
maps Accelerate's keys onto them.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from itertools import combinations
from typing import Any

from retarget.target.strategies import DDP_STRATEGIES, FSDP_STRATEGIES, STRATEGIES, STRATEGY


@dataclass(frozen=True)
class Option:
    """One option of a part. ``kind`` is bool, int, float, enum, name, list, bools or budget."""

    kind: str
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    low: float | None = None
    high: float | None = None
    strict: bool = False  # bounds are exclusive
    length: int | None = None  # fixed length of a "bools" list

    def coerce(self, value: Any) -> Any:
        """``value`` (spec text or a Python value) in canonical form; ValueError says why not."""
        return _COERCE[self.kind](self, value)


@dataclass(frozen=True)
class PartSchema:
    """What a part does and the options it takes."""

    doc: str
    options: Mapping[str, Option] = field(default_factory=dict)


def _bool(default: bool, doc: str) -> Option:
    return Option("bool", default, doc)


def _int(default: int, doc: str, low: int = 0) -> Option:
    return Option("int", default, doc, low=low)


def _float(default: float, doc: str, low: float, high: float | None = None, strict=True) -> Option:
    return Option("float", default, doc, low=low, high=high, strict=strict)


def _enum(default: str, choices: str, doc: str) -> Option:
    return Option("enum", default, doc, tuple(choices.split("|")))


def _list(default: str, choices: str, doc: str) -> Option:
    chosen = tuple(sorted(default.split("|"))) if default else ()
    return Option("list", chosen, doc, tuple(choices.split("|")) if choices else ())


_DDP = {
    "bucket_cap_mb": _int(25, "gradient bucket size in MiB for the all-reduce", low=1),
    "find_unused_parameters": _bool(False, "tolerate parameters that get no gradient in a step"),
    "static_graph": _bool(False, "the set of used parameters never changes between steps"),
    "gradient_as_bucket_view": _bool(False, "gradients are views into the buckets (less memory)"),
    "broadcast_buffers": _bool(True, "broadcast buffers (BatchNorm stats) from rank 0 in forward"),
}
_FSDP_COMMON = {
    "min_params": _int(0, "blocks with fewer parameters are not their own FSDP unit"),
    "cpu_ram_efficient_loading": _bool(False, "only rank 0 loads weights; the others get a copy"),
    "state_dict": _enum("sharded", "full|sharded", "state_dict(): full tensors or shards"),
    "sync_module_states": _bool(True, "broadcast rank 0's parameters and buffers when wrapping"),
}
_FSDP = {"reshard": _bool(True, "free gathered parameters after forward (false: zero2)")}
_FSDP.update(_FSDP_COMMON)
_AUTOCAST = {
    "keep_fp32": _list(
        "softmax|norm|loss",
        "softmax|norm|loss|exp|log|pow|reduce|cumsum",
        "op families kept in float32 inside autocast regions",
    ),
    "autocast_eval": _bool(True, "autocast in eval mode too"),
}
_SIZE_UNITS = {"TiB": 2**40, "TB": 10**12, "GiB": 2**30, "GB": 10**9, "MiB": 2**20, "MB": 10**6}
_SIZE_UNITS.update({"KiB": 2**10, "KB": 10**3, "B": 1})
_MIN_BUDGET_BYTES = 10**6

# The table of parts, in canonical order: str(target) lists parts in this order.
PARTS: dict[str, PartSchema] = {
    "single": PartSchema("one process, no distribution"),
    "ddp": PartSchema("replicate parameters, all-reduce gradients (DistributedDataParallel)", _DDP),
    "fsdp": PartSchema("shard parameters, gradients and optimizer state (FSDP2, ZeRO-3)", _FSDP),
    "zero1": PartSchema("ddp plus optimizer-state sharding (ZeRO-1)", _DDP),
    "zero2": PartSchema("fsdp keeping parameters gathered from forward to backward", _FSDP_COMMON),
    "zero3": PartSchema("fsdp under its DeepSpeed name", _FSDP_COMMON),
    "hsdp": PartSchema(
        "shard within a group of processes, replicate across groups",
        {
            "replicate": _int(0, "number of replica groups; 0: one per node"),
            "shard": _int(0, "processes per shard group; 0: processes per node"),
            **_FSDP,
        },
    ),
    "tp": PartSchema(
        "tensor parallelism over Linear layers",
        {
            "size": _int(0, "tensor-parallel degree; 0: the world, or what data parallel leaves"),
            "plan": _enum("auto", "auto", "how layers are split; auto: colwise then rowwise pairs"),
            "sequence_parallel": _bool(False, "also shard norms and dropout along the sequence"),
        },
    ),
    "xla": PartSchema("XLA devices", {"spmd": _bool(True, "shard with XLA SPMD")}),
    "bf16": PartSchema(
        "bfloat16 autocast",
        {**_AUTOCAST, "downcast": _bool(False, "XLA: store float32 as bf16 (downcast_bf16)")},
    ),
    "fp16": PartSchema(
        "float16 autocast with a dynamic loss scaler",
        {
            **_AUTOCAST,
            "init_scale": _float(65536.0, "initial loss scale", low=0),
            "growth_factor": _float(2.0, "scale multiplier after growth_interval good steps", 1),
            "backoff_factor": _float(0.5, "scale multiplier after an overflow", low=0, high=1),
            "growth_interval": _int(2000, "overflow-free steps before the scale grows", low=1),
        },
    ),
    "fp8": PartSchema(
        "float8 matmuls in Linear layers (the rest runs in bf16 when bf16 is given)",
        {
            "backend": _enum("auto", "auto|native|torchao|te|msamp", "fp8 implementation"),
            "format": _enum("hybrid", "hybrid|e4m3", "hybrid: e4m3 forward, e5m2 gradients"),
            "scaling": _enum("delayed", "delayed|current|rowwise", "how scales are computed"),
            "amax_history": _int(16, "length of the amax history (delayed scaling)", low=1),
            "amax_algo": _enum("most_recent", "max|most_recent", "scale from the amax history"),
            "margin": _int(0, "margin of the scale, as a power of two"),
            "interval": _int(1, "steps between scale updates", low=1),
            "min_size": _int(1048576, "Linears whose weight has fewer elements are not swapped"),
            "include": _list("", "", "swap only Linears whose name matches a pattern (fnmatch)"),
            "exclude": _list("", "", "never swap Linears whose name matches, e.g. lm_head"),
            "override_linear_precision": Option(
                "bools", (False,) * 3, "fprop|dgrad|wgrad GEMMs in high precision (te)", length=3
            ),
            "autocast_eval": _bool(False, "fp8 in eval mode too (te's use_autocast_during_eval)"),
            "opt_level": _enum("o2", "o1|o2", "MS-AMP optimisation level"),
        },
    ),
    "ac": PartSchema(
        "activation checkpointing of repeated blocks",
        {
            "policy": _enum("full", "full|selective|budget", "recompute blocks, ops, or by budget"),
            "every": _int(1, "checkpoint every n-th block", low=1),
            "budget": Option("budget", None, "activations to keep: a fraction or a size (8GiB)"),
        },
    ),
    "offload": PartSchema(
        "keep sharded state in CPU memory",
        {
            "params": _bool(True, "parameters and their gradients live on the CPU between uses"),
            "optimizer": _bool(True, "optimizer state lives on the CPU, which runs the step"),
            "pin_memory": _enum("auto", "auto|true|false", "pin the CPU copies"),
        },
    ),
    "compile": PartSchema(
        "torch.compile",
        {
            "backend": Option("name", "inductor", "torch.compile backend"),
            "mode": _enum(
                "default",
                "default|reduce-overhead|max-autotune|max-autotune-no-cudagraphs",
                "torch.compile mode",
            ),
            "fullgraph": _bool(False, "fail on graph breaks instead of splitting"),
            "dynamic": _enum("auto", "auto|true|false", "dynamic shapes: auto, always or never"),
            "regional": _bool(False, "compile one repeated block and reuse it (regional compile)"),
        },
    ),
    "powersgd": PartSchema(
        "PowerSGD low-rank gradient compression (DDP comm hook)",
        {
            "rank": _int(1, "rank of the gradient approximation", low=1),
            "start_iter": _int(10, "plain all-reduce for this many steps first"),
            "min_compression_rate": _float(2.0, "compress only above this rate", 1, strict=False),
            "wrapper": _enum("none", "none|fp16|bf16", "also cast to this dtype (comm_wrapper)"),
            "error_feedback": _bool(True, "carry the compression error to the next step"),
            "warm_start": _bool(True, "reuse last step's factors as the starting point"),
        },
    ),
    "fp16-comm": PartSchema("all-reduce gradients in float16 (DDP comm hook)"),
    "bf16-comm": PartSchema("all-reduce gradients in bfloat16 (DDP comm hook)"),
}
_ORDER = {name: i for i, name in enumerate(PARTS)}

_HOOK_CLASH = "are both DDP comm hooks and DDP takes one; use powersgd[wrapper={}]"
# Pairs of parts that cannot be combined, with the reason.
_CONFLICTS: dict[frozenset[str], str] = {
    **{
        frozenset((a, b)): f"'{a}' and '{b}' are both distribution strategies; pick one "
        f"({a} {STRATEGY[a].does}, {b} {STRATEGY[b].does})"
        for a, b in combinations(STRATEGIES, 2)
    },
    **{
        frozenset((s, "tp")): f"'{s}' and 'tp' do not combine: tensor parallelism composes "
        "with sharded data parallel only, and no pass implements 'tp' yet; to split a model "
        "too large for one process, use 'fsdp'"
        for s in ("single", "ddp", "zero1")
    },
    frozenset(("bf16", "fp16")): "'bf16' and 'fp16' are both autocast dtypes; pick one "
    "(bf16 needs no loss scaling)",
    frozenset(("fp16", "fp8")): "'fp16' and 'fp8' do not combine: fp8 runs the other ops in "
    "bf16; use bf16+fp8",
    frozenset(("fp16-comm", "bf16-comm")): "'fp16-comm' and 'bf16-comm' both cast gradients "
    "for the all-reduce; pick one",
    frozenset(("powersgd", "fp16-comm")): "'powersgd' and 'fp16-comm' "
    + _HOOK_CLASH.format("fp16"),
    frozenset(("powersgd", "bf16-comm")): "'powersgd' and 'bf16-comm' "
    + _HOOK_CLASH.format("bf16"),
}
# Parts that combine only with the listed ones.
_ONLY_WITH = {
    "xla": (
        ("bf16",),
        "XLA compiles and distributes the whole program, and no pass implements 'xla' yet; "
        "drop 'xla' to run on this process's device",
    )
}
_HOOK_NEEDS = (DDP_STRATEGIES, "comm hooks change DDP's gradient all-reduce")
# Parts that need one of the listed parts.
_NEEDS_ONE_OF = {
    "offload": (FSDP_STRATEGIES, "offload moves sharded state to the CPU"),
    "powersgd": _HOOK_NEEDS,
    "fp16-comm": _HOOK_NEEDS,
    "bf16-comm": _HOOK_NEEDS,
}
# (part, option, values that trigger the rule, parts of which one must be present, why)
_OPTION_NEEDS_PART = (
    (
        "bf16",
        "downcast",
        (True,),
        ("xla",),
        "it is XLA's XLA_DOWNCAST_BF16, and no pass implements 'xla' yet; drop downcast",
    ),
)
# (part, option, trigger values or None for "set", needed option, allowed values or None for
# "set", why): rules between the options of one part.
_OPTION_RULES: tuple[tuple[str, str, Any, str, Any, str], ...] = (
    ("fp8", "scaling", ("rowwise",), "backend", ("torchao", "native"), "only they scale per row"),
    ("fp8", "opt_level", None, "backend", ("msamp",), "it is an MS-AMP setting"),
    (
        "fp8",
        "override_linear_precision",
        None,
        "backend",
        ("auto", "te", "native"),
        "it is a TE recipe setting, which te and native implement",
    ),
    *(
        ("fp8", key, None, "scaling", ("delayed",), "only delayed scaling keeps an amax history")
        for key in ("amax_history", "amax_algo")
    ),
    ("ac", "budget", None, "policy", ("budget",), "a budget applies to policy=budget only"),
    ("ac", "policy", ("budget",), "budget", None, "write e.g. ac[budget=0.5] or ac[budget=8GiB]"),
    ("offload", "params", (False,), "optimizer", (True,), "otherwise nothing is offloaded"),
)
# Defaults that depend on another option: (part, option) -> (when this option is set, default).
_IMPLIED = {("ac", "policy"): ("budget", "budget")}
# Words that are not part names but whose meaning has one, for suggestions.
_NAME_HINTS = dict(
    pair.split(":")
    for pair in "fsdp1:fsdp fsdp2:fsdp float8:fp8 bfloat16:bf16 float16:fp16 half:fp16"
    " checkpoint:ac activation_checkpointing:ac dynamo:compile torch_compile:compile"
    " cpu_offload:offload tensor_parallel:tp hybrid_shard:hsdp dp:ddp no:single none:single".split()
)


def _suggest(word: str, choices: Iterable[str], hints: Mapping[str, str] | None = None) -> str:
    choices = list(choices)
    close = [hints[word]] if hints and word in hints else []
    close = close or difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; expected one of: {', '.join(choices)}"


def _in(where: str | None) -> str:
    return f" in {where!r}" if where else ""


_BOOL_WORDS = {"true": True, "yes": True, "on": True, "1": True}
_BOOL_WORDS.update({"false": False, "no": False, "off": False, "0": False})
_INT_RE = re.compile(r"[+-]?[0-9]+", re.ASCII)
_FLOAT_RE = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)(e[+-]?[0-9]+)?", re.ASCII | re.I)
_NAME_VALUE_RE = re.compile(r"[a-z0-9_.:-]+", re.ASCII)
_PATTERN_RE = re.compile(r"[A-Za-z0-9_.*?]+", re.ASCII)
_BUDGET_RE = re.compile(
    r"(?P<num>([0-9]+\.?[0-9]*|\.[0-9]+)(e[+-]?[0-9]+)?)\s*(?P<unit>[kmgt]i?b|b)?", re.ASCII | re.I
)
_UNIT_BY_LOWER = {unit.lower(): unit for unit in _SIZE_UNITS}


def _to_bool(opt: Option, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _BOOL_WORDS:
        return _BOOL_WORDS[value.strip().lower()]
    raise ValueError("expected true or false")


def _check_range(opt: Option, value: float) -> None:
    op = ">" if opt.strict else ">="
    if opt.low is not None and (value < opt.low or (opt.strict and value == opt.low)):
        raise ValueError(f"must be {op} {opt.low:g}")
    if opt.high is not None and (value > opt.high or (opt.strict and value == opt.high)):
        raise ValueError(f"must be {op.replace('>', '<')} {opt.high:g}")


def _to_int(opt: Option, value: Any) -> int:
    if isinstance(value, str) and _INT_RE.fullmatch(value.strip()):
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("expected an integer")
    _check_range(opt, value)
    return value


def _to_float(opt: Option, value: Any) -> float:
    if isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError("expected a finite number")
    _check_range(opt, value)
    return float(value)


def _to_enum(opt: Option, value: Any) -> str:
    if isinstance(value, bool):
        value = "true" if value else "false"
    word = value.strip().lower() if isinstance(value, str) else ""
    if word in opt.choices:
        return word
    close = difflib.get_close_matches(word, opt.choices, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"expected one of {', '.join(opt.choices)}{hint}")


def _to_name(opt: Option, value: Any) -> str:
    if isinstance(value, str) and _NAME_VALUE_RE.fullmatch(value.strip().lower()):
        return value.strip().lower()
    raise ValueError("expected a name of letters, digits, '_', '.', ':' or '-'")


def _to_list(opt: Option, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        items = [] if value.strip().lower() == "none" else value.split("|")
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ValueError("expected items joined by '|', or none")
    words = [_list_item(opt, item) for item in items]
    twice = sorted({word for word in words if words.count(word) > 1})
    if twice:
        raise ValueError(f"{twice[0]!r} is listed twice")
    return tuple(sorted(words))


def _list_item(opt: Option, item: Any) -> str:
    if not isinstance(item, str) or not item.strip():
        raise ValueError("list items must be non-empty words joined by '|'")
    if opt.choices:
        return _to_enum(opt, item)
    if item.strip().lower() == "none":
        raise ValueError("'none' stands for the empty list and cannot be an item")
    if not _PATTERN_RE.fullmatch(item.strip()):
        raise ValueError(f"bad pattern {item.strip()!r}: use letters, digits, '_', '.', '*', '?'")
    return item.strip()


def _to_bools(opt: Option, value: Any) -> tuple[bool, ...]:
    items = value.split("|") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or len(items) != opt.length:
        raise ValueError(f"expected {opt.length} bools joined by '|', e.g. false|false|true")
    return tuple(_to_bool(opt, item) for item in items)


def _to_budget(opt: Option, value: Any) -> float | int | None:
    if isinstance(value, str):
        match = _BUDGET_RE.fullmatch(value.strip())
        if match is None:
            raise ValueError("expected a fraction in (0, 1] like 0.5, or a size like 8GiB or 512MB")
        value = _budget_number(match["num"], match["unit"])
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("expected a fraction in (0, 1] like 0.5, or a size like 8GiB or 512MB")
    if isinstance(value, int) and value < _MIN_BUDGET_BYTES:
        raise ValueError("a size budget must be at least 1MB; use a fraction for a share")
    if isinstance(value, float) and not 0 < value <= 1:
        raise ValueError("a fraction must be in (0, 1]; add a unit for a size, e.g. 8GiB")
    return value


def _budget_number(number: str, unit: str | None) -> float | int:
    if unit is None:
        return float(number)
    size = Decimal(number) * _SIZE_UNITS[_UNIT_BY_LOWER[unit.lower()]]
    if size != size.to_integral_value():
        raise ValueError(f"{number}{unit} is not a whole number of bytes")
    return int(size)


_COERCE = {
    "bool": _to_bool,
    "int": _to_int,
    "float": _to_float,
    "enum": _to_enum,
    "name": _to_name,
    "list": _to_list,
    "bools": _to_bools,
    "budget": _to_budget,
}


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "|".join(_format_value(item) for item in value) or "none"
    return repr(value) if isinstance(value, float) else str(value)


def _format_option(opt: Option, value: Any) -> str:
    if opt.kind == "budget" and isinstance(value, int):
        return next(f"{value // n}{u}" for u, n in _SIZE_UNITS.items() if value % n == 0)
    return _format_value(value)
