"""LossScaler: skips a step on inf/nan gradients, backs off and grows the scale as configured."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import retarget
from retarget.core.plans import LossScalerPlan, Plan
from retarget.runtime.scaler import INF_OR_NAN, LossScaler, make_loss_scaler


def setup(**options):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optimizer, LossScaler("cpu", **options)


def backward(model: nn.Module, scaler: LossScaler, *, inject_inf: bool = False) -> None:
    loss = model(torch.ones(3, 4)).pow(2).mean()
    scaler.scale(loss).backward()
    if inject_inf:
        model.weight.grad[0, 0] = float("inf")


def test_an_inf_gradient_skips_the_step_and_backs_off_the_scale():
    model, optimizer, scaler = setup(init_scale=1024.0, backoff_factor=0.25)
    before = [p.detach().clone() for p in model.parameters()]
    backward(model, scaler, inject_inf=True)
    assert scaler.step(optimizer) is False
    scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scaler.scale_value == 256.0
    assert (scaler.skipped_steps, scaler.last_step_skipped) == (1, True)
    assert scaler.last_skip_reason == INF_OR_NAN


def test_a_normal_step_applies_the_unscaled_gradients():
    model, optimizer, scaler = setup(init_scale=1024.0)
    twin, twin_optimizer, _ = setup()
    backward(model, scaler)
    twin(torch.ones(3, 4)).pow(2).mean().backward()
    assert scaler.step(optimizer) is True
    twin_optimizer.step()
    scaler.update()
    # A power-of-two scale divides out exactly: the same update as without scaling.
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
    assert (scaler.skipped_steps, scaler.last_step_skipped, scaler.last_skip_reason) == (
        0,
        False,
        None,
    )
    assert scaler.scale_value == 1024.0


def test_the_scale_grows_after_growth_interval_good_steps():
    model, optimizer, scaler = setup(init_scale=8.0, growth_factor=4.0, growth_interval=2)
    scales = []
    for _ in range(4):
        backward(model, scaler)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        scales.append(scaler.scale_value)
    assert scales == [8.0, 32.0, 32.0, 128.0]
    assert scaler.steps == 4 and scaler.skipped_steps == 0


def test_state_dict_round_trips_scale_and_counters():
    model, optimizer, scaler = setup(init_scale=64.0)
    backward(model, scaler, inject_inf=True)
    scaler.step(optimizer)
    scaler.update()
    restored = LossScaler("cpu")
    restored.load_state_dict(scaler.state_dict())
    assert restored.scale_value == 32.0
    assert (restored.steps, restored.skipped_steps) == (1, 1)


def test_the_target_options_reach_the_scaler_through_the_plan():
    target = "fp16[init_scale=256,growth_factor=3,backoff_factor=0.125,growth_interval=1]"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    compiled = retarget.compile_for(model, target, example_inputs=torch.ones(3, 4))
    scaler = make_loss_scaler(compiled.program.plan, "cpu")
    optimizer = torch.optim.SGD(compiled.parameters(), lr=0.1)
    assert scaler.scale_value == 256.0
    for inject_inf, expected in ((False, 768.0), (True, 96.0)):
        loss = compiled(torch.ones(3, 4)).pow(2).mean()
        scaler.scale(loss).backward()
        if inject_inf:
            compiled[0].weight.grad.fill_(float("nan"))
        assert scaler.step(optimizer) is not inject_inf
        scaler.update()
        optimizer.zero_grad()
        assert scaler.scale_value == expected


def test_no_scaler_without_fp16():
    assert make_loss_scaler(Plan(), "cpu") is None
    with pytest.raises(TypeError):  # the plan record refuses an option GradScaler lacks
        LossScalerPlan(init_scale=1.0, bogus=2)
