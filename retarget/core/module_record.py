"""One frozen record per module: what the passes decided about running its calls.

A pass that changes how a module's calls run (capture_regions: run a region's graph;
insert_autocast: run under autocast; checkpoint_blocks: recompute in backward) does not add a
behaviour class of its own: it re-classes the module once as `Retargeted<Class>` (the execution
layer's one mixin, execution/module_call.py) and writes its decision into this record. The
mixin's forward reads the record and composes the decisions in one fixed order (checkpoint,
then autocast, then the region's graph, then the module's own forward), so what a module does
is visible in one value, `record_of(module)`, instead of a stack of classes and slots.

    >>> record_of(model.layers[0])
    ModuleRecord(region=Region('model.layers.*'), path='model.layers.0', autocast=None,
                 checkpoint=BlockCheckpoint(policy='full', batchnorms=()))
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from retarget.core.slots import RECORD


@dataclass(frozen=True)
class ModuleRecord:
    """How retarget runs one module's calls (every field None/empty: as the user wrote it)."""

    region: Any = None
    """ir.region.Region: calls run the region's captured graph (its eager form without one)."""
    path: str = ""
    """The module's path in the compiled model (a region repeat's, for per-repeat graphs)."""
    autocast: Any = None
    """execution.autocast.LowPrecision: calls run under torch.autocast, outputs float32."""
    checkpoint: Any = None
    """execution.checkpoint.BlockCheckpoint: calls run under activation checkpointing."""


EMPTY = ModuleRecord()


def record_of(module: nn.Module) -> ModuleRecord:
    """The module's record (EMPTY for a module retarget runs as written)."""
    return RECORD.get(module, EMPTY)


def update_record(module: nn.Module, **changes: Any) -> ModuleRecord:
    """Replace fields of the module's record; returns the new record."""
    return RECORD.set(module, dataclasses.replace(record_of(module), **changes))


@contextlib.contextmanager
def records_replaced(modules: tuple[nn.Module, ...], **changes: Any) -> Iterator[None]:
    """The modules' records with `changes` meanwhile, put back as they were on exit."""
    saved = [(m, RECORD.get(m)) for m in modules]
    for module in modules:
        update_record(module, **changes)
    try:
        yield
    finally:
        for module, record in saved:
            if record is None:
                RECORD.pop(module)
            else:
                RECORD.set(module, record)
