"""Where a region graph computes a Linear, and which module's weight it reads.

`linear_site(node, root)` recognises a call of an nn.Linear, `linear(x, W)` (aten's, torch's,
and insert_autocast's graph form `cast_weight_linear`) with W a module's `.weight` read through
`get_attr` (or a dtype cast of it), HF Conv1D's `addmm(b, x, W)` (weight [in, out]) and `x @ W.T`
written out (Falcon's Linear), and returns the module path and its widths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from retarget.execution.autocast import cast_weight_linear
from retarget.ir.nodes import LINEAR_CALLS
from retarget.passes.shard.tp_layout import CASTS

#: call_function targets that compute `x @ W.T + b` with W an nn.Linear's weight: the plain
#: ones and insert_autocast's graph form, (x, the float32 weight, bias, dtype).
LINEAR_FUNCTIONS = (*LINEAR_CALLS, cast_weight_linear)
#: `addmm(b, x, W)` with W of shape (in, out): HF's Conv1D (GPT-2).
ADDMM = torch.ops.aten.addmm.default
MATMULS = (torch.ops.aten.matmul.default, torch.ops.aten.mm.default)
TRANSPOSES = (torch.ops.aten.t.default, torch.ops.aten.numpy_T.default)


@dataclass
class LinearSite:
    """A Linear the graph computes: its module path (relative to the region root)."""

    path: str
    node: str
    in_features: int
    out_features: int
    kind: str
    """linear (weight out x in) or conv1d (HF Conv1D: weight in x out)."""


def linear_site(node: fx.Node, root: nn.Module) -> LinearSite | None:
    """The Linear `node` computes, or None: a call of an nn.Linear, `linear(x, W)` with W a
    module's weight (or a cast of it), HF Conv1D's `addmm(b, x, W)`, `x @ W.T`."""
    if node.op == "call_module":
        module = _submodule(root, str(node.target))
        if isinstance(module, nn.Linear):
            return LinearSite(
                str(node.target), node.name, module.in_features, module.out_features, "linear"
            )
        return None
    if node.op != "call_function":
        return None
    if node.target in MATMULS:
        return transposed_weight_site(node, root)
    if node.target not in (*LINEAR_FUNCTIONS, ADDMM):
        return None
    weight = node.args[1] if node.target not in (ADDMM,) else node.args[2]
    path = _weight_owner(weight)
    if path is None:
        return None
    module = root.get_submodule(path)
    shape = tuple(module.weight.shape)
    if node.target is ADDMM:
        return LinearSite(path, node.name, shape[0], shape[1], "conv1d")
    return LinearSite(path, node.name, shape[1], shape[0], "linear")


def transposed_weight_site(node: fx.Node, root: nn.Module) -> LinearSite | None:
    """`x @ W.T` written out (Falcon's Linear): a matmul with a transposed Linear weight."""
    weight = node.args[1]
    if not (isinstance(weight, fx.Node) and weight.target in TRANSPOSES):
        return None
    path = _weight_owner(weight.args[0])
    module = _submodule(root, path) if path is not None else None
    if not isinstance(module, nn.Linear):
        return None
    return LinearSite(path, node.name, module.in_features, module.out_features, "linear")


def _submodule(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:  # a graph-private module (export's guard function)
        return None


def _weight_owner(node: Any) -> str | None:
    """P when `node` is `get_attr P.weight`, or a dtype cast of it (the weight a graph-form
    autocast casts is still that module's weight, split like it)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in CASTS:
        node = node.args[0]
    if isinstance(node, fx.Node) and node.op == "get_attr" and node.target.endswith(".weight"):
        return node.target[: -len(".weight")]
    return None
