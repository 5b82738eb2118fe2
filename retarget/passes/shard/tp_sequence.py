"""Sequence parallelism for a derived tp plan (`tp[..., sequence_parallel=true]`).

Layout (Megatron's, torchtitan's): the residual stream between blocks is a DTensor split on the
sequence dim (dim 1). The input embedding's output is scattered onto it; inside each block the
norms run on sequence slices (style `sequence_parallel`), each colwise Linear all-gathers the
sequence before its matmul (rule `sequence="gather"`), each rowwise Linear reduce-scatters its
output onto it (`sequence="scatter"`) instead of all-reducing; the final norm runs on slices and
the LM head gathers the sequence (`sequence="gather"`).

`sequence_rules` marks those boundaries on the plan's rules and refuses what the layout cannot
hold: a Linear a block keeps replicated (it would read a sequence slice as if whole), a model
without an LM head (its hidden states would leave the model split).

`check_glue` runs the model once on the example inputs and refuses (naming the module and why)
a model whose code between the embedding, the blocks, the final norm and the head computes
anything: the stream there is split, so a full-sequence tensor mixed in (GPT-2 adds position
embeddings to the token embeddings; BERT normalises their sum) cannot be applied to it. What
passes is: the embedding's output is the first block's input, each block's output the next
one's, the last block's output the final norm's input and that norm's output the head's input.
"""

from __future__ import annotations

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


def sequence_rules(
    model: nn.Module,
    rules: dict[str, TpRule],
    blocks: dict[str, str],
    embedding: str | None,
    head: str | None,
) -> dict[str, TpRule]:
    """The rules with their sequence boundaries. `blocks`: path of each Linear inside a block
    -> that block's path."""
    if head is None:
        raise TargetNotSupportedError(
            f"{WHY}: {type(model).__name__} has no LM head (get_output_embeddings()) to gather "
            "the sequence before the output: its hidden states (into a classifier, a pooler, "
            "or out of the model) would be split on the sequence"
        )
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
    if embedding is not None:
        marked[embedding] = _with(marked[embedding], "scatter")
    marked[head] = _with(marked[head], "gather")
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


def check_glue(
    program: Program, embedding: str | None, block_paths: list[str], norms: list[str], head: str
) -> None:
    """Run the example once; refuse unless the stream goes embedding -> blocks -> norm -> head
    with nothing computed in between (`norms`: the sequence_parallel norms outside blocks)."""
    if program.example is None:
        raise TargetNotSupportedError(
            f"{WHY}: needs example inputs to check the code between the embedding, the blocks "
            "and the head (compile_for(..., example_inputs=batch))"
        )
    if not block_paths:
        raise TargetNotSupportedError(f"{WHY}: the model has no repeated blocks to split")
    if len(norms) > 1:
        raise TargetNotSupportedError(
            f"{WHY}: norms {', '.join(norms)} sit outside the blocks; only one final norm "
            "between the last block and the head can run on sequence slices"
        )
    calls = _record(program, [embedding] if embedding else [], block_paths, norms, head)
    previous, where = (calls[0][2], f"the output of {embedding!r}") if embedding else (None, "")
    stages = calls[1:] if embedding else calls
    for path, given, output in stages:
        if previous is not None and not _same(given, previous):
            raise TargetNotSupportedError(
                f"{WHY}: the input of {path!r} is not {where}: the model's code between them "
                "computes on the stream (e.g. adds position embeddings or normalises), which "
                "cannot run on a stream split on the sequence; drop sequence_parallel"
            )
        previous, where = output, f"the output of {path!r}"


def _record(
    program: Program, first: list[str], blocks: list[str], norms: list[str], head: str
) -> list[tuple[str, Any, Any]]:
    """(path, hidden-state input, output) of each module in call order, each path's first
    call; the embedding first, then the blocks, the norms and the head in the order they ran."""
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

    for path in [*first, *blocks, *norms, head]:
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
    missing = [p for p in [*first, *blocks, *norms, head] if p not in calls]
    if missing:
        raise TargetNotSupportedError(
            f"{WHY}: {missing[0]!r} did not run on the example inputs, so the path of the "
            "residual stream through the model is unknown"
        )
    if first and order[0] != first[0]:
        raise TargetNotSupportedError(
            f"{WHY}: {order[0]!r} ran before the input embedding {first[0]!r}"
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
