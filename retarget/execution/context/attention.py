"""Attention over a sequence split across the ranks of a context-parallel group: ring,
all-gather and Ulysses, as two custom ops (`retarget::context_attention` and its backward).

Each rank holds the queries, keys and values of its own positions of the sequence
(`layout.positions(rank, length)`: contiguous chunks, or with `balanced` the zig-zag pair of
chunks r and 2N-1-r, so every rank has the same causal work). The result on every rank equals
the rows of whole-sequence attention at its positions, and the gradients equal the whole
sequence's gradients at its positions:

- ring: keys and values go round the ring (each rank sends to rank+1, receives from rank-1);
  each rank attends its queries to the chunk it holds and merges the partial results by their
  log-sum-exp (the online softmax rule); the backward sends the chunk round again with its
  key and value gradients, which arrive back at their owner after N steps.
- allgather: keys and values are gathered whole, attention runs locally; the backward
  reduce-scatters the key and value gradients back to their owners.
- ulysses: an all-to-all turns sequence shards into head shards (every rank then holds the
  whole sequence for heads/N of the heads), attention runs locally, and a second all-to-all
  turns the result back. Query heads must divide by N; key/value heads that do not are
  repeated to the query heads first.

Masks are built from global positions: causal (key position <= query position) and, for a
sliding window W, query - key < W (transformers' sliding-window rule). Scores and softmax run
in float32; the output has the queries' dtype. The custom ops take the layout as an integer
key into a registry (`register_layout`), so a captured graph (export, dynamo, compile) holds one
opaque node and the collectives run only when the graph runs. With no process group (planning
in one process), the ops attend within the local shard: the shapes are right, the values are
not, and nothing is trained that way.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

#: The three ways to split attention, as the `cp` part names them.
MODES = ("ring", "allgather", "ulysses")


@dataclass(frozen=True)
class ContextLayout:
    """One context-parallel group: its process group, this rank, and how the sequence is cut."""

    size: int
    rank: int
    mode: str
    balanced: bool
    group: dist.ProcessGroup | None = None
    causal: bool = True
    """Whether every attention the layout serves is causal (right padding is then harmless)."""

    def chunks(self, length: int) -> int:
        """How many equal chunks a sequence of `length` positions is cut into."""
        return 2 * self.size if self.balanced else self.size

    def positions(self, rank: int, length: int) -> Tensor:
        """The global positions rank `rank` holds of a sequence of `length` positions."""
        parts = self.chunks(length)
        if length % parts:
            raise ValueError(
                f"a sequence of {length} positions does not split into {parts} equal chunks "
                f"(cp[size={self.size}{', load_balance=true' if self.balanced else ''}])"
            )
        width = length // parts
        if not self.balanced:
            return torch.arange(rank * width, (rank + 1) * width)
        mirror = 2 * self.size - 1 - rank
        return torch.cat(
            [
                torch.arange(rank * width, (rank + 1) * width),
                torch.arange(mirror * width, (mirror + 1) * width),
            ]
        )

    def order(self, length: int) -> Tensor:
        """The global positions of the ranks' shards laid end to end in rank order."""
        return torch.cat([self.positions(r, length) for r in range(self.size)])

    @property
    def live(self) -> bool:
        """Whether collectives run (a process group of this size exists)."""
        return self.group is not None and self.size > 1


_LAYOUTS: dict[int, ContextLayout] = {}
_KEYS = itertools.count(1)


def register_layout(layout: ContextLayout) -> int:
    """Keep `layout` for the custom ops; the key they take names it."""
    key = next(_KEYS)
    _LAYOUTS[key] = layout
    return key


def layout_of(key: int) -> ContextLayout:
    return _LAYOUTS[key]


def rebind_layout(key: int, layout: ContextLayout) -> None:
    """Replace the layout under `key` (apply binds the process group the plan could not)."""
    _LAYOUTS[key] = layout


# --- one block of attention: queries at positions pq against keys at positions pk -------------


def _allowed(pq: Tensor, pk: Tensor, causal: bool, window: int) -> Tensor | None:
    """[Lq, Lk] True where the query may attend the key; None when every pair may."""
    if not causal and window <= 0:
        return None
    gap = pq[:, None] - pk[None, :]
    allowed = gap >= 0 if causal else torch.ones_like(gap, dtype=torch.bool)
    if window > 0:
        allowed = allowed & (gap < window) & (gap > -window)
    return allowed


def _expand_heads(x: Tensor, heads: int) -> Tensor:
    """Repeat key/value heads to the query heads (head h reads key/value head h // repeat)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold_heads(grad: Tensor, heads: int) -> Tensor:
    """The gradient of `_expand_heads`: sum the repeats back onto their key/value head."""
    b, h, length, d = grad.shape
    return grad if h == heads else grad.view(b, heads, h // heads, length, d).sum(2)


def _wide(x: Tensor) -> Tensor:
    """`x` in the dtype attention computes in: float32, or float64 when given float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _safe(lse: Tensor) -> Tensor:
    """The log-sum-exp with rows that attend nothing (-inf) set to 0, so exp() gives 0s."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _block_forward(
    q: Tensor, k: Tensor, v: Tensor, pq: Tensor, pk: Tensor, scale: float, causal: bool, window: int
) -> tuple[Tensor, Tensor] | None:
    """Float32 (out, lse) of q against one key/value block; None when the mask allows nothing."""
    allowed = _allowed(pq.to(q.device), pk.to(q.device), causal, window)
    if allowed is not None and not bool(allowed.any()):
        return None
    kk, vv = _wide(_expand_heads(k, q.shape[1])), _wide(_expand_heads(v, q.shape[1]))
    scores = torch.matmul(_wide(q), kk.transpose(-1, -2)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _safe(lse)[..., None])
    return torch.matmul(probs, vv), lse


def _merge(
    acc: tuple[Tensor, Tensor] | None, part: tuple[Tensor, Tensor] | None
) -> tuple[Tensor, Tensor] | None:
    """Combine two partial attentions over disjoint keys by their log-sum-exps."""
    if acc is None or part is None:
        return part if acc is None else acc
    (o1, l1), (o2, l2) = acc, part
    lse = torch.logaddexp(l1, l2)
    base = _safe(lse)
    return o1 * torch.exp(l1 - base)[..., None] + o2 * torch.exp(l2 - base)[..., None], lse


def _block_backward(
    dout: Tensor,
    delta: Tensor,
    lse: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pq: Tensor,
    pk: Tensor,
    scale: float,
    causal: bool,
    window: int,
) -> tuple[Tensor, Tensor, Tensor] | None:
    """Float32 (dq, dk, dv) of one block given the whole rows' lse and delta = rowsum(dO * O)."""
    allowed = _allowed(pq.to(q.device), pk.to(q.device), causal, window)
    if allowed is not None and not bool(allowed.any()):
        return None
    heads = q.shape[1]
    kk, vv, qq = _wide(_expand_heads(k, heads)), _wide(_expand_heads(v, heads)), _wide(q)
    scores = torch.matmul(qq, kk.transpose(-1, -2)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.exp(scores - _safe(lse)[..., None])
    dv = torch.matmul(probs.transpose(-1, -2), dout)
    dprobs = torch.matmul(dout, vv.transpose(-1, -2))
    dscores = probs * (dprobs - delta[..., None])
    dq = torch.matmul(dscores, kk) * scale
    dk = torch.matmul(dscores.transpose(-1, -2), qq) * scale
    return dq, _fold_heads(dk, k.shape[1]), _fold_heads(dv, k.shape[1])


def _empty_result(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    shape, wide = (*q.shape[:-1], v.shape[-1]), _wide(q).dtype
    return q.new_zeros(shape, dtype=wide), q.new_full(q.shape[:-1], float("-inf"), dtype=wide)


# --- collectives --------------------------------------------------------------------------------


def _ring_shift(layout: ContextLayout, tensors: list[Tensor]) -> list[Tensor]:
    """Send `tensors` to rank+1 and receive the same shapes from rank-1 (one batch of p2p ops)."""
    group = layout.group
    send_to = dist.get_global_rank(group, (layout.rank + 1) % layout.size)
    recv_from = dist.get_global_rank(group, (layout.rank - 1) % layout.size)
    tensors = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, send_to, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, recv_from, group) for r in received]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


def _gather_sequence(layout: ContextLayout, x: Tensor) -> Tensor:
    """[B, H, L, D] shards -> [B, H, N*L, D] in rank order."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(layout.size)]
    dist.all_gather(parts, x, group=layout.group)
    return torch.cat(parts, dim=2)


def _scatter_sum_sequence(layout: ContextLayout, x: Tensor) -> Tensor:
    """[B, H, N*L, D] per rank -> this rank's [B, H, L, D] chunk summed over the ranks."""
    chunks = torch.cat(x.chunk(layout.size, dim=2), dim=0)
    out = torch.empty_like(chunks[: x.shape[0]])
    # torch 2.13 renamed reduce_scatter_tensor (now deprecated) to reduce_scatter_single.
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(out, chunks, group=layout.group)
    return out


def _seq_to_heads(layout: ContextLayout, x: Tensor) -> Tensor:
    """[B, H, L, ...] sequence shards -> [B, H/N, N*L, ...] head shards (sequence in rank order)."""
    n = layout.size
    b, h = x.shape[:2]
    rest = x.shape[2:]
    send = x.reshape(b, n, h // n, *rest).movedim(1, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=layout.group)
    # recv[s] holds rank s's sequence shard of this rank's heads.
    recv = recv.movedim(0, 2)  # [B, H/N, N, L, ...]
    return recv.reshape(b, h // n, n * rest[0], *rest[1:])


def _heads_to_seq(layout: ContextLayout, x: Tensor) -> Tensor:
    """The inverse of `_seq_to_heads`: [B, H/N, N*L, ...] -> [B, H, L, ...]."""
    n = layout.size
    b, hn, total = x.shape[:3]
    rest = x.shape[3:]
    send = x.reshape(b, hn, n, total // n, *rest).movedim(2, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=layout.group)
    # recv[g] holds head group g of this rank's sequence shard.
    return recv.movedim(0, 1).reshape(b, n * hn, total // n, *rest)


# --- the three modes ------------------------------------------------------------------------------


def _forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, window: int, layout: ContextLayout
):
    length = q.shape[2] * layout.size
    mine = layout.positions(layout.rank, length)
    if not layout.live:
        return _block_forward(q, k, v, mine, mine, scale, causal, window) or _empty_result(q, v)
    if layout.mode == "allgather":
        order = layout.order(length)
        keys, values = _gather_sequence(layout, k), _gather_sequence(layout, v)
        return _block_forward(q, keys, values, mine, order, scale, causal, window) or _empty_result(
            q, v
        )
    if layout.mode == "ulysses":
        order = layout.order(length)
        heads = q.shape[1]
        kv_heads = k.shape[1] if k.shape[1] % layout.size == 0 else heads
        qh = _seq_to_heads(layout, q)
        kh = _seq_to_heads(layout, _expand_heads(k, kv_heads))
        vh = _seq_to_heads(layout, _expand_heads(v, kv_heads))
        out, lse = _block_forward(qh, kh, vh, order, order, scale, causal, window) or _empty_result(
            qh, vh
        )
        return _heads_to_seq(layout, out), _heads_to_seq(layout, lse)
    acc = None
    keys, values = k, v
    for step in range(layout.size):
        owner = (layout.rank - step) % layout.size
        acc = _merge(
            acc,
            _block_forward(
                q, keys, values, mine, layout.positions(owner, length), scale, causal, window
            ),
        )
        if step + 1 < layout.size:
            keys, values = _ring_shift(layout, [keys, values])
    return acc or _empty_result(q, v)


def _backward(dout, q, k, v, out, lse, scale, causal, window, layout: ContextLayout):
    dout = _wide(dout)
    length = q.shape[2] * layout.size
    mine = layout.positions(layout.rank, length)
    wide = _wide(q).dtype
    zeros = (torch.zeros_like(q, dtype=wide), torch.zeros_like(k, dtype=wide))

    def block(dout_, delta_, lse_, q_, k_, v_, pq, pk):
        return _block_backward(dout_, delta_, lse_, q_, k_, v_, pq, pk, scale, causal, window)

    delta = (dout * _wide(out)).sum(-1)
    if not layout.live:
        grads = block(dout, delta, lse, q, k, v, mine, mine)
        return grads if grads is not None else (zeros[0], zeros[1], torch.zeros_like(v, dtype=wide))
    if layout.mode == "allgather":
        order = layout.order(length)
        keys, values = _gather_sequence(layout, k), _gather_sequence(layout, v)
        grads = block(dout, delta, lse, q, keys, values, mine, order)
        if grads is None:
            grads = (
                zeros[0],
                torch.zeros_like(keys, dtype=wide),
                torch.zeros_like(values, dtype=wide),
            )
        dq, dkeys, dvalues = grads
        return dq, _scatter_sum_sequence(layout, dkeys), _scatter_sum_sequence(layout, dvalues)
    if layout.mode == "ulysses":
        order = layout.order(length)
        heads, kv_heads_in = q.shape[1], k.shape[1]
        kv_heads = kv_heads_in if kv_heads_in % layout.size == 0 else heads
        qh = _seq_to_heads(layout, q)
        kh = _seq_to_heads(layout, _expand_heads(k, kv_heads))
        vh = _seq_to_heads(layout, _expand_heads(v, kv_heads))
        grads = block(
            _seq_to_heads(layout, dout),
            _seq_to_heads(layout, delta),
            _seq_to_heads(layout, lse),
            qh,
            kh,
            vh,
            order,
            order,
        )
        if grads is None:
            grads = tuple(torch.zeros_like(t, dtype=wide) for t in (qh, kh, vh))
        dq, dk, dv = (_heads_to_seq(layout, g) for g in grads)
        return dq, _fold_heads(dk, kv_heads_in), _fold_heads(dv, kv_heads_in)
    dq = zeros[0]
    keys, values = k, v
    dkeys, dvalues = zeros[1], torch.zeros_like(v, dtype=wide)
    for step in range(layout.size):
        owner = (layout.rank - step) % layout.size
        grads = block(dout, delta, lse, q, keys, values, mine, layout.positions(owner, length))
        if grads is not None:
            dq = dq + grads[0]
            dkeys, dvalues = dkeys + grads[1], dvalues + grads[2]
        if step + 1 < layout.size:
            keys, values, dkeys, dvalues = _ring_shift(layout, [keys, values, dkeys, dvalues])
        else:
            dkeys, dvalues = _ring_shift(layout, [dkeys, dvalues])
    return dq, dkeys, dvalues


# --- the custom ops -------------------------------------------------------------------------------


@torch.library.custom_op("retarget::context_attention", mutates_args=())
def context_attention(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, window: int, layout: int
) -> tuple[Tensor, Tensor]:
    """Attention of this rank's queries over the whole sequence: (output, lse [B, H, L]; lse
    in float32, float64 for float64 inputs)."""
    out, lse = _forward(q, k, v, scale, causal, window, layout_of(layout))
    # Dense outputs, as the fake implementation promises (a compiled graph relies on strides).
    return out.to(q.dtype).contiguous(), lse.contiguous()


@context_attention.register_fake
def _(q, k, v, scale, causal, window, layout):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(
        q.shape[:-1], dtype=_wide(q).dtype
    )


@torch.library.custom_op("retarget::context_attention_backward", mutates_args=())
def context_attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    causal: bool,
    window: int,
    layout: int,
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = _backward(dout, q, k, v, out, lse, scale, causal, window, layout_of(layout))
    # In the layout of q, k and v (their strides), as the fake implementation promises.
    return tuple(torch.empty_like(x).copy_(g) for x, g in ((q, dq), (k, dk), (v, dv)))


@context_attention_backward.register_fake
def _(dout, q, k, v, out, lse, scale, causal, window, layout):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, scale, causal, window, layout = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.options = (scale, causal, window, layout)


def _grad(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.retarget.context_attention_backward(
        dout, q, k, v, out, lse, *ctx.options
    )
    return dq, dk, dv, None, None, None, None


context_attention.register_autograd(_grad, setup_context=_setup)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
