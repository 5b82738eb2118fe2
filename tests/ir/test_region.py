"""Regions: one graph per call signature, shared by repeats, rewrites replayed on re-capture."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import retarget
from retarget.core.errors import EagerRegionWarning
from retarget.ir.region import call_key


class Block(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x, scale=1.0):
        return torch.relu(self.fc(x)) * scale + x


class Stack(nn.Module):
    def __init__(self, depth=4, block=Block):
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_one_graph_serves_every_repeat_and_new_shapes_capture_once_more():
    torch.manual_seed(0)
    model = Stack()
    compiled = retarget.compile_for(model, example_inputs=torch.randn(2, 8))
    (region,) = compiled.program.regions
    assert region.shared and len(region.graphs) == 1 and region.captures == 1
    for batch in (2, 5, 5, 2):
        x = torch.randn(batch, 8)
        assert torch.equal(compiled(x), model(x))
    assert len(region.graphs) == 2 and region.captures == 2
    compiled.eval()
    compiled(torch.randn(2, 8))
    assert len(region.graphs) == 3  # eval mode is a signature of its own


def test_call_key_distinguishes_what_a_graph_is_specialised_to():
    block = Block()
    x = torch.randn(2, 8)
    base = call_key(block, (x,), {})
    assert call_key(block, (torch.randn(2, 8),), {}) == base
    assert call_key(block, (torch.randn(3, 8),), {}) != base
    assert call_key(block, (x.double(),), {}) != base
    assert call_key(block, (x.t().contiguous().t(),), {}) != base
    assert call_key(block, (x,), {"scale": 2.0}) != base
    assert call_key(block, (x,), {"scale": 2.0}) != call_key(block, (x,), {"scale": 3.0})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert call_key(block, (x,), {}) != base
    block.eval()
    assert call_key(block, (x,), {}) != base


def test_rewrites_are_replayed_on_graphs_captured_later():
    torch.manual_seed(0)
    model = Stack(depth=2)
    compiled = retarget.compile_for(model, example_inputs=torch.randn(2, 8))
    (region,) = compiled.program.regions

    def double_output(gm):
        output = next(iter(gm.graph.find_nodes(op="output")))
        values = output.args[0]
        with gm.graph.inserting_before(output):
            doubled = gm.graph.call_function(torch.mul, (values[0], 2.0))
        output.args = ((doubled, *values[1:]),)

    assert region.add_transform("double", double_output) == 1
    x = torch.randn(3, 8)  # a new signature: captured now, then rewritten
    expected = x
    for block in model.blocks:
        expected = block(expected) * 2.0
    assert torch.equal(compiled(x), expected)
    assert len(region.graphs) == 2
    assert all("torch.mul" in g.gm.code for g in region.graphs.values())


class IndexedBlock(Block):
    """Computes differently per position: the shared graph must not be reused blindly."""

    count = 0

    def __init__(self):
        super().__init__()
        IndexedBlock.count += 1
        self.layer_idx = IndexedBlock.count  # left out of the fingerprint on purpose

    def forward(self, x):
        return super().forward(x) * self.layer_idx


def test_repeats_that_compute_differently_get_a_graph_each():
    torch.manual_seed(0)
    model = Stack(depth=3, block=IndexedBlock)
    compiled = retarget.compile_for(model, example_inputs=torch.randn(2, 8))
    (region,) = compiled.program.regions
    assert region.repeats == 3 and not region.shared
    assert "repeats compute differently" in region.reason
    x = torch.randn(2, 8)
    assert torch.equal(compiled(x), model(x))
    assert len(region.graphs) == 3


class Moody(nn.Module):
    """Capturable for a tensor `scale`, not for a Python bool that changes the code path."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, tricky=False):
        y = self.fc(x)
        if tricky and float(y.sum()) > 0:
            return y * 2
        return y


class MoodyStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Moody() for _ in range(2))

    def forward(self, x, tricky=False):
        for block in self.blocks:
            x = block(x, tricky=tricky)
        return x


def test_a_signature_that_cannot_be_captured_runs_eager_and_others_keep_their_graph():
    torch.manual_seed(0)
    model = MoodyStack()
    x = torch.randn(2, 4)
    compiled = retarget.compile_for(model, example_inputs=(x,))
    (region,) = compiled.program.regions
    assert region.frontend == "export"
    assert torch.equal(compiled(x, tricky=True), model(x, tricky=True))
    assert len(region.eager_keys) == 1 and not region.eager_only
    assert torch.equal(compiled(x), model(x))
    assert len(region.graphs) == 1


def test_forward_hooks_on_region_modules_still_fire():
    torch.manual_seed(0)
    model = Stack(depth=2)
    seen = []
    model.blocks[1].register_forward_hook(lambda m, a, out: seen.append(out.shape))
    compiled = retarget.compile_for(model, example_inputs=torch.randn(2, 8))
    seen.clear()
    compiled(torch.randn(2, 8))
    assert seen == [torch.Size([2, 8])]


def test_eager_forms_wrap_calls_that_run_without_a_graph():
    torch.manual_seed(0)
    model = MoodyStack()
    x = torch.randn(2, 4)
    compiled = retarget.compile_for(model, example_inputs=(x,))
    (region,) = compiled.program.regions
    calls = []

    def tag(forward):
        def wrapped(*args, **kwargs):
            calls.append("eager")
            return forward(*args, **kwargs)

        return wrapped

    region.add_transform("tag", lambda gm: None, eager_form=tag)
    compiled(x)
    assert calls == []  # graph calls are rewritten by the graph transform, not the eager form
    compiled(x, tricky=True)
    assert calls == ["eager", "eager"]


def _failing_rewrite(gm):
    """A graph rewrite that does not hold at run time (as a precision rewrite meeting a value it
    cannot represent would): the graph raises where the eager forward runs."""
    output = next(iter(gm.graph.find_nodes(op="output")))
    values = output.args[0]
    with gm.graph.inserting_before(output):
        checked = gm.graph.call_function(_refuse_at_run_time, (values[0],))
    output.args = ((checked, *values[1:]),)


def _refuse_at_run_time(x):
    raise RuntimeError("value cannot be converted to type c10::BFloat16 without overflow")


def test_a_graph_failing_at_run_time_runs_the_eager_form_warned_once_and_reported():
    torch.manual_seed(0)
    model = Stack(depth=2)
    x = torch.randn(2, 8)
    compiled = retarget.compile_for(model, example_inputs=x)
    (region,) = compiled.program.regions
    calls = []

    def tag(forward):
        def wrapped(*args, **kwargs):
            calls.append("eager form")
            return forward(*args, **kwargs)

        return wrapped

    region.add_transform("overflowing", _failing_rewrite, eager_form=tag)
    with pytest.warns(EagerRegionWarning) as caught:
        out = compiled(x)
    assert torch.equal(out, model(x))
    assert len(calls) == 2  # each repeat ran the rewrite's module-level form instead
    (warning,) = [w for w in caught if "failed at run time" in str(w.message)]
    assert "RuntimeError: value cannot be converted" in str(warning.message)
    assert "after the rewrites of overflowing" in str(warning.message)
    assert "with the same rewrites in their module-level form" in str(warning.message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the signature now runs eagerly without retrying
        assert torch.equal(compiled(x), model(x))
    assert len(calls) == 4
    (reported,) = compiled.report.to_dict()["regions"][0]["eager_signatures"]
    assert reported.startswith("its graph failed at run time (RuntimeError")
    assert "1 call signature(s) eager" in str(compiled.report)


def test_a_rewrite_without_module_level_form_says_it_is_not_applied_there():
    torch.manual_seed(0)
    model = Stack(depth=2)
    compiled = retarget.compile_for(model, example_inputs=torch.randn(2, 8))
    (region,) = compiled.program.regions
    region.add_transform("overflowing", _failing_rewrite)
    with pytest.warns(EagerRegionWarning, match="without the rewrites of overflowing, which have"):
        compiled(torch.randn(2, 8))


class ExplodingBlock(Block):
    explode = False

    def forward(self, x, scale=1.0):
        if self.explode:  # not in the graph: the trace saw False
            raise ValueError("the model's own error")
        return super().forward(x, scale)


def test_when_the_eager_forward_fails_too_its_error_is_raised():
    torch.manual_seed(0)
    compiled = retarget.compile_for(
        Stack(depth=2, block=ExplodingBlock), example_inputs=torch.randn(2, 8)
    )
    (region,) = compiled.program.regions
    region.add_transform("overflowing", _failing_rewrite)
    ExplodingBlock.explode = True
    try:
        with pytest.raises(ValueError, match="the model's own error"):
            compiled(torch.randn(2, 8))
    finally:
        ExplodingBlock.explode = False
    assert region.failed_graphs == {}  # the graph was not blamed
