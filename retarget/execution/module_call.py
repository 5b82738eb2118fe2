"""RetargetedModule: the one class through which retarget runs a module's calls.

Every module whose calls a pass changed (a region repeat, an autocast leaf, a checkpointed
block, the compiled root) is re-classed once as `Retargeted<Class>(RetargetedModule, Class)`, a
dynamic subclass, so `isinstance`, attributes and state_dict keys stay the user's. Its forward
reads the module's record (core/module_record.py) and composes what the passes decided, in one
fixed order, outermost first:

    checkpoint   recompute in backward (execution/checkpoint.py), unless grad is off or a
                 capture is tracing the block;
    autocast     run under torch.autocast, outputs float32 (execution/autocast.py), except
                 while a capture traces;
    region       run the region's captured graph, capturing a new call signature on a miss,
                 or its eager form (ir/region.py: Region.call);
    own forward  the user's code.

A capture traces a module with its region taken out of the record (`ir.region.running_eagerly`)
and `capturing()` true, so the graph records the user's computation and the passes' rewrites
are replayed on it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from retarget.core.capturing import capturing
from retarget.core.module_record import EMPTY, ModuleRecord, update_record
from retarget.core.modules import with_mixin
from retarget.core.slots import RECORD
from retarget.execution.checkpoint import run_checkpointed


class RetargetedModule(nn.Module):
    """Mixin of a module whose calls run as its record says (see the module docstring)."""

    _retarget_mixin = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        record = RECORD.get(self, EMPTY)
        if record.checkpoint is not None and not capturing() and torch.is_grad_enabled():
            return run_checkpointed(self, record, args, kwargs, call_as_recorded)
        return call_as_recorded(self, record, args, kwargs)


def call_as_recorded(module: nn.Module, record: ModuleRecord, args: tuple, kwargs: dict) -> Any:
    """The call inside the checkpoint: autocast, then the region's graph, then own forward."""
    if record.autocast is not None and not capturing():
        if record.region is None:  # the module's own forward itself (a glue leaf)
            forward = super(RetargetedModule, module).forward
        else:
            forward = lambda *a, **k: _region_or_own(module, record, a, k)  # noqa: E731
        return record.autocast.call(module, forward, args, kwargs)
    return _region_or_own(module, record, args, kwargs)


def _region_or_own(module: nn.Module, record: ModuleRecord, args: tuple, kwargs: dict) -> Any:
    own = super(RetargetedModule, module).forward
    if record.region is None:
        return own(*args, **kwargs)
    return record.region.call(module, args, kwargs, own)


def retarget_module(module: nn.Module, **decisions: Any) -> nn.Module:
    """Re-class `module` as Retargeted<Class> (once) and record `decisions` for its calls."""
    module = with_mixin(module, RetargetedModule)
    update_record(module, **decisions)
    return module


def own_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The module's recorded call, skipping any wrapper above RetargetedModule (what DDP's
    wrapper runs, once it has done its own part of the call)."""
    return RetargetedModule.forward(module, *args, **kwargs)
