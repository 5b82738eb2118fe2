"""Profile what one forward keeps for backward, block by block, and what recomputing would cost.

One training-mode forward on the example inputs (grad enabled, RNG and buffers restored, no
backward) runs under a StorageTracker (measure.py) plus a saved-tensor hook. Every storage the
forward allocates is attributed to the repeated block running at the time, or to the glue.
For each block repeat we keep:

- `saved`: storages autograd saves for backward while the block runs (no checkpointing);
- `inputs`: the block's tensor inputs allocated during the step (a checkpoint keeps these);
- `kept`: outputs of the ops selective checkpointing keeps (recompute_rules.SAVED_OPS);
- what recomputing costs: FLOPs (torch.utils.flop_counter's table, matmul-class ops) and the
  elements the ops write, in total and in kept ops, over the ops a checkpoint's recompute runs
  (those before the last tensor the block saves; non-reentrant checkpoint stops there).

The glue keeps what it saves outside every block and the forward's outputs. From those sets,
`ActivationProfile.resident(plan)` predicts the activation memory left after forward under any
assignment of policies to repeats (none / selective / full) as the union of what each keeps,
so a storage two owners keep counts once. Storage identities are only labels here: the profile
holds no tensor once it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import flop_registry

from retarget.execution.checkpoint import FULL, NONE, SELECTIVE
from retarget.execution.recompute_rules import is_saved
from retarget.frontends.check import preserved_state
from retarget.passes.memory.measure import StorageTracker, tensor_storages, tensors_in

GLUE = "glue"


@dataclass
class BlockProfile:
    """What one repeat of a block keeps and computes in forward (see the module docstring)."""

    path: str
    group: str
    saved: dict[int, int] = field(default_factory=dict)
    inputs: dict[int, int] = field(default_factory=dict)
    kept: dict[int, int] = field(default_factory=dict)
    flops: int = 0
    kept_flops: int = 0
    elements: int = 0
    kept_elements: int = 0

    def keeps(self, policy: str) -> dict[int, int]:
        """Storages alive after forward on this block's account under `policy`."""
        if policy == NONE:
            return self.saved
        if policy == FULL:
            return self.inputs
        return {**self.inputs, **self.kept}

    def recompute_flops(self, policy: str) -> int:
        """Matmul-class FLOPs that backward spends recomputing this block under `policy`."""
        return {NONE: 0, SELECTIVE: self.flops - self.kept_flops, FULL: self.flops}[policy]

    def recompute_elements(self, policy: str) -> int:
        """Elements the cheap ops write again during recompute under `policy`."""
        return {NONE: 0, SELECTIVE: self.elements - self.kept_elements, FULL: self.elements}[policy]


@dataclass
class ActivationProfile:
    """Per-repeat profiles in module order, plus the glue's kept storages."""

    blocks: dict[str, BlockProfile]
    glue: dict[int, int]

    def resident(self, plan: Mapping[str, str]) -> dict[int, int]:
        """Storages alive after forward when each repeat follows `plan` (missing: none)."""
        union = dict(self.glue)
        for path, block in self.blocks.items():
            union.update(block.keeps(plan.get(path, NONE)))
        return union

    def bytes(self, plan: Mapping[str, str] | None = None) -> int:
        """Predicted activation bytes after forward under `plan` (default: no checkpointing)."""
        return sum(self.resident(plan or {}).values())

    def by_owner(self, plan: Mapping[str, str] | None = None) -> dict[str, int]:
        """`bytes(plan)` split by owner: the glue first, then each repeat, each storage once."""
        plan = plan or {}
        seen: set[int] = set()
        owners = {GLUE: self.glue}
        owners.update({p: b.keeps(plan.get(p, NONE)) for p, b in self.blocks.items()})
        split = {}
        for owner, storages in owners.items():
            fresh = {k: v for k, v in storages.items() if k not in seen}
            seen.update(fresh)
            split[owner] = sum(fresh.values())
        return split

    def transient(self, plan: Mapping[str, str]) -> int:
        """Extra bytes while backward recomputes the largest checkpointed repeat."""
        extra = [
            max(0, sum(b.saved.values()) - sum(b.keeps(plan[p]).values()))
            for p, b in self.blocks.items()
            if plan.get(p, NONE) != NONE
        ]
        return max(extra, default=0)


@dataclass
class _Call:
    """One call of a repeat: the cost of each op in order, and how many ran before the last
    tensor was saved (a checkpoint's recompute stops right there: early stop)."""

    block: BlockProfile
    ops: list[tuple[int, int, bool]] = field(default_factory=list)
    needed: int = 0

    def close(self) -> None:
        for flops, elements, kept in self.ops[: self.needed]:
            self.block.flops += flops
            self.block.elements += elements
            if kept:
                self.block.kept_flops += flops
                self.block.kept_elements += elements


class _Profiler(StorageTracker):
    def __init__(self, groups: Mapping[str, str]):
        super().__init__()
        self.blocks = {path: BlockProfile(path, group) for path, group in groups.items()}
        self.glue: dict[int, int] = {}
        self.stack: list[_Call] = []
        self.held: list[Any] = []  # keeps recorded storages alive, so their ids stay unique

    def record(self, into: dict[int, int], storage: torch.UntypedStorage) -> None:
        if self.is_new(storage) and id(storage) not in into:
            into[id(storage)] = storage.nbytes()
            self.held.append(storage)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # Detached: a node saving its own output (rsqrt, silu) would otherwise hold the output
        # object, whose grad_fn is that node: a cycle through C++ that gc never frees, which
        # kept the whole profiled forward (activations and transposed weights) alive.
        if not self.stack:
            self.record(self.glue, tensor.untyped_storage())
            return tensor.detach()
        call = self.stack[-1]
        call.needed = len(call.ops)  # parameters count too: a checkpoint recomputes up to here
        self.record(call.block.saved, tensor.untyped_storage())
        return tensor.detach()

    def on_op(self, func, args, kwargs, out, fresh) -> None:
        if not self.stack:
            return
        call = self.stack[-1]
        counter = flop_registry.get(func.overloadpacket)
        flops = int(counter(*args, **kwargs, out_val=out)) if counter else 0
        fresh_ids = {id(storage) for storage in fresh}
        elements = sum(t.numel() for t in tensors_in(out) if id(t.untyped_storage()) in fresh_ids)
        kept = is_saved(func)
        call.ops.append((flops, elements, kept))
        if kept:
            for storage in tensor_storages(out):
                self.record(call.block.kept, storage)

    def enter(self, path: str, args: tuple, kwargs: dict) -> None:
        call = _Call(self.blocks[path])
        self.stack.append(call)
        for storage in tensor_storages((args, kwargs)):
            self.record(call.block.inputs, storage)

    def leave(self) -> None:
        self.stack.pop().close()


def profile_activations(
    module: nn.Module,
    groups: Mapping[str, str],
    args: tuple,
    kwargs: dict,
    call: Callable[..., Any] | None = None,
) -> ActivationProfile:
    """Profile one forward of `module(*args, **kwargs)`; `groups` maps repeat path -> group name.
    `call` runs the forward instead of `module` (e.g. its own forward below a wrapper).

    Runs in training mode with grad enabled; RNG streams and buffers are restored afterwards and
    nothing is kept, so the profile leaves no trace on training.
    """
    profiler = _Profiler(groups)
    handles = []
    for path in groups:
        block = module.get_submodule(path)

        def enter(_m, a, k, path=path):
            profiler.enter(path, a, k)

        handles.append(block.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(block.register_forward_hook(lambda *_: profiler.leave()))
    hooks = torch.autograd.graph.saved_tensors_hooks(profiler.pack, lambda t: t)
    try:
        with preserved_state(module), torch.enable_grad(), hooks, profiler:
            out = (call or module)(*args, **kwargs)
            for storage in tensor_storages(out):
                profiler.record(profiler.glue, storage)
    finally:
        for handle in handles:
            handle.remove()
    del out
    profiler.held.clear()
    return ActivationProfile(blocks=profiler.blocks, glue=profiler.glue)
