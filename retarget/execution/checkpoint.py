"""Activation checkpointing at step time: a repeat's call under non-reentrant checkpoint.

checkpoint_blocks (passes/memory/) decides which repeats recompute and with which policy and
records a `BlockCheckpoint` for each (`install_checkpoint`); RetargetedModule's forward then runs
every call of such a repeat through `run_checkpointed`:

- `full`: torch.utils.checkpoint around the repeat's call (region graph or eager forward);
- `selective`: the same under the keeping modes of kept_calls.py, entered at the kept calls of
  a scoped graph, around the whole eager form otherwise, or torch's
  `create_selective_checkpoint_contexts` for a compiled call; a scoped graph with no random op,
  outside autocast, takes graph_checkpoint.py's lighter checkpoint instead of torch's;
- BatchNorm running stats inside a recomputed block are put back after the recompute, so they
  advance once per step;
- a KV cache among the arguments: the checkpointed function is made pure in it
  (frontends.state.checkpointed_call), so the recompute sees the cache as forward did.

A lazily captured signature is captured before the checkpoint starts (the region's
`graph_for_call`), not inside it. Nothing is checkpointed when grad is off or while a capture
traces the block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import noop_context_fn

from retarget.execution.graph_checkpoint import applies, graph_checkpoint
from retarget.execution.kept_calls import is_scoped, scoped_contexts
from retarget.execution.recompute_rules import selective_contexts
from retarget.frontends.state import checkpointed_call

#: Checkpoint policies of one repeat.
NONE, SELECTIVE, FULL = "none", "selective", "full"
POLICIES = (NONE, SELECTIVE, FULL)


@dataclass(frozen=True)
class BlockCheckpoint:
    """How one repeat is checkpointed: its policy and the BatchNorms whose stats it guards."""

    policy: str
    batchnorms: tuple[str, ...] = ()

    def context_fn(self, module: nn.Module, scoped: bool = False):
        """torch.utils.checkpoint's context_fn for a call of `module`; `scoped`: its region
        enters the selective modes at kept calls itself (kept_calls.py)."""
        if self.policy == FULL and not self.batchnorms:
            return noop_context_fn

        def contexts():
            if self.policy == SELECTIVE:
                forward, recompute = scoped_contexts() if scoped else selective_contexts()
            else:
                forward, recompute = contextlib.nullcontext(), contextlib.nullcontext()
            if self.batchnorms:  # outermost: its copies must not run inside a selective mode
                kept = running_stats_kept(module, self.batchnorms)
                recompute = _entered_together(kept, recompute)
            return forward, recompute

        return contexts


def block_checkpoint(module: nn.Module, policy: str) -> BlockCheckpoint:
    """The checkpoint of `module` under `policy`, guarding its tracked BatchNorm stats."""
    batchnorms = tuple(
        name
        for name, m in module.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    )
    return BlockCheckpoint(policy, batchnorms)


def run_checkpointed(
    module: nn.Module,
    record: Any,
    args: tuple,
    kwargs: dict,
    inner: Callable[[nn.Module, Any, tuple, dict], Any],
) -> Any:
    """`inner(module, record, args, kwargs)` (the rest of the module's call) checkpointed as
    `record.checkpoint` says."""

    def forward(*call_args: Any, **call_kwargs: Any) -> Any:
        return inner(module, record, call_args, call_kwargs)

    region = record.region
    graph, scoped = None, False
    if region is not None:
        # A new signature is captured out here; a known one is the last call's (cached).
        graph = region.graph_for_call(module, args, kwargs)
        # Uncompiled, the region scopes the modes itself: at kept calls of a scoped graph, or
        # around the whole eager form. A compiled call runs under torch's whole-block form.
        scoped = region.runner is None and (graph is None or is_scoped(graph.gm))
    setting: BlockCheckpoint = record.checkpoint
    if (
        scoped
        and graph is not None
        and setting.policy == SELECTIVE
        and not setting.batchnorms
        and applies(graph.gm, args, kwargs)
    ):
        return graph_checkpoint(module, forward, args, kwargs, scoped_contexts)
    context_fn = setting.context_fn(module, scoped)
    # A KV cache among the inputs: the recompute must see it as the forward did and must not
    # update it a second time; checkpointed_call makes the function pure in the cache.
    return checkpointed_call(forward, args, kwargs, context_fn=context_fn)


@contextlib.contextmanager
def running_stats_kept(module: nn.Module, names: tuple[str, ...]) -> Iterator[None]:
    """Put the BatchNorm running stats of `module` back as they were on exit."""
    saved = []
    for name in names:
        norm = module.get_submodule(name)
        if norm.training:
            for key in ("running_mean", "running_var", "num_batches_tracked"):
                buffer = getattr(norm, key, None)
                if buffer is not None:
                    saved.append((buffer, buffer.detach().clone()))
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


@contextlib.contextmanager
def _entered_together(first, second) -> Iterator[None]:
    with first, second:
        yield
