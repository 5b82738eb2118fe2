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

from retarget.frontends.binding import CapturedGraph


def capture(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> CapturedGraph:
    program = torch.export.export(module, args, kwargs, strict=False)
    gm = program.module()
    gm.meta["frontend"] = "export"
    return CapturedGraph("export", gm)
