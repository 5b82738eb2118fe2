"""selective_scope: the keeping modes entered only at kept calls of a captured graph. Which calls
are scoped, what the modes keep and hand back, their refusals, and that a scoped block keeps
what torch's whole-block form keeps while crossing into Python for far fewer ops."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn
from torch.utils._python_dispatch import TorchDispatchMode

import retarget
from retarget.execution import checkpoint, kept_calls, recompute_rules
from retarget.execution.kept_calls import is_scoped, run_kept, scoped_contexts
from retarget.models import TinyConfig, synthetic_batch, tiny_lm
from retarget.passes.memory.measure import measure_training_step
from retarget.passes.memory.selective_scope import scope_kept_calls
from tests.conftest import assert_same_step
from tests.zoo import ZOO

aten = torch.ops.aten
SHAPE = dict(hidden=32, heads=2, layers=4, max_seq=256, vocab_size=64)


def _tiny_lm():
    torch.manual_seed(0)
    return tiny_lm(**SHAPE)


def _batch():
    return synthetic_batch(TinyConfig(**SHAPE), 2, 256, generator=torch.Generator().manual_seed(0))


def _block_graph(compiled) -> fx.GraphModule:
    return compiled.program.region_of("layers.0").representative().gm


def test_an_exported_block_is_scoped_at_its_linears_and_attention():
    compiled = retarget.compile_for(_tiny_lm(), "ac[policy=selective]", example_inputs=_batch())
    gm = _block_graph(compiled)
    assert is_scoped(gm)
    kept = [n.args[0] for n in gm.graph.nodes if n.target is run_kept]
    # q, k, v projections, attention, o projection; gate, up, down projections.
    linear, attention = aten.linear.default, aten.scaled_dot_product_attention.default
    assert kept == [linear] * 3 + [attention] + [linear] * 4


def test_a_graph_calling_modules_is_left_whole():
    """fx graphs call modules, which may hide a matmul: such a graph runs whole under the modes."""
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    before = gm.code
    scope_kept_calls(gm)
    assert not is_scoped(gm) and gm.code == before


def test_a_block_not_checkpointed_runs_its_scoped_graph_plainly():
    """ac[every=2] under selective: repeats share the scoped graph; unchecked ones are exact."""
    batch = _batch()
    eager = _tiny_lm()
    compiled = retarget.compile_for(
        _tiny_lm(), "ac[policy=selective,every=2]", example_inputs=batch
    )
    assert is_scoped(_block_graph(compiled))
    eager(**batch)["loss"].backward()
    compiled(**batch)["loss"].backward()
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


def test_replay_hands_back_what_forward_kept_without_computing():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    forward, recompute = scoped_contexts()
    with forward:
        kept = run_kept(aten.mm.default, a, b)
    with recompute:
        replayed = run_kept(aten.mm.default, torch.zeros_like(a), b)  # would be zeros if run
    assert torch.equal(replayed, kept) and replayed.abs().sum() > 0
    with recompute, pytest.raises(RuntimeError, match="more often than forward"):
        run_kept(aten.mm.default, a, b)


def test_a_kept_output_modified_in_place_is_refused():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    forward, recompute = scoped_contexts()
    with forward:
        kept = run_kept(aten.mm.default, a, b)
    kept.add_(1)
    with recompute, pytest.raises(RuntimeError, match="modified in place"):
        run_kept(aten.mm.default, a, b)


def test_without_a_selective_checkpoint_a_kept_call_is_the_plain_call():
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    assert torch.equal(run_kept(aten.mm.default, a, b), a @ b)


class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("shape", "bias", "transposed"),
    [
        ((2, 5, 6), False, False),
        ((2, 5, 6), True, False),
        ((2, 5, 6), False, True),
        ((5, 6), False, False),
    ],
)
def test_a_kept_linear_runs_the_ops_of_aten_linear(shape, bias, transposed):
    """Kept with only its mm under the mode (3-d contiguous, no bias) or whole: either way the
    same ops in the same order and the same values as aten.linear, and replay hands back."""
    x = torch.randn(*shape, requires_grad=True)
    x = x.transpose(0, 1) if transposed else x
    weight = torch.randn(7, 6, requires_grad=True)
    args = (x, weight, torch.randn(7)) if bias else (x, weight)
    with _OpLog() as log:
        expected = aten.linear.default(*args)
    forward, recompute = scoped_contexts()
    with _OpLog() as kept_log, forward:
        kept = run_kept(aten.linear.default, *args)
    computed = [op for op in kept_log.ops if op is not aten.detach.default]  # the keeping's own
    assert computed == log.ops and torch.equal(kept, expected)
    with recompute:
        replayed = run_kept(aten.linear.default, *args)
    assert torch.equal(replayed, expected)


def _count_ops_classified(monkeypatch, module) -> list:
    """Record every op `module`'s modes ask is_saved about (the real is_saved answers)."""
    seen = []
    real = module.is_saved

    def counting(func):
        seen.append(func)
        return real(func)

    monkeypatch.setattr(module, "is_saved", counting)
    return seen


def test_scoped_keeps_what_the_whole_block_form_keeps_with_fewer_ops_in_python(monkeypatch):
    """Same activations (bytes alive after forward) and gradients as torch's whole-block form,
    with the modes seeing at most half of the ops of a forward."""
    batch = _batch()
    compiled = retarget.compile_for(_tiny_lm(), "ac[policy=selective]", example_inputs=batch)
    scoped = measure_training_step(lambda: compiled(**batch)["loss"])
    grads = {n: p.grad.clone() for n, p in compiled.named_parameters()}
    compiled.zero_grad(set_to_none=True)
    scoped_ops = _count_ops_classified(monkeypatch, kept_calls)
    compiled(**batch)
    monkeypatch.setattr(checkpoint, "is_scoped", lambda gm: False)  # torch's form
    whole_ops = _count_ops_classified(monkeypatch, recompute_rules)
    compiled(**batch)
    whole = measure_training_step(lambda: compiled(**batch)["loss"])
    assert scoped.activations == whole.activations
    for name, p in compiled.named_parameters():
        assert torch.equal(p.grad, grads[name]), name
    # Forward only: a linear reaches the modes as its mm, attention as its kernel; the
    # whole-block form classifies every op (norms, rotary, residuals, views, ...).
    assert 0 < 5 * len(scoped_ops) <= len(whole_ops), (len(scoped_ops), len(whole_ops))


def test_a_kept_linear_under_autocast_runs_as_aten_linear():
    """Autocast casts linear's inputs before its view; the mm-only path would cast after it."""
    x, weight = torch.randn(2, 5, 6, requires_grad=True), torch.randn(7, 6, requires_grad=True)
    # One autocast context each: autocast caches its cast of a weight until the context exits.
    with torch.autocast("cpu", dtype=torch.bfloat16), _OpLog() as log:
        expected = aten.linear.default(x, weight)
    forward, _ = scoped_contexts()
    with torch.autocast("cpu", dtype=torch.bfloat16), _OpLog() as kept_log, forward:
        kept = run_kept(aten.linear.default, x, weight)
    computed = [op for op in kept_log.ops if op is not aten.detach.default]
    assert computed == log.ops and torch.equal(kept, expected)


def test_bf16_plus_selective_equals_bf16():
    entry = ZOO["tiny_llama"]
    inputs = entry.inputs(2)
    bf16 = retarget.compile_for(entry.factory(), "bf16", example_inputs=inputs)
    both = retarget.compile_for(entry.factory(), "bf16+ac[policy=selective]", example_inputs=inputs)
    assert is_scoped(both.program.region_of("model.layers.0").representative().gm)
    assert_same_step(bf16, both, inputs)
