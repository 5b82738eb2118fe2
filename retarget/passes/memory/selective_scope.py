"""Selective checkpointing of a captured graph with the dispatch mode entered only at kept calls.

torch's form of selective checkpointing (`create_selective_checkpoint_contexts`) runs the whole
block under a Python TorchDispatchMode, forward and recompute: every aten op crosses into Python
to be classified, though only the matmul-class ops (recompute_rules.SAVED_OPS) are kept. On the
bench model (TinyLM, 16 blocks of width 64, one CPU thread) those ~140 round trips per block and
step cost more than recomputing the cheap ops themselves.

A captured graph names its calls, so the mode is needed only around the calls that can reach a
kept op (recompute_rules.KEPT_CALLS: linear, matmul, attention, convolution, ...). The region
transform `scope_kept_calls` (this file) turns each such call into `run_kept(op, ...)`, which
enters this thread's keeping mode around the one call, if a selective checkpoint is running (the
modes are the execution layer's: execution/kept_calls.py):

- in forward, `KeepOutputs` runs the call and keeps (detached) the outputs of the SAVED_OPS it
  reaches, per op, in call order;
- in recompute, `ReplayOutputs` hands those outputs back instead of running the op, so autograd
  records the op again (saving its recomputed inputs) without its cost;
- every other op runs with no mode at all: in recompute it simply runs again, which is what the
  policy would have said (recompute everything not kept).

Forward and recompute run the same graph, so both meet the kept calls in the same order. A call
with no graph (an eager region, a signature that failed to capture, a user hook inside the
block) runs its whole forward under the modes (`eager_form`), as torch's form does. Nothing here
applies while dynamo traces (`run_kept` is then the plain call): a compiled region is selective
or not by what checkpoint_blocks picks for compiled calls.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from retarget.execution.kept_calls import SCOPED, run_kept
from retarget.execution.recompute_rules import KEPT_CALLS

EXPORT_GUARDS = "_guards_fn"


def scope_kept_calls(gm: fx.GraphModule) -> None:
    """Region transform: route every call that can reach a kept op through `run_kept`.

    Only a graph of aten calls (an exported one) is scoped; one that calls modules, methods or
    torch functions (fx, dynamo, fp8 swaps) could hide a matmul anywhere, so it is left as is and
    `is_scoped` says it must run whole under the modes.
    """
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    if not all(_is_aten_call(gm, n) for n in nodes):
        gm.meta[SCOPED] = False
        return
    for node in nodes:
        packet = getattr(node.target, "overloadpacket", None)
        if node.op == "call_function" and packet in KEPT_CALLS:
            node.args = (node.target, *node.args)
            node.target = run_kept
    gm.meta[SCOPED] = True


def _is_aten_call(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_module":  # torch.export's input guards do no tensor math
        return node.target == EXPORT_GUARDS
    if node.op == "call_function":
        return isinstance(node.target, torch._ops.OpOverload) or node.target is operator.getitem
    return False
