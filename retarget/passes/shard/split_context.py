"""split_context (`cp[size=, attention=ring|allgather|ulysses, load_balance=]`): each rank of a
context-parallel group computes its share of the sequence; attention spans the group.

Contract: requires tree | provides context | after find_blocks
    | numerics approx(rtol=1e-05, atol=1e-06) | options SplitContextOptions

Runs before capture, so every region graph is captured at a rank's shapes with the split
attention in it as one node (`retarget::context_attention`, execution/context/attention.py):

- The model's attention must reach transformers' attention interface (`config.
  _attn_implementation`): the compiled model gets a config of its own whose implementation is
  registered for this model's layout (execution/context/hf_attention.py); the user's model and
  config are untouched. Models outside transformers are refused by name.
- The example becomes this rank's share (execution/context/batch.py), so capture and shapes
  see what the rank will run. A sequence the chunks do not divide (2N with load_balance, else
  N), Ulysses with a head count N does not divide, attention dropout, and a padded example
  are refused here, naming the value.
- The record (`plan.cp`, a `CpPlan`) names the attention modules split, their sliding
  windows, the layout and the per-rank sequence; apply_plan binds the cp process group and
  routes the compiled model's calls through the split (execution/context/apply.py).

Numerics: attention merges partial softmaxes in float32 and sums gradient shares across
ranks, so results equal one process's to float32 rounding (tests: 1e-5 relative).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from torch import nn

from retarget.core.errors import TargetNotSupportedError
from retarget.core.plans import CpPlan
from retarget.core.world import launch_environment
from retarget.execution.context.attention import MODES, ContextLayout, register_layout
from retarget.execution.context.batch import local_example, sequence_length
from retarget.execution.context.hf_attention import register_implementation
from retarget.ir.program import ExampleInputs, Program
from retarget.passes.base import Numerics, Pass, PassResult, coerce_options
from retarget.targets.grammar import PARTS, Target

_SCHEMA = PARTS["cp"].options


@dataclass(frozen=True, kw_only=True)
class SplitContextOptions:
    """The options of `cp[...]`; defaults come from the target schema."""

    size: int = _SCHEMA["size"].default
    """Ranks per context-parallel group; 0: the whole world."""
    attention: str = _SCHEMA["attention"].default
    """ring | allgather | ulysses."""
    load_balance: bool = _SCHEMA["load_balance"].default
    """Zig-zag chunks (even causal work per rank)."""

    def __post_init__(self) -> None:
        coerce_options(self, _SCHEMA, "cp")
        if self.attention not in MODES:
            raise ValueError(f"cp[attention={self.attention}]: one of {', '.join(MODES)}")


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Modules that call transformers' attention interface: they read their function from
    `self.config._attn_implementation` and carry `scaling` and `is_causal`."""
    return {
        path: module
        for path, module in model.named_modules()
        if hasattr(module, "config")
        and hasattr(module.config, "_attn_implementation")
        and hasattr(module, "scaling")
        and hasattr(module, "is_causal")
    }


#: Words in a module class's name that mark a layer mixing positions outside attention.
_MIXER_WORDS = ("mamba", "ssm", "rwkv", "retention", "deltanet", "linearattention", "shortconv")


def position_mixers(model: nn.Module) -> dict[str, str]:
    """Modules that mix positions along the sequence outside attention, with why: a
    convolution over time, a recurrent or state-space layer. A rank holding a shard of the
    sequence would compute them on its shard alone."""
    found: dict[str, str] = {}
    for path, module in model.named_modules():
        if any(path.startswith(f"{p}.") for p in found):
            continue
        name = type(module).__name__
        if isinstance(module, nn.Conv1d):
            found[path] = f"{name} convolves over positions"
        elif any(word in name.lower() for word in _MIXER_WORDS):
            found[path] = f"{name} mixes positions outside attention (recurrent, state-space "
            found[path] += "or convolution layer)"
    return found


class SplitContext(Pass):
    name = "split_context"
    summary = "context parallelism: the sequence split over the cp ranks, attention across them"
    requires = ("tree",)
    provides = ("context",)
    after = ("find_blocks",)
    numerics = Numerics("approx", rtol=1e-5, atol=1e-6)
    Options = SplitContextOptions

    @classmethod
    def stage(cls, target: Target) -> list[Pass]:
        part = target.get("cp")
        return [] if part is None else [cls(SplitContextOptions(**part.as_dict()))]

    def run(self, program: Program) -> PassResult:
        if program.plan.cp is not None:  # a second run: the attention is routed, the example cut
            return PassResult(changed=False, notes=(program.plan.cp.describe(),))
        options, world = self.options, program.world.size
        size = program.parallel_dims().cp  # at least 2, dividing the world
        where = f"cp[size={size}]"
        model = program.module
        config = getattr(model, "config", None)
        found = attention_modules(model)
        if config is None or not hasattr(config, "_attn_implementation") or not found:
            raise TargetNotSupportedError(
                f"{where}: {type(model).__name__} does not call transformers' attention "
                "interface (config._attn_implementation), where cp splits attention; models "
                "outside transformers are not supported yet"
            )
        mixers = position_mixers(model)
        if mixers:
            path, why = next(iter(mixers.items()))
            more = f" (and {len(mixers) - 1} more)" if len(mixers) > 1 else ""
            raise TargetNotSupportedError(
                f"{where}: {path}: {why}{more}; context parallelism splits the sequence across "
                "ranks and only attention is computed across them, so this model cannot be "
                "split; drop cp"
            )
        heads = getattr(config, "num_attention_heads", 0)
        if options.attention == "ulysses" and heads % size:
            raise TargetNotSupportedError(
                f"{where} with attention=ulysses: num_attention_heads={heads} does not divide "
                f"by {size}; use attention=ring or allgather, or a cp size that divides it"
            )
        dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
        if dropout and model.training:
            raise TargetNotSupportedError(
                f"{where}: config.attention_dropout={dropout}; the split attention has no "
                "dropout: set it to 0"
            )
        example = program.example
        length = sequence_length(example.args, example.kwargs) if example else 0
        if example is not None and length is None:
            raise TargetNotSupportedError(
                f"{where}: the example has no input_ids or inputs_embeds; cp splits a causal "
                "LM's sequence: give example_inputs={'input_ids': ..., 'labels': ...}"
            )
        rank = (launch_environment().rank or 0) % size if world > 1 else 0
        layout = ContextLayout(
            size=size,
            rank=rank,
            mode=options.attention,
            balanced=options.load_balance,
            causal=all(getattr(m, "is_causal", True) for m in found.values()),
        )
        chunks = layout.chunks(length)
        if length % chunks:
            why = "2 x size with load_balance=true" if layout.balanced else "size"
            raise TargetNotSupportedError(
                f"{where}: the example's sequence of {length} does not split into {chunks} "
                f"equal chunks ({why}); pad or cut sequences to a multiple of {chunks}"
            )
        key = register_layout(layout)
        name = register_implementation(key)
        _own_config(model, config, name)
        if example is not None:  # without one, calls are checked and captured as they come
            args, kwargs = local_example(layout, example.args, example.kwargs)
            program.example = ExampleInputs(args, kwargs)
        windows = {
            path: int(w)
            for path, module in found.items()
            if (
                w := getattr(module, "sliding_window", None)
                or getattr(config, "sliding_window", None)
            )
            and getattr(config, "use_sliding_window", True)
        }
        plan = program.plan.cp = CpPlan(
            size=size,
            attention=options.attention,
            balanced=options.load_balance,
            layout_key=key,
            implementation=name,
            attention_modules=tuple(found),
            sliding_windows=windows,
            sequence=length,
            per_rank_sequence=length // size if length else 0,
            data_parallel=world // size,
        )
        stats = {"attention_modules": len(found), "size": size, "sequence": length}
        return PassResult(changed=True, stats=stats, notes=(plan.describe(),))


def _own_config(model: nn.Module, config: Any, implementation: str) -> None:
    """Give the compiled model a config of its own naming `implementation` (the user's model
    keeps its config: the module tree is a copy, the config object was shared)."""
    own = copy.copy(config)
    own._attn_implementation = implementation
    for module in model.modules():
        if getattr(module, "config", None) is config:
            module.config = own
