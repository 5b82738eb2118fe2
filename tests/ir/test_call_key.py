"""The call-signature cache (`ir/call_key.py`): a repeat's walk and last call, and what makes them
stale. Each test warms the cache with repeated calls first, then changes one thing: a stale cache
would hand back the previous graph (or miss a module), and the test's assertion would fail."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import retarget
from retarget.core.errors import EagerRegionWarning
from retarget.core.modules import structural_copy
from retarget.ir.call_key import block_walk, call_key, quick_signature
from tests.ir.test_hooks import count_region_runs
from tests.ir.test_region import Stack


class DropBlock(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, scale=1.0):
        return self.drop(torch.relu(self.fc(x))) * scale + x


def _compiled():
    torch.manual_seed(0)
    model = Stack(depth=3, block=DropBlock)
    x = torch.randn(2, 8)
    compiled = retarget.compile_for(model, example_inputs=x)
    (region,) = compiled.program.regions
    return model, compiled, region, x


def _seeded(model, x):
    torch.manual_seed(7)
    return model(x)


def test_a_submodules_train_flag_switched_after_warm_calls_takes_its_own_graph():
    model, compiled, region, x = _compiled()
    model.eval(), compiled.eval()
    for _ in range(3):
        assert torch.equal(compiled(x), model(x))
    graphs = len(region.graphs)
    for block, original in zip(compiled.blocks, model.blocks, strict=True):
        block.drop.train()  # the region module itself stays in eval
        original.drop.train()
    got, want = _seeded(compiled, x), _seeded(model, x)
    assert len(region.graphs) == graphs + 1
    assert torch.equal(got, want)
    assert not torch.equal(got, compiled.eval()(x))  # dropout ran: not the eval graph's output


@pytest.mark.parametrize("how", ["setattr", "modules dict", "deleted and re-added"])
def test_a_submodule_swapped_after_warm_calls_is_walked(how):
    model, compiled, region, x = _compiled()
    compiled.eval()
    for _ in range(3):
        compiled(x)
    block = compiled.blocks[1]
    new = nn.Dropout(0.5)  # a new module object: only a fresh walk sees its hook
    if how == "setattr":
        block.drop = new
    elif how == "modules dict":
        block._modules["drop"] = new
    else:
        del block.drop
        block.add_module("drop", new)
    new.eval()
    seen = []
    new.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    runs = count_region_runs(region)
    with pytest.warns(EagerRegionWarning, match="forward hook on drop"):
        compiled(x)
    assert seen == [torch.Size([2, 8])]
    assert runs[0] == 2  # blocks 0 and 2 ran the graph; block 1, hooked, its eager form
    new.train()  # the swapped-in module's own flag is part of the signature too
    assert block_walk(block).training() == (False, False, True)


def test_a_plain_argument_or_shape_that_changes_between_calls_is_not_served_the_last_graph():
    model, compiled, region, x = _compiled()
    compiled.eval(), model.eval()
    block, original = compiled.blocks[0], model.blocks[0]
    for _ in range(3):
        assert torch.equal(block(x, scale=2.0), original(x, scale=2.0))
    assert torch.equal(block(x, scale=3.0), original(x, scale=3.0))
    assert torch.equal(block(x, 3.0), original(x, 3.0))
    y = torch.randn(5, 8)
    assert torch.equal(block(y), original(y))
    assert torch.equal(block(x.double().float()), original(x))
    z = torch.randn(8, 2).t()  # same shape, not contiguous
    assert torch.equal(block(z), original(z))


def test_a_graph_table_emptied_after_warm_calls_is_not_read_through_the_cache():
    model, compiled, region, x = _compiled()
    compiled.eval(), model.eval()
    for _ in range(3):
        compiled(x)
    runs = count_region_runs(region)
    region.graphs.clear()  # what a pass making the region eager-only does (tp's split blocks)
    region.eager_only = True
    assert torch.equal(compiled(x), model(x))
    assert runs[0] == 0


def test_quick_signature_tells_apart_what_call_key_does():
    x = torch.randn(2, 8)
    base = quick_signature((x,), {"scale": 2.0})
    assert quick_signature((torch.randn(2, 8),), {"scale": 2.0}) == base
    different = [
        ((torch.randn(3, 8),), {"scale": 2.0}),
        ((x.double(),), {"scale": 2.0}),
        ((torch.randn(8, 2).t(),), {"scale": 2.0}),
        ((x,), {"scale": 3.0}),
        ((x,), {"scale": 2}),
        ((x,), {}),
        ((x, 2.0), {}),
        (((x,),), {"scale": 2.0}),
        (([x],), {"scale": 2.0}),
        ((x,), {"scale": None}),
    ]
    for args, kwargs in different:
        assert quick_signature(args, kwargs) != base, (args, kwargs)
    kw = {"a": x, "b": None}
    assert quick_signature((), kw) != quick_signature((), dict(reversed(kw.items())))
    # What it does not describe exactly takes the full key.
    assert quick_signature(({"k": x},), {}) is None
    assert quick_signature(((x, (x,)),), {}) is None


def test_a_structural_copy_does_not_read_the_originals_walk():
    block = DropBlock()
    before = call_key(block, (torch.randn(2, 8),), {})
    copy = structural_copy(block)
    copy.drop.eval()
    assert block_walk(copy).modules[0] is copy
    assert call_key(copy, (torch.randn(2, 8),), {})[2] == (True, True, False)
    assert call_key(block, (torch.randn(2, 8),), {}) == before
