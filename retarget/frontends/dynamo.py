"""Frontend 3: torch._dynamo.export (one graph, no graph breaks allowed).

dynamo reads Python bytecode, so it handles some code fx cannot; its graphs are flat (parameters
become graph attributes with mangled names), which `binding.relink_attributes` maps back to the
module's own paths.

A block FSDP2 shards (captured at step time, a new signature or a block split by tp) is marked
`_is_fsdp_managed_module`, which makes dynamo lift its parameters as graph inputs, and export
refuses inputs the call did not pass. The graph reads parameters from the live module at every
call anyway (FSDP2's unsharded ones while the block runs), so the mark is lowered while tracing.

dynamo records each node's traced value as `meta["example_value"]`; it is copied to
`meta["val"]`, where torch.export writes it, so the rules read one key.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from retarget.frontends.binding import CapturedGraph


def capture(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> CapturedGraph:
    with _unmanaged(module):
        gm, _guards = torch._dynamo.export(module)(*args, **kwargs)
    gm.meta["frontend"] = "dynamo"
    for node in gm.graph.nodes:  # the one key every rule reads (ir/nodes.py), as export writes
        if "example_value" in node.meta and "val" not in node.meta:
            node.meta["val"] = node.meta["example_value"]
    return CapturedGraph("dynamo", gm)


@contextlib.contextmanager
def _unmanaged(module: nn.Module) -> Iterator[None]:
    """Lower FSDP's `_is_fsdp_managed_module` mark on `module` and below meanwhile."""
    marked = [m for m in module.modules() if m.__dict__.get("_is_fsdp_managed_module")]
    for sub in marked:
        sub._is_fsdp_managed_module = False
    try:
        yield
    finally:
        for sub in marked:
            sub._is_fsdp_managed_module = True
