"""find_chains on small exported modules: which ops carry a split, and the breaks they name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from retarget.passes.shard.tp_chains import HandPlanConflict, find_chains


def _chains(module: nn.Module, *inputs, size: int = 2, forced=None, **kwargs):
    gm = torch.export.export(module, inputs, strict=False).module()
    return find_chains(gm, module, size, forced=forced, **kwargs)


class EagerAttention(nn.Module):
    """Attention written out: q @ k^T, softmax over keys, @ v, heads merged back."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (nn.Linear(16, width) for _ in range(3))
        self.o = nn.Linear(width, 16)

    def forward(self, x):
        b, s, _ = x.shape

        def heads(t):
            return t.view(b, s, self.heads, -1).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        probs = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1)
        return x + self.o((probs @ v).transpose(1, 2).reshape(b, s, -1))


def test_eager_attention_is_one_chain_closed_by_the_output_projection():
    analysis = _chains(EagerAttention(), torch.randn(2, 5, 16))
    (chain,) = analysis.chains
    assert chain.colwise == ["q", "k", "v"] and chain.rowwise == ["o"]
    assert chain.complete and 4 in chain.widths and 32 in chain.widths
    assert analysis.linears["o"].in_features == 32


def test_heads_that_do_not_divide_break_at_the_view():
    chains = _chains(EagerAttention(width=24, heads=3), torch.randn(2, 5, 16)).chains
    assert [c.colwise for c in chains] == [["q"], ["k"], ["v"], ["o"]]  # q, k, v never meet
    for chain in chains[:3]:
        assert "3 heads do not divide by 2" in chain.breaks[0] and "node view" in chain.breaks[0]
    # Replicated, they compute whole values: o starts a chain, which the residual sum breaks.
    assert chains[3].colwise == ["o"] and "node add: add.Tensor combines it with x" in str(
        chains[3].breaks
    )


class Sliced(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(self.up(x)[..., :16])


class Cumulative(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.down(torch.cumsum(self.up(x), dim=-1))


class Fused(nn.Module):
    """A q|k|v projection split into equal parts along its features."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 48), nn.Linear(16, 8)

    def forward(self, x):
        q, k, v = self.qkv(x).split(16, dim=-1)
        return self.out(q * k + v)


class GroupedHeads(nn.Module):
    """CodeGen's layout: the features are `groups` blocks of `heads_per_group` heads, viewed as
    [.., groups, width / groups], then [.., heads, head_dim]: the sharded groups dim merges with
    the outer part of the next one."""

    def __init__(self, groups: int = 4, heads_per_group: int = 2, head_dim: int = 8) -> None:
        super().__init__()
        self.groups, self.head_dim = groups, head_dim
        width = groups * heads_per_group * head_dim
        self.up, self.down = nn.Linear(16, width), nn.Linear(width, 16)

    def forward(self, x):
        b, s, _ = x.shape
        grouped = self.up(x).view(b, s, self.groups, -1)
        heads = grouped.reshape(b, s, -1, self.head_dim)
        return x + self.down(torch.relu(heads).reshape(b, s, -1))


class MixedView(nn.Module):
    """A view whose new dim is neither a multiple nor a divisor of the sharded one: 6 -> 4."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 12), nn.Linear(12, 8)

    def forward(self, x):
        mixed = self.up(x).view(x.shape[0], 6, 2).reshape(x.shape[0], 4, 3)
        return self.down(mixed.reshape(x.shape[0], 12))


def test_a_view_that_merges_the_sharded_dim_with_inner_sizes_keeps_the_chain():
    (chain,) = _chains(GroupedHeads(), torch.randn(2, 5, 16)).chains
    assert chain.complete and chain.colwise == ["up"] and chain.rowwise == ["down"]


def test_a_view_that_mixes_ranks_elements_breaks_the_chain():
    up = _chains(MixedView(), torch.randn(3, 8)).chains[0]
    assert up.members == ["up"] and "the view to [3, 4, 3] mixes the sharded dim" in up.breaks[0]


def test_a_slice_of_the_split_dim_that_is_no_part_breaks_the_chain():
    (chain,) = _chains(Sliced(), torch.randn(3, 8)).chains
    assert chain.members == ["up", "down"] and not chain.complete
    assert "cuts up's 32 output features into [(0, 16)], which are not parts" in chain.breaks[0]


class UnequalParts(nn.Module):
    """Phi3's attention under GQA: one projection sliced into q|k|v of 4, 2 and 2 heads, each
    viewed into heads; k and v repeated for the query heads of their group."""

    def __init__(self, spans=((0, 32), (32, 48), (48, 64)), head: int = 8) -> None:
        super().__init__()
        self.spans, self.head = spans, head
        self.qkv, self.o = nn.Linear(16, 64), nn.Linear(32, 16)

    def forward(self, x):
        b, s, _ = x.shape
        fused = self.qkv(x)
        q, k, v = (fused[..., a:z].view(b, s, -1, self.head).transpose(1, 2) for a, z in self.spans)
        groups = q.shape[1] // k.shape[1]

        def repeat(t):  # transformers' repeat_kv
            n, seq = t.shape[1], t.shape[2]
            return t[:, :, None].expand(b, n, groups, seq, self.head).reshape(b, -1, seq, self.head)

        k, v = repeat(k), repeat(v)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.o(out.transpose(1, 2).reshape(b, s, -1))


def test_slices_that_tile_the_output_are_fused_parts_of_unequal_widths():
    (chain,) = _chains(UnequalParts(), torch.randn(2, 5, 16)).chains
    assert chain.complete and chain.parts == {"qkv": (32, 16, 16)} and chain.fused == {}
    # Equal slices are the equal fused parts GPT-2's split makes.
    equal = UnequalParts(spans=((0, 16), (16, 32), (32, 48)))
    equal.qkv, equal.o = nn.Linear(16, 48), nn.Linear(16, 16)
    assert _chains(equal, torch.randn(2, 5, 16)).chains[0].fused == {"qkv": 3}


class MultiQuery(nn.Module):
    """Falcon's multi-query attention: one projection viewed as 4 query heads and one key and
    one value head, picked by index; k and v broadcast over the query heads."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(16, 48), nn.Linear(32, 16)

    def forward(self, x):
        b, s, _ = x.shape
        fused = self.qkv(x).view(b, s, 6, 8)
        q, k, v = fused[..., :-2, :], fused[..., [-2], :], fused[..., [-1], :]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k * 0.5, v)
        return x + self.o(out.transpose(1, 2).reshape(b, s, -1)), k


def test_one_head_parts_are_kept_whole_beside_the_split_query_heads():
    x = torch.randn(2, 5, 16)
    (chain,) = _chains(MultiQuery(), x, state_outputs=1).chains
    assert chain.complete and chain.parts == {"qkv": (32, 8, 8)}
    assert chain.whole_parts == {"qkv": (1, 2)}
    # Left out of the cache, the part kept whole would leave the region: the chain breaks.
    assert "a part kept whole leaves the region" in _chains(MultiQuery(), x).chains[0].breaks[0]
    # Under fsdp+tp no part is kept whole: the cut breaks the chain, saying why.
    chain = _chains(MultiQuery(), x, state_outputs=1, whole_parts=False).chains[0]
    assert "a part of 1 on the sharded dim, which does not divide by 2" in chain.breaks[0]


def test_slices_with_a_gap_or_a_part_that_does_not_divide_break_the_chain():
    gap = UnequalParts(spans=((0, 32), (32, 48), (40, 56)))
    gap.o = nn.Linear(32, 16)
    chain = _chains(gap, torch.randn(2, 5, 16)).chains[0]
    assert "not parts that cover them once each" in chain.breaks[0]
    chain = _chains(UnequalParts(), torch.randn(2, 5, 16), size=4).chains[0]
    assert not chain.complete  # k and v have 2 heads each: at 4 ranks the views break first
    assert "2 heads do not divide by 4" in chain.breaks[0]


def test_an_unknown_op_on_the_split_dim_breaks_the_chain_by_name():
    up, _ = _chains(Cumulative(), torch.randn(3, 8)).chains
    assert "node cumsum: call_function cumsum.default is not known to act per" in up.breaks[0]


def test_an_equal_split_of_the_features_is_a_fused_projection():
    (chain,) = _chains(Fused(), torch.randn(3, 8)).chains
    assert chain.complete and chain.fused == {"qkv": 3}
    qkv = _chains(Fused(), torch.randn(3, 8), size=32).chains[0]
    assert qkv.colwise == ["qkv"] and "3 fused parts has 16, not divisible" in qkv.breaks[0]


def test_forced_styles_refuse_what_the_graph_cannot_run():
    x = torch.randn(2, 5, 16)
    with pytest.raises(HandPlanConflict, match="makes o rowwise, but its input"):
        _chains(EagerAttention(), x, forced={"o": "rowwise"})
    with pytest.raises(HandPlanConflict, match=r"o \(replicate\) reads a value sharded on its"):
        _chains(EagerAttention(), x, forced={"q": "colwise", "k": "colwise", "v": "colwise"})
    forced = {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}
    (chain,) = _chains(EagerAttention(), x, forced=forced).chains
    assert chain.complete


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("precision", ["bf16", "bf16+ac"])
def test_a_graph_form_autocast_keeps_the_plan(name, precision):
    """insert_autocast runs before shard_tp and casts each weight (and input) in the graph; the
    chains look through those casts, so tp+bf16 splits what tp splits in float32 (before, every
    Linear of a bf16 graph was 'not computed as a Linear' and replicated)."""
    import transformers

    import retarget
    from retarget.models.hf_zoo import hf_model
    from retarget.passes.shard.tp_derive import derive_tp_plan

    entry = hf_model(name)
    plans = {}
    for target in ("single", precision):
        torch.manual_seed(0)
        model = getattr(transformers, entry.model_class)(entry.config()).train()
        program = retarget.compile_for(model, target, example_inputs=entry.inputs(2)).program
        plans[target] = {p: r.style for p, r in derive_tp_plan(program, 2).rules.items()}
    assert list(plans[precision].values()).count("colwise") >= 4
    assert plans[precision] == plans["single"]
