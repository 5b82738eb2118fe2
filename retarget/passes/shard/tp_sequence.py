"""Sequence parallelism for a derived tp plan (`tp[..., sequence_parallel=true]`).

Layout (Megatron's, torchtitan's): the residual stream between blocks is a DTensor split on the
sequence dim (dim 1). The input embedding's output is scattered onto it; inside each block the
norms run on sequence slices (style `sequence_parallel`), each colwise Linear all-gathers the
sequence before its matmul (rule `sequence="gather"`), each rowwise Linear reduce-scatters its
output onto it (`sequence="scatter"`) instead of all-reducing; the final norm runs on slices and
the LM head gathers the sequence (`sequence="gather"`).

`stream_boundaries` runs the model once on the example inputs and finds where the stream can
be split. Glue that computes on the stream (GPT-2 adds position embeddings to the token
embeddings; BERT adds token types and normalises the sum) cannot run on sequence slices, so:
- when the embedding's output is not the first block's input, the embedding and the glue run
  whole (replicated, as without sequence parallelism) and the first block's input is cut to
  this rank's slice (`sequence="scatter_input"`: no communication);
- when the last block's output does not go straight into the head (through at most one final
  norm), the last block's output is all-gathered (`sequence="gather_output"`) and what follows
  runs whole: a pooler, a classifier, BERT's prediction transform; a model with no LM head
  works this way too;
- each block's output must be the next block's input: glue between blocks is refused, naming
  the two blocks. Norms outside the blocks that run on the whole stream keep no rule.

`sequence_rules` marks those boundaries on the plan's rules and refuses a Linear a block keeps
replicated (it would read a sequence slice as if whole).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from retarget.core.errors import TargetNotSupportedError
from retarget.core.plans import TpRule
from retarget.frontends.check import preserved_state
from retarget.ir.program import Program
from retarget.ir.region import running_eagerly
from retarget.passes.shard.tp_params import is_linear_like

WHY = "tp[sequence_parallel=true]"
BOUNDARY = {"colwise": "gather", "rowwise": "scatter"}


@dataclass(frozen=True)
class StreamBoundaries:
    """Where the residual stream is split and joined (see the module docstring)."""

    split_at_embedding: bool
    first_block: str
    joined_at_head: bool
    last_block: str
    sequence_norms: tuple[str, ...]
    """The norms outside the blocks that run on the split stream (the final norm, or none)."""


def sequence_rules(
    rules: dict[str, TpRule],
    blocks: dict[str, str],
    embedding: str | None,
    head: str | None,
    bounds: StreamBoundaries,
) -> dict[str, TpRule]:
    """The rules with their sequence boundaries. `blocks`: path of each Linear inside a block
    -> that block's path."""
    marked = dict(rules)
    for path, block in blocks.items():
        rule = rules[path]
        if rule.style not in BOUNDARY:
            raise TargetNotSupportedError(
                f"{WHY}: module {path!r} in block {block!r} stays {rule.style} ({rule.reason}); "
                "with the residual stream split on the sequence, only colwise/rowwise Linears "
                "can read or write it"
            )
        marked[path] = _with(rule, BOUNDARY[rule.style])
    for path, rule in rules.items():  # norms on the whole stream (glue) run as they are
        if rule.style == "sequence_parallel" and path not in bounds.sequence_norms:
            if not any(path.startswith(block + ".") for block in blocks.values()):
                del marked[path]
    if bounds.split_at_embedding and embedding is not None:
        marked[embedding] = _with(marked[embedding], "scatter")
    else:
        marked[bounds.first_block] = TpRule(
            style="replicate",
            reason="the glue before it computes on the whole stream: its input is cut to this "
            "rank's sequence slice",
            sequence="scatter_input",
        )
    if bounds.joined_at_head and head is not None:
        marked[head] = _with(marked[head], "gather")
    else:
        marked[bounds.last_block] = TpRule(
            style="replicate",
            reason="what follows it needs the whole stream: its output is all-gathered",
            sequence="gather_output",
        )
    return marked


def _with(rule: TpRule, boundary: str) -> TpRule:
    what = {"gather": "all-gathers the sequence", "scatter": "reduce-scatters onto the sequence"}
    reason = rule.reason.replace(" (one all-reduce)", "")  # the scatter replaces it
    return TpRule(
        style=rule.style,
        reason=f"{reason}; {what[boundary]}",
        sequence=boundary,
        vocab_output=rule.vocab_output,
    )


def linears_in_blocks(model: nn.Module, block_paths: list[str]) -> dict[str, str]:
    """Path of each Linear-like module inside a block -> the block's path."""
    found = {}
    for base in block_paths:
        for path, module in model.get_submodule(base).named_modules():
            if path and is_linear_like(module):
                found[f"{base}.{path}" if base else path] = base
    return found


def stream_boundaries(
    program: Program,
    embedding: str | None,
    block_paths: list[str],
    norms: list[str],
    head: str | None,
) -> StreamBoundaries:
    """Run the example once and find where the stream is split and joined (`norms`: the
    sequence_parallel norms outside blocks); refuse glue between two blocks."""
    if program.example is None:
        raise TargetNotSupportedError(
            f"{WHY}: needs example inputs to check the code between the embedding, the blocks "
            "and the head (compile_for(..., example_inputs=batch))"
        )
    if not block_paths:
        raise TargetNotSupportedError(f"{WHY}: the model has no repeated blocks to split")
    paths = [*([embedding] if embedding else []), *block_paths, *norms, *([head] if head else [])]
    calls = dict((p, (given, output)) for p, given, output in _record(program, paths))
    order = [p for p in calls if p in block_paths]
    for before, after in zip(order[:-1], order[1:], strict=True):
        if not _same(calls[after][0], calls[before][1]):
            raise TargetNotSupportedError(
                f"{WHY}: the input of block {after!r} is not the output of block {before!r}: "
                "the model's code between two blocks computes on the stream, which cannot run "
                "on a stream split on the sequence; drop sequence_parallel"
            )
    first, last = order[0], order[-1]
    split_at_embedding = embedding is not None and _same(calls[first][0], calls[embedding][1])
    chain, previous = [], calls[last][1]
    for path in [*norms, *([head] if head else [])]:
        if path in calls and _same(calls[path][0], previous):
            chain.append(path)
            previous = calls[path][1]
    joined_at_head = head is not None and chain[-1:] == [head] and len(chain) <= 2
    final = tuple(p for p in chain if p != head) if joined_at_head else ()
    return StreamBoundaries(split_at_embedding, first, joined_at_head, last, final)


def _record(program: Program, paths: list[str]) -> list[tuple[str, Any, Any]]:
    """(path, hidden-state input, output) of each module in call order, each path's first
    call."""
    model = program.module
    calls: dict[str, list[Any]] = {}
    order: list[str] = []
    handles = []

    def before(path: str, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        if path not in calls:
            order.append(path)
            calls[path] = [_hidden(args, kwargs), None]

    def after(path: str, _module: nn.Module, _args: tuple, output: Any) -> None:
        if calls[path][1] is None:
            calls[path][1] = _first_tensor(output)

    for path in paths:
        module = model.get_submodule(path)
        handles.append(
            module.register_forward_pre_hook(
                lambda m, a, k, p=path: before(p, m, a, k), with_kwargs=True
            )
        )
        handles.append(module.register_forward_hook(lambda m, a, o, p=path: after(p, m, a, o)))
    example = program.example
    try:
        with running_eagerly(tuple(model.modules())), preserved_state(model), torch.no_grad():
            model(*example.args, **example.kwargs)
    finally:
        for handle in handles:
            handle.remove()
    missing = [p for p in paths if p not in calls]
    if missing:
        raise TargetNotSupportedError(
            f"{WHY}: {missing[0]!r} did not run on the example inputs, so the path of the "
            "residual stream through the model is unknown"
        )
    return [(p, calls[p][0], calls[p][1]) for p in order]


def _hidden(args: tuple, kwargs: dict) -> Any:
    if args:
        return args[0]
    return kwargs.get("hidden_states", next(iter(kwargs.values()), None))


def _first_tensor(output: Any) -> Any:
    if isinstance(output, (tuple, list)):
        return output[0] if output else None
    return output


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
