"""Context parallelism applied: the (dp, cp) mesh, the cp group bound to the attention op, and
the compiled model's calls routed through the sequence split.

apply_plan calls `apply_context` after DDP or FSDP2 wrapped the model over every rank (their
average over all ranks is what `batch.whole_loss` scales for). The mesh (core.parallel_dims) is
(world / size, size) with cp innermost, as Accelerate and torchtitan lay it out: the ranks of a cp
group are consecutive. The compiled model's outer call (the OUTER_FORWARD slot: DDP's call, or the
model's own) is wrapped: the whole batch in, `batch.split_call` to this rank's share, the
whole loss out (`batch.with_whole_loss`). Outputs other than the loss (logits, hidden states)
are this rank's positions of the sequence.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from torch import nn

from retarget.core.parallel_dims import Meshes
from retarget.core.slots import OUTER_FORWARD
from retarget.execution.context.attention import layout_of, rebind_layout
from retarget.execution.context.batch import split_call, with_whole_loss
from retarget.execution.module_call import own_forward


def apply_context(module: nn.Module, layout_key: int, meshes: Meshes) -> Any:
    """Bind the cp group and wrap the model's calls; returns the (dp, cp) DeviceMesh."""
    cp = meshes["cp"]
    rebind_layout(
        layout_key,
        dataclasses.replace(layout_of(layout_key), group=cp.get_group(), rank=cp.get_local_rank()),
    )
    inner = OUTER_FORWARD.get(module)
    OUTER_FORWARD.set(module, functools.partial(_split_forward, layout_key, inner, module))
    return meshes.mesh


def refuse_unlaunched(module: nn.Module, size: int) -> None:
    """In a world of one, a model planned for cp cannot run: say so at its first call."""
    OUTER_FORWARD.set(module, functools.partial(_refuse, size))


def _refuse(size: int, *args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(
        f"this model was compiled for cp[size={size}] and needs {size} processes per context-"
        "parallel group; it runs in one process here (planning only): launch it with retarget "
        "launch / torchrun, or compile it without cp"
    )


def _split_forward(
    layout_key: int, inner: Any, module: nn.Module, *args: Any, **kwargs: Any
) -> Any:
    layout = layout_of(layout_key)
    args, kwargs = split_call(layout, args, kwargs)
    output = inner(*args, **kwargs) if inner is not None else own_forward(module, *args, **kwargs)
    return with_whole_loss(layout, output)
