"""Accumulation windows and held gradients (runtime/step.py), in one process.

The same mechanics on 2 gloo ranks (DDP, FSDP, clipping) are in test_runtime.py, in the launch
that also runs the issue's training loop.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import retarget
from retarget.runtime.step import HeldGradients, window_for
from tests import zoo
from tests.conftest import to_device
from tests.sharded_training import max_difference

STEPS = 2  # micro-steps per window


def test_windows_end_at_n_or_at_the_end_of_data():
    done, seen = 0, []
    for i in range(1, 8):
        window = window_for(3, done, end_of_data=i == 7)
        seen.append((window.index, window.sync, window.rescale))
        done = 0 if window.sync else window.index
    assert seen == [
        (1, False, 1.0),
        (2, False, 1.0),
        (3, True, 1.0),
        (1, False, 1.0),
        (2, False, 1.0),
        (3, True, 1.0),
        (1, True, 3.0),  # a last window of 1 micro-step: its gradients are scaled by 3 / 1
    ]
    with pytest.raises(ValueError, match="steps must be at least 1"):
        window_for(0, 0, False)


def test_held_gradients_hide_from_the_optimizer_and_come_back():
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), 2.0)
    held = HeldGradients()
    held.hold([param])
    assert param.grad is None and len(held) == 1
    torch.optim.SGD([param], lr=1.0).step()  # no gradient: no change
    assert torch.equal(param, torch.ones(3))
    held.restore()
    assert torch.equal(param.grad, torch.full((3,), 2.0)) and len(held) == 0


def _windows(ids: torch.Tensor, batch: int, steps: int) -> list[torch.Tensor]:
    """The concatenated micro-batches of each window, as one process sees them."""
    micro = list(ids.split(batch))
    return [torch.cat(micro[i : i + steps]) for i in range(0, len(micro), steps)]


def test_one_process_plain_adamw_every_micro_step_equals_one_step_per_window(device):
    ids = torch.randint(0, zoo.VOCAB, (10, zoo.SEQ), generator=torch.Generator().manual_seed(1))
    model = retarget.compile_for(
        to_device(zoo.tiny_llama(), device),
        "single",
        example_inputs=to_device(zoo.lm_inputs(2), device),
    )
    run = model.runtime
    run.gradient_accumulation_steps = STEPS
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    syncs = []
    for (batch,) in run.shard(DataLoader(TensorDataset(ids), batch_size=2)):
        with run.accumulate():
            batch = batch.to(device)
            run.backward(model(input_ids=batch, labels=batch).loss)
            syncs.append(run.sync_gradients)
            optimizer.step()
            optimizer.zero_grad()
    reference = to_device(zoo.tiny_llama(), device)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for window in _windows(ids, 2, STEPS):  # 5 batches: windows of 2, 2 and 1
        window = window.to(device)
        reference(input_ids=window, labels=window).loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    assert syncs == [False, True, False, True, True]
    steps = {int(s["step"]) for s in optimizer.state.values()}
    assert steps == {3}  # Adam stepped once per window, never on a held micro-step
    assert max_difference(model, reference) < 1e-6  # measured 1.5e-8
