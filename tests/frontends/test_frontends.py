"""Frontends: each tracer alone, the order, the eager check, and attribute relinking."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from retarget.frontends import EAGER, capture_call, one_line
from retarget.frontends.binding import relink_attributes
from retarget.frontends.check import CaptureMismatch, check_against_eager, first_difference


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.3)

    def forward(self, x, mask=None):
        y = self.drop(self.bn(self.fc(x)))
        return y if mask is None else y * mask


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else -x


class SilentAutocast(nn.Module):
    """fx drops the `with torch.autocast` block without a word (docs/facts.md)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.fc(x)


@pytest.mark.parametrize("frontend", ["export", "fx", "dynamo"])
def test_each_frontend_captures_and_runs_against_the_live_module(frontend):
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(4, 6)
    result = capture_call(net, (x,), {}, frontends=(frontend,))
    assert result.frontend == frontend and result.failures == []
    graph = result.graph
    other = Net()  # same structure, other weights: the graph must read other's weights
    private = graph.private_attributes(other)
    torch.manual_seed(5)
    expected = other(x)
    torch.manual_seed(5)
    assert torch.equal(graph.run(other, (x,), {}, private), expected)


def test_order_and_reasons_when_nothing_captures():
    result = capture_call(Branchy(), (torch.randn(2, 6),), {})
    assert result.frontend == EAGER and result.graph is None
    assert [name for name, _ in result.failures] == ["export", "fx", "dynamo"]
    assert "data-dependent" in result.failures[0][1].lower()
    assert result.reason.startswith("export: ")


def test_a_graph_that_differs_from_eager_is_rejected():
    result = capture_call(SilentAutocast(), (torch.randn(2, 6),), {}, frontends=("fx",))
    assert result.frontend == EAGER
    assert "CaptureMismatch" in result.failures[0][1]


def test_check_restores_rng_and_buffers():
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(4, 6)
    graph = capture_call(net, (x,), {}, frontends=("export",)).graph
    stats = net.bn.running_mean.clone()
    rng = torch.random.get_rng_state()
    check_against_eager(net, graph, (x,), {})
    assert torch.equal(net.bn.running_mean, stats)
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_check_raises_on_mismatch():
    torch.manual_seed(0)
    a, b = Net(), Net()
    x = torch.randn(4, 6)
    graph = capture_call(a, (x,), {}, frontends=("export",)).graph
    graph.gm.graph.eliminate_dead_code()
    for node in graph.gm.graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default):
        node.args = (node.args[0], node.args[1])  # drop the bias
    graph.gm.recompile()
    with pytest.raises(CaptureMismatch, match="max abs difference"):
        check_against_eager(b, graph, (x,), {})


def test_relink_maps_dynamo_attributes_to_module_paths():
    net = Net()
    x = torch.randn(4, 6)
    gm, _ = torch._dynamo.export(net)(x)
    relink_attributes(gm, net)
    targets = {n.target for n in gm.graph.find_nodes(op="get_attr")}
    assert {"fc.weight", "fc.bias", "bn.weight", "bn.running_mean"} <= targets
    gm.graph.lint()


def test_first_difference_describes_structure_dtype_and_values():
    t = torch.ones(2)
    assert first_difference({"a": t}, {"a": t.clone()}) == ""
    assert "structure" in first_difference({"a": t}, {"b": t})
    assert "float64" in first_difference(t, t.double())
    assert "max abs difference 1" in first_difference(t, t + 1)
    nan = torch.tensor([float("nan")])
    assert first_difference(nan, nan.clone()) == ""


def test_one_line_keeps_the_first_line_and_the_type():
    err = RuntimeError("first line\nsecond line")
    assert one_line(err) == "RuntimeError: first line"
    assert one_line(ValueError("x" * 500)).endswith("...")


class _UserCheckpointedBlock(nn.Module):
    """A user's block that checkpoints part of itself (tracers inline the checkpoint)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(16, 64), nn.Linear(64, 16), nn.Dropout(0.1)

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(torch.relu(self.up(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def test_a_users_checkpoint_inside_a_block_keeps_its_memory_saving() -> None:
    import retarget

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[_UserCheckpointedBlock() for _ in range(3)], nn.Linear(16, 1))

    def saved_and_loss(model: nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
        count = [0]

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            count[0] += 1
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            torch.manual_seed(3)
            loss = model(x).sum()
        loss.backward()
        return count[0], loss

    x = torch.randn(4, 16)
    reference, compiled = build(), retarget.compile_for(build(), "single", example_inputs=(x,))
    (region,) = compiled.program.regions
    assert region.frontend == "export"
    assert all(graph.checkpointed for graph in region.graphs.values())
    (eager_saved, eager_loss), (graph_saved, graph_loss) = (
        saved_and_loss(reference, x),
        saved_and_loss(compiled, x),
    )
    assert graph_saved == eager_saved  # without the checkpoint the graph saves every activation
    assert torch.equal(eager_loss, graph_loss)
    for a, b in zip(reference.parameters(), compiled.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
