"""Stateful arguments: objects a block reads and updates in place, such as KV caches.

Hugging Face decoder layers receive a cache object (DynamicCache, EncoderDecoderCache, ...) and
call its `update`, which replaces the cached key/value tensors and advances counters. Tracers
refuse such an input, and a graph could not carry the mutation anyway. We lift the object out:

- its *layout* splits it into the tensors it holds (a flat list, deduplicated by identity) and a
  *skeleton*: classes, ints, flags, list and dict shapes, with each tensor replaced by its index.
  The skeleton and the tensors' shapes are part of the call signature;
- the graph is captured from a functional view of the block (`functional_view`): it rebuilds the
  objects from the tensors, runs the block's own forward, and returns the output together with
  the tensors of the objects after the call; the skeleton after the call is recorded then;
- at run time (`StateCall.run`) the live objects' tensors go into the graph, and the returned
  tensors and the recorded skeleton are written back into the live objects, in place, so the
  caller's reference sees the update exactly as after an eager call.

Any argument that is not a tensor, a container, a module or a plain value counts as state; an
object without tensors (an empty cache at the first forward) is lifted too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from retarget.core.modules import original_class
from retarget.frontends.state_layers import narrow, widen
from retarget.frontends.state_layout import (
    Skeleton,
    describe,
    is_state,
    layout,
    rebuild,
    write_back,
)

#: Stands in for a lifted object among the traced call's arguments (a pytree leaf, unlike None).
STATE_MARKER = "<retarget: lifted state>"


@dataclass
class StateCall:
    """Where a call's stateful arguments sit, and what the captured call leaves in them.

    `positions` are the indices of the stateful leaves in `tree_flatten((args, kwargs))`;
    `index` the layer number the graph was traced at (None: the objects are taken whole);
    `before` their (narrowed) skeletons at capture; `after` (filled in while tracing) their
    skeletons after the call, indexing the tensors the graph returns.
    """

    positions: tuple[int, ...]
    index: int | None
    before: tuple[Skeleton, ...]
    tensors: int = 0
    """How many tensors the objects hold (the graph's first inputs)."""
    after: tuple[Skeleton, ...] | None = None

    def split(
        self, args: tuple, kwargs: dict, live_index: int | None
    ) -> tuple[list[Any], list[Any], list[torch.Tensor], tuple, dict]:
        """(live objects, what the graph sees of them, its tensors, args and kwargs with the
        objects replaced by `STATE_MARKER`)."""
        leaves, spec = tree_flatten((args, kwargs))
        objects = [leaves[i] for i in self.positions]
        for i in self.positions:
            leaves[i] = STATE_MARKER
        seen = objects
        if self.index is not None and live_index is not None:
            seen = narrow(objects, live_index, self.index)
        _, tensors = layout(seen)
        plain_args, plain_kwargs = tree_unflatten(leaves, spec)
        return objects, seen, tensors, plain_args, plain_kwargs

    def run(
        self, forward: Callable[..., Any], args: tuple, kwargs: dict, live_index: int | None
    ) -> Any:
        """Call a captured graph's `forward(tensors, args, kwargs)` and update the objects."""
        if self.after is None:
            raise RuntimeError("the state layout after the call was not recorded at capture")
        objects, seen, tensors, plain_args, plain_kwargs = self.split(args, kwargs, live_index)
        output, tensors_after = forward(tensors, plain_args, plain_kwargs)
        write_back(seen, self.after, list(tensors_after))
        if seen is not objects:
            widen(objects, seen, live_index, self.index)
        return output


def find_state(args: tuple, kwargs: dict, index: int | None) -> StateCall | None:
    """The layout of a call's stateful arguments for a block at layer `index`, or None."""
    leaves, _ = tree_flatten((args, kwargs))
    positions = tuple(i for i, leaf in enumerate(leaves) if is_state(leaf))
    if not positions:
        return None
    objects = [leaves[i] for i in positions]
    if index is not None:
        objects = narrow(objects, index, index)
    before, tensors = layout(objects)
    return StateCall(positions, index, before, len(tensors))


def describe_state(value: Any, index: int | None) -> tuple:
    """The signature of a stateful argument as a block at layer `index` sees it.

    Narrowed to position 0, so every repeat of a block with equal per-layer state matches.
    """
    objects = [value] if index is None else narrow([value], index, 0)
    skeletons, tensors = layout(objects)
    return describe(skeletons[0], tensors)


def copy_state_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """(args, kwargs) with every stateful object replaced by an independent copy.

    Tensors are cloned (detached): a copy can be run and mutated without touching the original.
    """
    leaves, spec = tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(leaves) if is_state(leaf)]
    if not positions:
        return args, kwargs
    skeletons, tensors = layout([leaves[i] for i in positions])
    with torch.no_grad():
        clones = [_same_layout_copy(t) for t in tensors]
    for i, copy in zip(positions, rebuild(skeletons, clones), strict=True):
        leaves[i] = copy
    return tree_unflatten(leaves, spec)


def _same_layout_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy with the same strides (a cache slice that is a view of a longer tensor stays one:
    kernels may take another path on another layout)."""
    copy = torch.empty_strided(
        tensor.size(), tensor.stride(), dtype=tensor.dtype, device=tensor.device
    )
    return copy.copy_(tensor.detach())


def state_objects(args: tuple, kwargs: dict) -> list[Any]:
    """The stateful objects among a call's arguments, in flattening order."""
    leaves, _ = tree_flatten((args, kwargs))
    return [leaf for leaf in leaves if is_state(leaf)]


def on_copies(
    forward: Callable[..., Any], args: tuple, kwargs: dict
) -> tuple[Callable[..., Any], list[torch.Tensor], Callable[[Any], Any]] | None:
    """`forward(*args, **kwargs)` as a pure function of the stateful objects' tensors.

    Returns None when the call has no stateful argument, else `(pure, tensors, commit)`:
    `pure(tensors, *args, **kwargs)` runs `forward` on fresh copies of the objects rebuilt from
    `tensors` (the live ones are not touched) and returns (output, tensors after);
    `commit(result)` writes the copies' final state into the live objects and returns the output.
    A caller that may run `pure` twice (checkpoint's recompute) thus sees the same cache both
    times and updates the live cache once.
    """
    live = state_objects(args, kwargs)
    if not live:
        return None
    skeletons, tensors = layout(live)
    after: list[tuple[Skeleton, ...]] = []

    def pure(state_tensors: list[torch.Tensor], *call_args: Any, **call_kwargs: Any) -> Any:
        copies = rebuild(skeletons, list(state_tensors))
        leaves, spec = tree_flatten((call_args, call_kwargs))
        positions = [i for i, leaf in enumerate(leaves) if is_state(leaf)]
        for i, copy in zip(positions, copies, strict=True):
            leaves[i] = copy
        full_args, full_kwargs = tree_unflatten(leaves, spec)
        output = forward(*full_args, **full_kwargs)
        final, tensors_after = layout(copies)
        after[:] = [final]
        return output, tensors_after

    def commit(result: Any) -> Any:
        output, tensors_after = result
        write_back(live, after[0], list(tensors_after))
        return output

    return pure, tensors, commit


def checkpointed_call(
    forward: Callable[..., Any], args: tuple, kwargs: dict, **options: Any
) -> Any:
    """`forward(*args, **kwargs)` under non-reentrant torch.utils.checkpoint, cache-safe.

    With a stateful argument the checkpointed function is pure in it (`on_copies`): the
    recompute sees the cache as the forward did, and the live cache is updated once.
    """
    options = {"use_reentrant": False, "preserve_rng_state": True, **options}
    stateful = on_copies(forward, args, kwargs)
    if stateful is None:
        return checkpoint(forward, *args, **options, **kwargs)
    pure, tensors, commit = stateful
    return commit(checkpoint(pure, tensors, *args, **options, **kwargs))


def functional_view(module: nn.Module, forward: Callable[..., Any], state: StateCall) -> nn.Module:
    """A module sharing `module`'s state whose forward is `forward` made functional in the state.

    Its forward takes `(tensors, args, kwargs)` (the stateful objects replaced by
    `STATE_MARKER`),
    rebuilds the objects from `tensors`, calls `forward(self, *args, **kwargs)`, records the
    objects' skeletons after the call in `state.after`, and returns (output, their tensors).
    Parameters keep their paths, since the view shares the module's `__dict__`.
    """

    def functional(self, tensors, args, kwargs):
        objects = rebuild(state.before, list(tensors))
        leaves, spec = tree_flatten((args, kwargs))
        for i, obj in zip(state.positions, objects, strict=True):
            leaves[i] = obj
        full_args, full_kwargs = tree_unflatten(leaves, spec)
        output = forward(self, *full_args, **full_kwargs)
        state.after, tensors_after = layout(objects)
        return output, tensors_after

    # On the user's class, not the live one: FSDP2's class (fully_shard) cannot be subclassed.
    cls = original_class(module)
    view_cls = type(f"Functional{cls.__name__}", (cls,), {"forward": functional})
    view = object.__new__(view_cls)
    view.__dict__ = module.__dict__
    return view


__all__ = [
    "STATE_MARKER",
    "StateCall",
    "checkpointed_call",
    "copy_state_args",
    "describe_state",
    "find_state",
    "functional_view",
    "on_copies",
    "state_objects",
]
