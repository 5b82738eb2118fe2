"""What a graph node computes and the value it was traced with, read one way by every pass.

`LINEAR_CALLS` is the one table of the call targets that compute `x @ W.T + b` in the graphs our
frontends produce (torch.export's aten op, dynamo's and fx's torch functions); a pass that also
reads insert_autocast's cast form of a Linear adds that one function to it (tp_linear_sites.py).

`op_name` is the one name of a node's op that rule tables are keyed by and messages print: the
op's name without its overload ("linear" for aten.linear.default, `overload=True` keeps it:
"add.Tensor"), "getitem" and "matmul" for the Python operators and their methods, a method
node's method name. `traced_value` is the example value the frontend recorded: every frontend
leaves it in `node.meta["val"]` (torch.export writes it there; the dynamo frontend copies
dynamo's `example_value` into it, frontends/dynamo.py), so no rule reads another key.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

#: The call_function targets that compute a Linear, `(x, weight, bias=None)`.
LINEAR_CALLS = (torch.ops.aten.linear.default, torch._C._nn.linear, torch.nn.functional.linear)
#: Python's operator methods as the op names of the rule tables.
_DUNDER = {"__matmul__": "matmul", "__rmatmul__": "matmul", "__getitem__": "getitem"}


def op_name(node: fx.Node, *, overload: bool = False) -> str | None:
    """The op name of `node` (module docstring); None for placeholders, outputs, modules."""
    if node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            return target.__name__ if overload else target.overloadpacket.__name__
        if target is operator.getitem:
            return "getitem"
        return getattr(target, "__name__", None)
    if node.op == "call_method":
        return _DUNDER.get(node.target, node.target)
    return None


def traced_value(node: Any) -> Any:
    """The value `node` was traced with (`meta["val"]`), None for a non-node or none recorded."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None
