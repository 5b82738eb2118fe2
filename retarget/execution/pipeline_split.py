"""Rewrites of torch's pipeline split (`torch.distributed.pipelining.pipeline`'s Pipe) made
before its stages are built, by apply_pipeline (the pp part) and prepare_pippy.

- `chain_skips`: torch 2.13's stages refuse a value read by two later stages ("backward of
  skip connections not supported yet"), and a transformers decoder computes its rotary
  cos/sin and causal mask once, before the first block, for every block. Each stage also
  returns the received values a later stage reads, and each later stage reads them from the
  stage just before: every value goes to the next stage only (their gradients, which no weight
  needs, travel back the same way).
- `contiguous_sends`: a stage receives a value, and sends back its gradient, in a buffer of
  the strides the trace gave the value; gloo refuses a strided one. A stage that begins inside
  an attention would receive the query and key as attention left them (transposed per head).
  Each value a stage computes and sends passes through `sendable` in that stage's graph
  (contiguous, and a copy where it is a view: torch's zero-bubble stages detach their outputs
  in place, which a view refuses), and the placeholders receiving a value traced strided expect
  the contiguous layout (the ops after it compute the same values in any layout).
- `order_sends`: torch's stages send a stage's outputs in their order and post the next
  stage's receives in the order of its inputs; gloo pairs a rank pair's messages in the order
  they are posted. chain_skips appends the values it forwards after a stage's own, which the
  next stage may read first (a stage that begins inside a block reads the rotary cos/sin before
  the query), so each stage's outputs are put in the order the next stage reads them.
- `use_original_parameters`: the split gives a weight used by two stages (an LM head tied to
  the embedding) a copy in each stage after the first; the model's own Parameter goes back in
  every stage module, so each rank's gradient lands on it.
- `run_generated_code`: the modules torch.export's unflatten leaves inside a stage (a block and
  each module in it, InterpreterModules) run their graphs through torch.fx.Interpreter by
  default, one Python call per node; the code fx generates from the same graph (what dynamo
  runs) calls the same ops in one function per module. Called last, after every edit of the
  stages' graphs (pipeline_tp's DTensor edits included): it regenerates that code from each
  graph as it is then. A graph with a node
  named `self` (the call of a submodule named so, as BERT's attention.self) stays on the
  Interpreter: that name would rebind the generated method's `self`. On a 4-layer Llama
  under fsdp+tp+pp on 8 CPU ranks the interpreter was 13% of the ranks' time.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import Tensor, fx, nn


def prepare_split(pipe: Any) -> None:
    """What every split needs before its stages are built: skips chained, sends contiguous and
    in the order the next stage reads them."""
    chain_skips(pipe)
    contiguous_sends(pipe)
    order_sends(pipe)


def _stage_calls(gm: fx.GraphModule) -> list[fx.Node]:
    """The split's calls of its stage modules, in order."""
    return [n for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith("submod_")]


def _output(stage: fx.GraphModule) -> fx.Node:
    return next(n for n in stage.graph.nodes if n.op == "output")


def chain_skips(pipe: Any) -> None:
    """Forward, stage by stage, the values a stage would send past the next one (see the
    module docstring); `pipe.split_gm`'s call graph and the stages' output nodes are rewritten
    in place."""
    gm = pipe.split_gm
    graph = gm.graph
    calls = _stage_calls(gm)
    for k, call in enumerate(calls[:-1]):
        later = calls[k + 1 :]
        received = [a for a in call.args if isinstance(a, fx.Node)]
        skipped = [a for a in received if any(a in stage.args for stage in later)]
        if not skipped:
            continue
        stage_module = getattr(gm, call.target)
        placeholders = [n for n in stage_module.graph.nodes if n.op == "placeholder"]
        output = _output(stage_module)
        own = output.args[0]
        single = not isinstance(own, (tuple, list))
        own_values = (own,) if single else tuple(own)
        forwarded = tuple(placeholders[list(call.args).index(v)] for v in skipped)
        output.args = (own_values + forwarded,)
        stage_module.recompile()
        users = list(call.users)
        with graph.inserting_after(call):
            items = [
                graph.call_function(operator.getitem, (call, i))
                for i in range(len(own_values) + len(forwarded))
            ]
        for user in users:
            if single:
                user.replace_input_with(call, items[0])
            elif user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(items[user.args[1]])
                graph.erase_node(user)
        for j, value in enumerate(skipped):
            for stage in later:
                stage.replace_input_with(value, items[len(own_values) + j])
    graph.lint()
    gm.recompile()


def sendable(value: Tensor) -> Tensor:
    """`value` as a stage may send it: contiguous, and not a view (torch's zero-bubble stages
    detach their outputs in place, which a view refuses); else a contiguous copy."""
    if value._is_view() or not value.is_contiguous():
        return value.clone(memory_format=torch.contiguous_format)
    return value


def contiguous_sends(pipe: Any) -> int:
    """Make every value a stage sends contiguous, and its receivers expect it so (see the
    module docstring): each output a stage computes passes through `sendable` in its stage's
    graph (its traced value made contiguous), and each placeholder receiving a value traced
    strided gets the contiguous one; returns how many such values there were. Runs after
    chain_skips, before order_sends."""
    gm = pipe.split_gm
    calls = _stage_calls(gm)
    made: dict[tuple[fx.Node, int], Any] = {}  # (stage call, output index) -> contiguous value
    for call in calls:
        stage = getattr(gm, call.target)
        placeholders = [n for n in stage.graph.nodes if n.op == "placeholder"]
        for placeholder, arg in zip(placeholders, call.args, strict=False):
            if isinstance(arg, fx.Node) and arg.target is operator.getitem:
                key = (arg.args[0], arg.args[1])
            else:
                key = (arg, 0)
            if key in made:
                placeholder.meta["val"] = made[key]
        if call is calls[-1]:
            break
        output = _output(stage)
        single = not isinstance(output.args[0], (tuple, list))
        values = [output.args[0]] if single else list(output.args[0])
        for i, value in enumerate(values):
            example = value.meta.get("val") if isinstance(value, fx.Node) else None
            if not isinstance(example, Tensor) or value.op == "placeholder":
                continue  # a received value forwarded: its buffer is contiguous and no view
            with stage.graph.inserting_before(output):
                values[i] = stage.graph.call_function(sendable, (value,))
            values[i].meta = {**value.meta, "val": example.contiguous()}
            if not example.is_contiguous():
                made[(call, i)] = values[i].meta["val"]
        output.args = (values[0] if single else tuple(values),)
        stage.recompile()
    return len(made)


def order_sends(pipe: Any) -> int:
    """Put each stage's outputs in the order the next stage reads them (see the module
    docstring); returns how many stages' outputs were reordered. Runs after chain_skips, when
    a stage's outputs go to the next stage only."""
    gm = pipe.split_gm
    calls = _stage_calls(gm)
    reordered = 0
    for call, after in zip(calls, calls[1:], strict=False):
        stage = getattr(gm, call.target)
        output = _output(stage)
        if not isinstance(output.args[0], (tuple, list)):
            continue
        values = list(output.args[0])
        items = {
            user.args[1]: user
            for user in call.users
            if user.op == "call_function" and user.target is operator.getitem
        }
        read = [a.args[1] for a in after.args if isinstance(a, fx.Node) and a in items.values()]
        order = read + [i for i in range(len(values)) if i not in read]
        if order == list(range(len(values))):
            continue
        output.args = (tuple(values[i] for i in order),)
        stage.recompile()
        for new_index, old_index in enumerate(order):
            if old_index in items:
                items[old_index].args = (call, new_index)
        reordered += 1
    gm.recompile()
    return reordered


def run_generated_code(stage_module: nn.Module) -> None:
    """Regenerate the code of every unflattened module in `stage_module` from its graph as it
    is now (what dynamo runs, and what runs here from then on), and run it instead of
    torch.fx.Interpreter (see the module docstring)."""
    for sub in stage_module.modules():
        if not hasattr(sub, "_run_with_interpreter"):
            continue
        code = sub.__dict__.get("graph_module")
        if isinstance(code, fx.GraphModule):  # None: a container no graph calls
            code.recompile()
            if any(node.name == "self" for node in code.graph.nodes):
                continue  # a submodule named `self` (BERT's attention.self): its call's
                # value would rebind the generated method's `self`; the Interpreter runs it
        sub._run_with_interpreter = False


def use_original_parameters(traced: Any, original: nn.Module, stages: int) -> list[dict[int, Any]]:
    """Put `original`'s own Parameter objects in every stage module where torch's split left a
    copy (a weight two stages use); per stage, the original parameters it uses (by id)."""
    originals = dict(original.named_parameters(remove_duplicate=False))
    used: list[dict[int, Any]] = []
    for k in range(stages):
        module = traced.get_stage_module(k)
        mine: dict[int, Any] = {}
        for name, param in list(module.named_parameters(remove_duplicate=False)):
            own = originals.get(name.removeprefix("model."))  # the _Logits wrapper's prefix
            if own is None:
                continue
            if param is not own:
                owner, _, leaf = name.rpartition(".")
                setattr(module.get_submodule(owner), leaf, own)
            mine[id(own)] = own
        used.append(mine)
    return used
