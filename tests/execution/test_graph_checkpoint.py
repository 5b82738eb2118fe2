"""graph_checkpoint: the lighter checkpoint of a selective repeat's scoped graph. Which calls take
it, that it keeps what torch's checkpoint keeps with the same gradients bit for bit, and what it
refuses (a saved parameter modified in place, a second backward)."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import retarget
from retarget.execution import checkpoint, graph_checkpoint
from retarget.execution.graph_checkpoint import draws_random
from retarget.models import TinyConfig, synthetic_batch, tiny_lm
from retarget.passes.memory.measure import measure_training_step
from tests.conftest import assert_same_step
from tests.zoo import ZOO

SHAPE = dict(hidden=32, heads=2, layers=4, max_seq=256, vocab_size=64)


def _tiny_lm(**extra):
    torch.manual_seed(0)
    return tiny_lm(**SHAPE, **extra)


def _batch():
    return synthetic_batch(TinyConfig(**SHAPE), 2, 256, generator=torch.Generator().manual_seed(0))


def _count_calls(monkeypatch) -> list:
    calls = []
    real = checkpoint.graph_checkpoint

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "graph_checkpoint", counting)
    return calls


def test_selective_takes_it_with_gradients_bitwise_and_the_same_bytes_as_torch(monkeypatch):
    batch = _batch()
    plain = retarget.compile_for(_tiny_lm(), "single", example_inputs=batch)
    compiled = retarget.compile_for(_tiny_lm(), "ac[policy=selective]", example_inputs=batch)
    calls = _count_calls(monkeypatch)
    assert_same_step(plain, compiled, batch)
    assert len(calls) == SHAPE["layers"]
    light = measure_training_step(lambda: compiled(**batch)["loss"])
    compiled.zero_grad(set_to_none=True)
    monkeypatch.setattr(checkpoint, "applies", lambda *args: False)  # torch's checkpoint
    calls.clear()
    torchs = measure_training_step(lambda: compiled(**batch)["loss"])
    assert not calls
    assert light.activations == torchs.activations
    assert light.activations < measure_training_step(lambda: plain(**batch)["loss"]).activations


def test_a_model_with_dropout_keeps_torchs_checkpoint_and_its_rng(monkeypatch, fresh_rng):
    """Dropout draws random numbers: the recompute must replay forward's RNG, which torch's
    checkpoint does; the gradients stay those of the model without checkpointing."""
    batch = _batch()
    plain = retarget.compile_for(_tiny_lm(dropout=0.1), "single", example_inputs=batch)
    compiled = retarget.compile_for(
        _tiny_lm(dropout=0.1), "ac[policy=selective]", example_inputs=batch
    )
    calls = _count_calls(monkeypatch)
    torch.manual_seed(3)
    loss_a = plain(**batch)["loss"]
    loss_a.backward()
    torch.manual_seed(3)
    loss_b = compiled(**batch)["loss"]
    loss_b.backward()
    assert not calls
    assert torch.equal(loss_a, loss_b)
    for (name, a), b in zip(plain.named_parameters(), compiled.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


class _Drop(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x):
        return torch.nn.functional.dropout(x * 2, self.p, training=True)


@pytest.mark.parametrize(("p", "random"), [(0.0, False), (0.25, True)])
def test_draws_random_reads_the_dropout_probability(p, random):
    x = torch.randn(3, 4)
    gm = torch.export.export(_Drop(p), (x,)).module()
    assert isinstance(gm, fx.GraphModule)
    assert draws_random(gm) is random


def test_a_parameter_modified_in_place_after_forward_is_refused():
    """Without checkpointing autograd refuses it; a parameter saved as itself must be too."""
    batch = _batch()
    compiled = retarget.compile_for(_tiny_lm(), "ac[policy=selective]", example_inputs=batch)
    loss = compiled(**batch)["loss"]
    with torch.no_grad():
        compiled.layers[0].mlp.down_proj.weight.add_(1)
    with pytest.raises(RuntimeError, match="modified in place"):
        loss.backward()


def test_a_second_backward_through_a_block_is_refused():
    batch = _batch()
    compiled = retarget.compile_for(_tiny_lm(), "ac[policy=selective]", example_inputs=batch)
    loss = compiled(**batch)["loss"]
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="more often than forward|recompute"):
        loss.backward()


def test_the_recompute_must_save_what_forward_saved():
    """A forward that saves a different number of tensors the second time is an error."""
    runs = []

    def forward(x):
        runs.append(1)
        y = x.sin()
        return y.cos() if len(runs) == 1 else y

    def contexts():
        from retarget.execution.kept_calls import scoped_contexts

        return scoped_contexts()

    x = torch.randn(4, requires_grad=True)
    out = graph_checkpoint.graph_checkpoint(nn.Module(), forward, (x,), {}, contexts)
    with pytest.raises(RuntimeError, match="fewer tensors than forward"):
        out.sum().backward()


def test_a_zoo_llama_takes_it_and_equals_no_ac(monkeypatch):
    """A Hugging Face Llama's layers get (cos, sin) as a tuple: its leaves are plain tensors. (With
    its KV cache among a layer's arguments, torch's checkpoint runs: the cache is stateful.)"""
    entry = ZOO["tiny_llama"]
    inputs = {**entry.inputs(2), "use_cache": False}
    plain = retarget.compile_for(entry.factory(), "single", example_inputs=inputs)
    compiled = retarget.compile_for(entry.factory(), "ac[policy=selective]", example_inputs=inputs)
    calls = _count_calls(monkeypatch)
    assert_same_step(plain, compiled, inputs)
    assert calls


def _fsdp_selective_rank(rank: int, world: int) -> dict[str, object]:
    """Three SGD steps of fsdp and of fsdp+ac[policy=selective] on the same data; whether the
    light checkpoint ran. FSDP2 frees and re-gathers the parameters the checkpoint saves as
    themselves between forward and backward."""
    from retarget.execution import graph_checkpoint as module
    from retarget.execution.process import ProcessState

    ProcessState.current()

    calls = []
    real = module.graph_checkpoint

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    checkpoint.graph_checkpoint = counted
    batch = _batch()
    rows = {k: v[rank::world] for k, v in batch.items()}
    losses = {}
    for target in ("fsdp", "fsdp+ac[policy=selective]"):
        compiled = retarget.compile_for(_tiny_lm(), target, example_inputs=batch)
        optimizer = compiled.runtime.prepare(torch.optim.SGD(compiled.parameters(), lr=0.1))
        losses[target] = []
        for _ in range(3):
            loss = compiled(**rows)["loss"]
            compiled.runtime.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses[target].append(loss.item())
    return {"losses": losses, "light calls": len(calls)}


@pytest.mark.distributed
def test_under_fsdp_it_trains_bitwise_as_no_ac():
    from tests.distributed import run_ranks

    for out in run_ranks(_fsdp_selective_rank, 2, timeout=300):
        assert out["light calls"] > 0, out
        assert out["losses"]["fsdp"] == out["losses"]["fsdp+ac[policy=selective]"], out
