"""The context-parallel attention ops against whole-sequence attention on real gloo ranks.

Every rank builds the same whole q, k, v (seeded), keeps its positions, runs the op, and its
output and the gradients at its positions must equal torch's scaled_dot_product_attention on
the whole sequence (with the same causal / sliding-window mask), for each mode, contiguous and
zig-zag layouts, GQA and a key/value head count the group does not divide.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import run_ranks

#: (mode, balanced, causal, window, heads, kv_heads)
CASES = [
    ("ring", True, True, 0, 4, 2),
    ("ring", False, True, 0, 4, 4),
    ("ring", True, True, 5, 4, 2),
    ("ring", False, False, 0, 2, 1),
    ("allgather", True, True, 0, 4, 2),
    ("allgather", False, True, 7, 4, 4),
    ("ulysses", True, True, 0, 4, 2),
    ("ulysses", False, True, 6, 6, 6),
    ("ulysses", True, True, 0, 6, 3),
]


def _reference(q, k, v, causal, window):
    length = q.shape[2]
    pos = torch.arange(length)
    gap = pos[:, None] - pos[None, :]
    allowed = gap >= 0 if causal else torch.ones_like(gap, dtype=torch.bool)
    if window:
        allowed = allowed & (gap < window) & (gap > -window)
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=allowed
    )


def _compare(rank: int, world: int) -> list[tuple[str, float]]:
    import torch.distributed as dist

    from retarget.execution.context.attention import ContextLayout, register_layout
    from retarget.execution.process import ProcessState

    state = ProcessState.current()
    group = dist.group.WORLD
    results = []
    for mode, balanced, causal, window, heads, kv_heads in CASES:
        if mode == "ulysses" and heads % world:
            continue
        length = 4 * world
        gen = torch.Generator().manual_seed(7)
        q = torch.randn(2, heads, length, 8, generator=gen, dtype=torch.float64).requires_grad_()
        k = torch.randn(2, kv_heads, length, 8, generator=gen, dtype=torch.float64).requires_grad_()
        v = torch.randn(2, kv_heads, length, 8, generator=gen, dtype=torch.float64).requires_grad_()
        grad_out = torch.randn(2, heads, length, 8, generator=gen, dtype=torch.float64)
        expected = _reference(q, k, v, causal, window)
        expected.backward(grad_out)
        layout = ContextLayout(
            size=world, rank=state.rank, mode=mode, balanced=balanced, group=group
        )
        key = register_layout(layout)
        mine = layout.positions(state.rank, length)
        ql, kl, vl = (t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v))
        out, lse = torch.ops.retarget.context_attention(ql, kl, vl, 8**-0.5, causal, window, key)
        out.backward(grad_out[:, :, mine])
        worst = max(
            float((a.detach() - b[:, :, mine]).abs().max())
            for a, b in ((out, expected), (ql.grad, q.grad), (kl.grad, k.grad), (vl.grad, v.grad))
        )
        results.append(
            (
                f"{mode} balanced={balanced} causal={causal} window={window} {heads}/{kv_heads}",
                worst,
            )
        )
    return results


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_context_attention_equals_whole_sequence(world):
    for rank_results in run_ranks(_compare, world):
        for case, worst in rank_results:
            assert worst < 1e-10, case
