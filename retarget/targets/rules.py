"""Which parts and options combine: the rule tables, and the checks that read them.

Rules are data: a pair that conflicts, a part that needs one of some others, an option value
that needs another option or part. The grammar (grammar.py) runs ``check_option_rules`` on each
part and ``check_conflicts`` on the whole target; every message names the parts and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import combinations
from typing import Any, Protocol

from retarget.targets.errors import TargetError
from retarget.targets.options import format_option, format_value
from retarget.targets.schema import PARTS
from retarget.targets.strategies import DDP_STRATEGIES, FSDP_STRATEGIES, STRATEGIES, STRATEGY

_HOOK_CLASH = (
    "are both DDP comm hooks and DDP takes one: write them as one hook, "
    "e.g. ddp+powersgd[wrapper={}]"
)
_TP_COMPOSES = (
    "tensor parallelism runs alone (tp[size] = the number of processes) or under FSDP2 over "
    "the data-parallel dimension of a (dp, tp) mesh (fsdp+tp, zero2+tp, zero3+tp)"
)
#: The parts tp does not combine with, and why.
_TP_CONFLICTS = {
    "single": f"'single' and 'tp' do not combine: 'single' runs one process; {_TP_COMPOSES}",
    "ddp": "'ddp' and 'tp' do not combine: DistributedDataParallel all-reduces every gradient "
    "over all ranks, but tp's parameters are DTensor shards that differ between the ranks of a "
    f"tp group and DDP does not take DTensors; {_TP_COMPOSES}",
    "zero1": "'zero1' and 'tp' do not combine: zero1 is DDP plus optimizer-state sharding, and "
    f"DDP does not take tp's DTensor parameters; {_TP_COMPOSES}",
    "hsdp": "'hsdp' and 'tp' do not combine yet: the (replicate, shard, tp) mesh is laid out "
    "(core/parallel_dims.py), but FSDP2's HSDP over tp's DTensors (the fused-part placements of "
    f"execution/tp_fsdp.py on a 2-D dp mesh) is neither written nor tested; {_TP_COMPOSES}",
    "xla": "'xla' and 'tp' do not combine: XLA shards with its own SPMD partitioner; "
    + _TP_COMPOSES,
    "fp8": "'fp8' and 'tp' do not combine: torch's parallel styles split nn.Linear and the FP8 "
    "modules are not nn.Linear; drop one of them",
    "offload": "'offload' and 'tp' do not combine: CPU offload of tp's 2-D DTensor shards is "
    "not implemented; drop offload",
    "quant": "'quant' and 'tp' do not combine yet: torch's parallel styles split nn.Linear "
    "weights and quantized Linears hold one packed buffer; use fsdp+quant",
}
_CP_COMPOSES = (
    "context parallelism runs beside ddp, fsdp, zero2 or zero3, which average gradients over "
    "every rank, data- and context-parallel alike (Accelerate's dp_shard x cp), with bf16, "
    "fp16, ac and compile"
)
#: The parts cp does not combine with yet, and why.
_CP_CONFLICTS = {
    "single": f"'single' and 'cp' do not combine: 'single' runs one process; {_CP_COMPOSES}",
    "tp": "'tp' and 'cp' do not combine yet: the (dp, cp, tp) mesh is laid out "
    "(core/parallel_dims.py), but the split attention has not been run on tp's split heads, "
    "nor the sequence split on tp's DTensor inputs; " + _CP_COMPOSES,
    "hsdp": "'hsdp' and 'cp' do not combine yet: the (replicate, shard, cp) mesh is laid out, "
    f"but FSDP2's HSDP over dp x cp is not wired in; {_CP_COMPOSES}",
    "zero1": f"'zero1' and 'cp' do not combine yet; {_CP_COMPOSES}",
    "xla": f"'xla' and 'cp' do not combine: XLA partitions the program itself; {_CP_COMPOSES}",
    "fp8": f"'fp8' and 'cp' do not combine yet (not tested together); {_CP_COMPOSES}",
    "quant": f"'quant' and 'cp' do not combine yet (not tested together); {_CP_COMPOSES}",
    "offload": f"'offload' and 'cp' do not combine yet (not tested together); {_CP_COMPOSES}",
}
#: Parts pp combines with: FSDP2 over the data-parallel ranks of each stage (fsdp+pp), tp
#: inside each stage (tp+pp, fsdp+tp+pp).
_PP_WITH = ("fsdp", "zero3", "zero2", "tp", "bf16", "ac", "compile")
_PP_ALONE = (
    "pipeline parallelism combines with fsdp/zero3/zero2 (fsdp+pp[size=N]: N stages, FSDP2 "
    "over the world / N ranks of each), tp (tp[size=T]+pp: each stage's blocks split over T "
    "ranks), bf16 (each stage under torch.autocast), ac (each block of a stage recomputed) and "
    "compile (each block of a stage compiled) so far: its stages are "
    "torch.distributed.pipelining's split of the exported model, which the graph passes (fp8, "
    "quant) do not rewrite yet"
)
#: Pairs of parts that cannot be combined, with the reason.
CONFLICTS: dict[frozenset[str], str] = {
    **{
        frozenset((a, b)): f"'{a}' and '{b}' are both distribution strategies; pick one "
        f"({a} {STRATEGY[a].does}, {b} {STRATEGY[b].does})"
        for a, b in combinations(STRATEGIES, 2)
    },
    **{frozenset((s, "tp")): why for s, why in _TP_CONFLICTS.items()},
    **{frozenset((s, "cp")): why for s, why in _CP_CONFLICTS.items()},
    **{
        frozenset(("stream", other)): f"'stream' and '{other}' do not combine: stream runs "
        "inference in one process, bringing weights in block by block; "
        f"'{other}' is for training" + (" on several processes" if other in STRATEGIES else "")
        for other in (
            *(s for s in STRATEGIES if s not in ("single", "xla")),
            "tp",
            "cp",
            "ac",
            "fp8",
            "quant",
            "offload",
            "powersgd",
            "fp16-comm",
            "bf16-comm",
        )
    },
    frozenset(("bf16", "fp16")): "'bf16' and 'fp16' are both autocast dtypes; pick one "
    "(bf16 needs no loss scaling)",
    frozenset(("fp16", "fp8")): "'fp16' and 'fp8' do not combine: fp8 runs the other ops in "
    "bf16; use bf16+fp8",
    frozenset(("fp8", "quant")): "'fp8' and 'quant' do not combine: both replace the Linear "
    "layers (fp8 trains them in float8, quant freezes them as 4/8-bit weights); pick one",
    frozenset(("offload", "quant")): "'offload' and 'quant' do not combine yet: CPU offload "
    "of the packed quantized weights is not implemented; drop offload (quant already keeps "
    "the base weights at a quarter of their size or less)",
    frozenset(("fp16-comm", "bf16-comm")): "'fp16-comm' and 'bf16-comm' both cast gradients "
    "for the all-reduce; pick one",
    frozenset(("powersgd", "fp16-comm")): "'powersgd' and 'fp16-comm' "
    + _HOOK_CLASH.format("fp16"),
    frozenset(("powersgd", "bf16-comm")): "'powersgd' and 'bf16-comm' "
    + _HOOK_CLASH.format("bf16"),
}
#: Parts that combine only with the listed ones.
ONLY_WITH = {
    "pp": (_PP_WITH, _PP_ALONE),
    "xla": (
        ("bf16",),
        "XLA compiles and distributes the whole step itself (xla[sharding=fsdp] shards the "
        "blocks over its devices); of the other parts only bf16 (autocast on XLA) is "
        "implemented there",
    ),
}
_HOOK_NEEDS = (DDP_STRATEGIES, "comm hooks change DDP's gradient all-reduce")
#: Parts that need one of the listed parts.
NEEDS_ONE_OF = {
    "offload": (FSDP_STRATEGIES, "offload moves sharded state to the CPU"),
    "cp": (
        ("ddp", "fsdp", "zero2", "zero3"),
        "the ranks of a cp group compute one sequence's gradients in parts, which DDP or FSDP2 "
        "average over every rank; write ddp+cp (ddp over one cp group when cp[size] is the "
        "world) or fsdp+cp",
    ),
    "powersgd": _HOOK_NEEDS,
    "fp16-comm": _HOOK_NEEDS,
    "bf16-comm": _HOOK_NEEDS,
}
#: (part, option, values that trigger the rule, parts of which one must be present, why)
OPTION_NEEDS_PART = (
    (
        "bf16",
        "downcast",
        (True,),
        ("xla",),
        "it is XLA's XLA_DOWNCAST_BF16",
    ),
)
#: (part, option, values that trigger the rule, parts it does not combine with, why)
OPTION_CONFLICTS_PART = (
    (
        "compile",
        "scope",
        ("whole",),
        ("ac",),
        "the whole model is then one graph, whose blocks cannot be checkpointed one by one; "
        "use compile[scope=regions] (the default), which compiles each checkpointed block",
    ),
)
#: (part, option, trigger values or None for "set", needed option, allowed values or None for
#: "set", why): rules between the options of one part.
OPTION_RULES: tuple[tuple[str, str, Any, str, Any, str], ...] = (
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
    ("quant", "type", ("int8",), "bits", ("8",), "int8 is the 8-bit code"),
    ("quant", "type", ("nf4", "fp4"), "bits", ("4",), "nf4 and fp4 are 4-bit codes"),
    ("quant", "double_quant", (True,), "bits", ("4",), "only 4-bit blocks have scales to quantize"),
    ("quant", "block_size", None, "bits", ("4",), "int8 has one scale per row, not blocks"),
    ("ac", "budget", None, "policy", ("budget",), "a budget applies to policy=budget only"),
    ("ac", "policy", ("budget",), "budget", None, "write e.g. ac[budget=0.5] or ac[budget=8GiB]"),
    ("offload", "params", (False,), "optimizer", (True,), "otherwise nothing is offloaded"),
)
#: Defaults that depend on another option: (part, option) -> (when this option is set, default).
IMPLIED = {("ac", "policy"): ("budget", "budget")}
#: Words that are not part names but whose meaning has one, for suggestions.
NAME_HINTS = dict(
    pair.split(":")
    for pair in "fsdp1:fsdp fsdp2:fsdp float8:fp8 bfloat16:bf16 float16:fp16 half:fp16"
    " checkpoint:ac activation_checkpointing:ac dynamo:compile torch_compile:compile"
    " cpu_offload:offload tensor_parallel:tp hybrid_shard:hsdp dp:ddp no:single none:single"
    " qlora:quant bnb:quant bitsandbytes:quant nf4:quant int8:quant int4:quant"
    " quantize:quant pipeline:pp pipeline_parallel:pp pippy:pp context_parallel:cp"
    " ring_attention:cp ulysses:cp sp:cp".split()
)


def option_default(name: str, key: str, values: Mapping[str, Any]) -> Any:
    """The default of option ``key`` of part ``name``, given the options set (see IMPLIED)."""
    implied = IMPLIED.get((name, key))
    if implied and values.get(implied[0]) is not None:
        return implied[1]
    return PARTS[name].options[key].default


def effective_option(name: str, key: str, values: Mapping[str, Any]) -> Any:
    """Option ``key`` as set in ``values``, or its default."""
    return values[key] if key in values else option_default(name, key, values)


def _holds(name: str, key: str, values: Any, explicit: Mapping[str, Any]) -> bool:
    """Whether option ``key`` is set (values None) or has one of ``values``."""
    return key in explicit if values is None else effective_option(name, key, explicit) in values


def check_option_rules(name: str, explicit: Mapping[str, Any], where: str) -> None:
    """Raise TargetError when the options set on part ``name`` break one of OPTION_RULES."""
    for part, key, when, need_key, allowed, why in OPTION_RULES:
        if part != name or not _holds(name, key, when, explicit):
            continue
        if _holds(name, need_key, allowed, explicit):
            continue
        got = effective_option(name, need_key, explicit)
        opts = PARTS[name].options
        given = f"{key}={format_option(opts[key], effective_option(name, key, explicit))}"
        need = need_key if allowed is None else f"{need_key}={format_value(allowed)}"
        now = "is not set" if allowed is None else f"is {format_option(opts[need_key], got)}"
        raise TargetError(f"{given} in {where!r} needs {need}, but {need_key} {now}: {why}", where)


class NamedPart(Protocol):
    """What the checks read of a part: its name and its options' values."""

    name: str

    def get(self, key: str) -> Any: ...


def _one_of(names: tuple[str, ...]) -> str:
    quoted = [f"'{name}'" for name in names]
    return quoted[0] if len(quoted) == 1 else f"one of {', '.join(quoted)}"


def check_conflicts(parts: Sequence[NamedPart]) -> None:
    """Raise TargetError when parts conflict or miss a part they need (CONFLICTS, ONLY_WITH,
    NEEDS_ONE_OF, OPTION_NEEDS_PART, OPTION_CONFLICTS_PART)."""
    names = [part.name for part in parts]
    for a, b in combinations(names, 2):
        if frozenset((a, b)) in CONFLICTS:
            raise TargetError(CONFLICTS[frozenset((a, b))], part=b)
    for name, (allowed, why) in ONLY_WITH.items():
        others = [n for n in names if n not in (name, *allowed)] if name in names else []
        if others:
            raise TargetError(f"'{name}' does not combine with '{others[0]}': {why}", others[0])
    for name in names:
        needs, why = NEEDS_ONE_OF.get(name, ((), ""))
        if needs and not set(needs) & set(names):
            raise TargetError(f"'{name}' needs {_one_of(needs)}: {why}", part=name)
    for part in parts:
        for name, key, values, needs, why in OPTION_NEEDS_PART:
            if part.name == name and part.get(key) in values and not set(needs) & set(names):
                shown = f"{name}[{key}={format_value(part.get(key))}]"
                raise TargetError(f"{shown} needs {_one_of(needs)}: {why}", part=name)
        for name, key, values, others, why in OPTION_CONFLICTS_PART:
            clash = [n for n in others if n in names]
            if part.name == name and part.get(key) in values and clash:
                shown = f"{name}[{key}={format_value(part.get(key))}]"
                raise TargetError(f"{shown} and '{clash[0]}' do not combine: {why}", part=name)
