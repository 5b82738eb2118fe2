"""Frontend 1: torch.export, non-strict, training IR.

Non-strict export runs the module's Python code with fake tensors, so it copes with HF
decorators, ModelOutput, tied weights and kwargs (docs/facts.md); strict export drops tied weights.
`ep.module()` unlifts parameters back into `get_attr` nodes with their original paths, which is
what lets `binding.py` run the graph against any repeat of a block.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.export import Dim
from torch.utils._pytree import tree_map, tree_map_only

from retarget.frontends.binding import CapturedGraph


def capture(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> CapturedGraph:
    program = torch.export.export(module, args, kwargs, strict=False)
    gm = program.module()
    gm.meta["frontend"] = "export"
    return CapturedGraph("export", gm)


def capture_dynamic(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> CapturedGraph:
    """Like `capture`, letting export keep any tensor dimension symbolic where the code allows.

    Used for calls that carry a KV cache, whose length grows by one at every decode step.
    `CapturedGraph.dynamic_inputs` lists the (flat input index, dim) pairs left symbolic, flat
    inputs being the tensor and non-tensor leaves of `(args, kwargs)` in pytree order.
    """
    shapes = tree_map_only(torch.Tensor, lambda t: dict.fromkeys(range(t.dim()), Dim.AUTO), args)
    shapes = tree_map(lambda v: v if isinstance(v, dict) else None, shapes, is_leaf=_is_dims)
    program = torch.export.export(module, args, kwargs, dynamic_shapes=shapes, strict=False)
    names = program.graph_signature.user_inputs
    values = {n.name: n.meta.get("val") for n in program.graph.find_nodes(op="placeholder")}
    dynamic = tuple(
        (index, dim)
        for index, name in enumerate(names)
        if isinstance(values.get(name), torch.Tensor)
        for dim, size in enumerate(values[name].shape)
        if isinstance(size, torch.SymInt)
    )
    gm = program.module()
    gm.meta["frontend"] = "export"
    return CapturedGraph("export", gm, dynamic_inputs=dynamic)


def _is_dims(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, int) for k in value)
