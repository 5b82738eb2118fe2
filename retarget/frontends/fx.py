"""Frontend 2: torch.fx.symbolic_trace, with every non-tensor argument made concrete.

fx keeps leaf modules as `call_module` nodes and is fast, but it cannot see through HF's forward
wrappers, `*args`/`**kwargs` forwards or data-dependent control flow, and it silently drops
`with torch.autocast` blocks; the eager check in `check.py` rejects such silent mistakes.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from retarget.core.modules import original_class
from retarget.frontends.binding import CapturedGraph

_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def capture(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> CapturedGraph:
    # A region's class carries our mixin, whose forward is variadic and dispatches to graphs;
    # trace the user's own forward, on a view of the module that shares its state.
    plain = _as_original(module)
    signature = inspect.signature(plain.forward)
    if any(p.kind in _VARIADIC for p in signature.parameters.values()):
        raise NotImplementedError("forward takes *args or **kwargs")
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    concrete = {k: v for k, v in bound.arguments.items() if not isinstance(v, torch.Tensor)}
    gm = torch.fx.symbolic_trace(plain, concrete_args=concrete)
    gm.meta["frontend"] = "fx"
    return CapturedGraph("fx", gm, positional=tuple(bound.arguments), signature=signature)


def _as_original(module: nn.Module) -> nn.Module:
    """`module` itself, or an instance of its original class sharing its `__dict__` (state)."""
    cls = original_class(module)
    if cls is type(module):
        return module
    view = cls.__new__(cls)
    view.__dict__ = module.__dict__
    return view
