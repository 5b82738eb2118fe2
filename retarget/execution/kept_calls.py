"""Selective checkpointing's keeping modes, entered only at a scoped graph's kept calls.

passes/memory/selective_scope.py rewrites a selective repeat's graph so that each call that can
reach a kept op (recompute_rules.KEPT_CALLS) becomes `run_kept(op, ...)`. At step time
`run_kept` enters this thread's keeping mode around that one call, if a selective checkpoint is
running (`scoped_contexts`, torch.utils.checkpoint's context_fn):

- in forward, `KeepOutputs` runs the call and keeps (detached) the outputs of the SAVED_OPS it
  reaches, per op, in call order;
- in recompute, `ReplayOutputs` hands those outputs back instead of running the op, so autograd
  records the op again (saving its recomputed inputs) without its cost;
- every other op runs with no mode at all: in recompute it simply runs again.

A call with no graph runs its whole forward under the modes (`eager_form`), as torch's form
does. Nothing here applies while dynamo traces (`run_kept` is then the plain call).
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from retarget.execution.recompute_rules import is_saved

SCOPED = "selective_scoped"
#: The modes of the selective checkpoint running on this thread (backward may run on another).
_ACTIVE = threading.local()


def _detached(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    # Under the mode autograd's view tracking is off; turn it on for the detach, so the kept
    # tensor shares the version counter of the output and a later in-place write shows.
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return value.detach()


class _KeptOutputs:
    """What forward kept: per op, its outputs in call order, with their versions."""

    def __init__(self) -> None:
        self.outputs: dict[Any, deque] = defaultdict(deque)
        #: data pointers of the kept outputs' storages (graph_checkpoint saves views as is)
        self.held: set[int] = set()

    def keep(self, func: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor):  # one tensor (a matmul's): no pytree walk
            kept = _detached(out)
            self.outputs[func].append((kept, kept._version))
            self.held.add(kept.untyped_storage().data_ptr())
            return
        kept = tree_map(_detached, out)
        self.outputs[func].append((kept, tree_map(_version, kept)))
        for tensor in tree_leaves(kept):
            if isinstance(tensor, torch.Tensor):
                self.held.add(tensor.untyped_storage().data_ptr())

    def keep_computed(self, func: Any, out: torch.Tensor) -> None:
        """Keep `out`, which `func` computed with no mode entered (its plain detach shares the
        version counter)."""
        kept = out.detach()
        self.outputs[func].append((kept, kept._version))
        self.held.add(kept.untyped_storage().data_ptr())

    def replay(self, func: Any) -> Any:
        queue = self.outputs.get(func)
        if not queue:
            raise RuntimeError(
                f"selective checkpointing: backward recomputes {func} more often than forward "
                "ran it (a second backward through the block, or forward and recompute took "
                "different paths)"
            )
        kept, versions = queue.popleft()
        now = kept._version if isinstance(kept, torch.Tensor) else tree_map(_version, kept)
        if now != versions:
            raise RuntimeError(
                f"selective checkpointing: the output of {func} kept for backward was modified "
                "in place after forward"
            )
        return kept


def _version(value: Any) -> int | None:
    return value._version if isinstance(value, torch.Tensor) else None


class KeepOutputs(TorchDispatchMode):
    """Forward: run every op, keep the outputs of the SAVED_OPS."""

    def __init__(self, store: _KeptOutputs) -> None:
        super().__init__()
        self.store = store

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # never entered while dynamo traces (run_kept): no disable wrapper per op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if is_saved(func):
            self.store.keep(func, out)
        return out


class ReplayOutputs(TorchDispatchMode):
    """Recompute: hand back the kept outputs of the SAVED_OPS, run every other op."""

    def __init__(self, store: _KeptOutputs) -> None:
        super().__init__()
        self.store = store

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # never entered while dynamo traces (run_kept): no disable wrapper per op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if is_saved(func):
            return self.store.replay(func)
        return func(*args, **(kwargs or {}))


class _Active:
    """Makes `mode` this thread's selective mode while entered (re-enterable: a second
    backward enters the recompute context again, and is then refused by the replay)."""

    def __init__(self, mode: TorchDispatchMode) -> None:
        self.mode = mode
        self.before: list[Any] = []

    def __enter__(self) -> None:
        self.before.append(getattr(_ACTIVE, "mode", None))
        _ACTIVE.mode = self.mode

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.mode = self.before.pop()


def scoped_contexts() -> tuple[Any, Any]:
    """context_fn for torch.utils.checkpoint: make this call's modes the thread's active ones."""
    store = _KeptOutputs()
    return _Active(KeepOutputs(store)), _Active(ReplayOutputs(store))


def run_kept(op: Callable, *args: Any, **kwargs: Any) -> Any:
    """A kept call of a graph: under the active selective mode, if any; else the plain call.

    In forward, a call that is itself a kept op (an `mm`, a linear folded to its `mm`) needs no
    mode: it runs plainly and its output is kept; only recompute enters the mode, to hand the
    output back under autograd."""
    if torch.compiler.is_compiling():
        return op(*args, **kwargs)
    mode = getattr(_ACTIVE, "mode", None)
    if mode is None:
        return op(*args, **kwargs)
    if op is _LINEAR and _folds_to_mm(*args, **kwargs):
        return _linear_with_mm_under(mode, *args)
    if type(mode) is KeepOutputs and _is_kernel(op):
        out = op(*args, **kwargs)
        mode.store.keep_computed(op, out)
        return out
    with mode:
        return op(*args, **kwargs)


_LINEAR = torch.ops.aten.linear.default
_MM = torch.ops.aten.mm.default
_KERNEL: dict[Any, bool] = {}


def _is_kernel(op: Any) -> bool:
    """Whether `op` is a kept op that reaches the dispatcher as itself (no decomposition above
    autograd) with one tensor out: what the mode would have kept is then its own output."""
    decided = _KERNEL.get(op)
    if decided is None:
        decided = (
            isinstance(op, torch._ops.OpOverload)
            and is_saved(op)
            and not torch._C._dispatch_has_kernel_for_dispatch_key(
                op.name(), "CompositeImplicitAutograd"
            )
            and len(op._schema.returns) == 1
            and str(op._schema.returns[0].type) == "Tensor"
        )
        _KERNEL[op] = decided
    return decided


def _folds_to_mm(x: Any, weight: Any, bias: Any = None, **kwargs: Any) -> bool:
    """Whether aten.linear(x, weight) runs exactly as t, view, mm, _unsafe_view (no bias, a
    contiguous 3-d input: how its matmul folds the batch into one mm; no autocast, which would
    cast linear's inputs before the view rather than mm's after it)."""
    return (
        bias is None
        and not torch.is_autocast_enabled(x.device.type if isinstance(x, torch.Tensor) else "cpu")
        and not kwargs
        and isinstance(x, torch.Tensor)
        and isinstance(weight, torch.Tensor)
        and x.dim() == 3
        and weight.dim() == 2
        and x.is_contiguous()
    )


def _linear_with_mm_under(mode: TorchDispatchMode, x: torch.Tensor, weight: torch.Tensor) -> Any:
    """aten.linear's own ops in its order, with only the mm under the mode (in forward not even
    that: the mm's output is kept as computed): its three view ops would each cross into Python
    for nothing (the same autograd nodes, the same saved tensors)."""
    aten = torch.ops.aten
    transposed = aten.t.default(weight)
    folded = aten.view.default(x, [-1, x.shape[-1]])
    if type(mode) is KeepOutputs:
        out = _MM(folded, transposed)
        mode.store.keep_computed(_MM, out)
    else:
        with mode:
            out = _MM(folded, transposed)
    return aten._unsafe_view.default(out, [*x.shape[:-1], weight.shape[0]])


def is_scoped(gm: fx.GraphModule) -> bool:
    """Whether `scope_kept_calls` scoped this graph's kept calls."""
    return gm.meta.get(SCOPED, False)


def eager_form(forward: Callable[..., Any]) -> Callable[..., Any]:
    """Region eager form: a call with no graph runs whole under the active mode, if any."""

    def scoped_forward(*args: Any, **kwargs: Any) -> Any:
        mode = getattr(_ACTIVE, "mode", None)
        if mode is None or torch.compiler.is_compiling():
            return forward(*args, **kwargs)
        with mode:
            return forward(*args, **kwargs)

    return scoped_forward
