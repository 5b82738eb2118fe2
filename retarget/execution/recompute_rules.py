"""Which ops selective activation checkpointing keeps, and which it recomputes: a table.

Selective checkpointing (`ac[policy=selective]`) runs a block under non-reentrant
`torch.utils.checkpoint`; the outputs of the ops in `SAVED_OPS` are kept in forward and handed
back during recompute; every other op runs again in backward (torchtitan's op-level policy). The
split follows cost: matmuls, convolutions and attention do O(n^3)-ish work per byte they write,
so recomputing them costs time while keeping them costs only their output; norms, activations,
rotary embeddings, dropout masks and views do a few operations per element, so recomputing them
is cheap and keeps the bulk of a block's activations out of memory. In fp8 the amax reductions
are kept too, so recompute sees the scales forward used.

Why not keep more (softmax, silu * up): on the bench model (TinyLM width 64, 16 blocks, seq 512,
one CPU thread) the extra step time of selective is not the cheap ops' arithmetic but the
machinery around them: a Python round trip per op through the dispatch mode, in forward and in
recompute. Keeping a cheap op's output through the mode costs that round trip and saves only the
op: keeping every op's output, so that recompute computes nothing, was slower than this table
(CPU time against no checkpointing, one interleaved run: 1.27x against 1.20x). What buys time
is crossing into Python for fewer ops: selective_scope.py enters the mode only at the graph
calls in `KEPT_CALLS`, so the cheap ops run at C++ speed (bench/README.md has the numbers). The
table is unchanged, and so is the cut (~40% of activations).

The policy is decided at the dispatcher, on aten ops, so it means the same whether a block runs
its captured graph or eagerly (a graph's `aten.linear` reaches the dispatcher as `aten.addmm` /
`aten.mm`, which is what the table names). An op that writes into a buffer it is given (`mm.out`)
is never kept (`is_saved`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

aten = torch.ops.aten

#: Ops whose outputs selective checkpointing keeps, with why; everything else is recomputed.
SAVED_OPS: dict[torch._ops.OpOverloadPacket, str] = {
    aten.mm: "matmul",
    aten.addmm: "matmul",
    aten.bmm: "matmul",
    aten.baddbmm: "matmul",
    aten._scaled_mm: "fp8 matmul",
    aten.convolution: "convolution",
    aten._convolution: "convolution",
    aten._scaled_dot_product_flash_attention_for_cpu: "attention",
    aten._scaled_dot_product_flash_attention: "attention",
    aten._scaled_dot_product_efficient_attention: "attention",
    aten._scaled_dot_product_cudnn_attention: "attention",
    aten._flash_attention_forward: "attention",
    aten._efficient_attention_forward: "attention",
    aten.amax: "fp8 amax",
    aten.max: "fp8 amax",
}


#: Calls in a captured graph that can reach a SAVED_OPS op at the dispatcher (the op itself, or
#: an op that decomposes into one above autograd: `linear` into `t` + `mm`). selective_scope.py
#: enters the keeping mode only around these; any other call's ops are recomputed. A matmul
#: hidden in a call missing here is recomputed, not lost: slower, never wrong.
KEPT_CALLS: frozenset[torch._ops.OpOverloadPacket] = frozenset(SAVED_OPS) | {
    aten.linear,
    aten.matmul,
    aten.einsum,
    aten.tensordot,
    aten.bilinear,
    aten.addbmm,
    aten.chain_matmul,
    aten.conv1d,
    aten.conv2d,
    aten.conv3d,
    aten.conv_transpose1d,
    aten.conv_transpose2d,
    aten.conv_transpose3d,
    aten.scaled_dot_product_attention,
}

_DECIDED: dict[torch._ops.OpOverload, bool] = {}


def is_saved(op: torch._ops.OpOverload) -> bool:
    """Whether selective checkpointing keeps the output of `op` (an aten overload).

    An overload that writes into a tensor it is given (`mm.out`, as inductor's generated code
    calls it, or an in-place op) is never kept: its output is the caller's buffer, which the
    caller goes on to reuse, so replaying it would hand back overwritten values.
    """
    decided = _DECIDED.get(op)
    if decided is None:
        schema = getattr(op, "_schema", None)
        mutates = schema is not None and schema.is_mutable
        decided = getattr(op, "overloadpacket", None) in SAVED_OPS and not mutates
        _DECIDED[op] = decided
    return decided


def selective_policy(ctx, op: torch._ops.OpOverload, *args, **kwargs) -> CheckpointPolicy:
    """`create_selective_checkpoint_contexts` policy: keep SAVED_OPS, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if is_saved(op) else CheckpointPolicy.PREFER_RECOMPUTE


#: context_fn for torch.utils.checkpoint: a fresh pair of selective contexts per call.
selective_contexts: Callable = functools.partial(
    create_selective_checkpoint_contexts, selective_policy
)
