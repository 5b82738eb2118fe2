"""Frontend 3: torch._dynamo.export (one graph, no graph breaks allowed).

dynamo reads Python bytecode, so it handles some code fx cannot; its graphs are flat (parameters
become graph attributes with mangled names), which `binding.relink_attributes` maps back to the
module's own paths.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from retarget.frontends.binding import CapturedGraph


def capture(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> CapturedGraph:
    gm, _guards = torch._dynamo.export(module)(*args, **kwargs)
    gm.meta["frontend"] = "dynamo"
    return CapturedGraph("dynamo", gm)
