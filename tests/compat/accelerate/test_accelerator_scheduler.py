"""PreparedScheduler: steps with the optimizer (Accelerate's rules), reads through otherwise."""

from __future__ import annotations

import torch

from retarget.compat.accelerate.scheduler import PreparedScheduler


def scheduler_and_flags(steps_per_update=1, step_with_optimizer=True, kind="step"):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    if kind == "onecycle":
        inner = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=3)
    else:
        inner = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    optimizer.step()  # as in training: the optimizer steps before its scheduler
    flags = {"sync": True, "skipped": False}
    prepared = PreparedScheduler(
        inner,
        step_with_optimizer=step_with_optimizer,
        steps_per_update=steps_per_update,
        sync_gradients=lambda: flags["sync"],
        step_was_skipped=lambda: flags["skipped"],
    )
    return prepared, inner, flags


def test_steps_only_when_the_optimizer_steps():
    prepared, inner, flags = scheduler_and_flags()
    flags["sync"] = False  # a micro-step inside accumulate(): the optimizer did not step
    prepared.step()
    assert inner.last_epoch == 0
    flags.update(sync=True, skipped=True)  # fp16 scaler skipped the step
    prepared.step()
    assert inner.last_epoch == 0
    flags["skipped"] = False
    prepared.step()
    assert inner.last_epoch == 1 and prepared.get_last_lr() == [0.5]


def test_one_step_per_process_unless_batches_are_split():
    prepared, inner, _ = scheduler_and_flags(steps_per_update=2)
    prepared.step()
    assert inner.last_epoch == 2 and prepared.get_last_lr() == [0.25]


def test_onecycle_stops_at_its_total_steps_instead_of_raising():
    prepared, inner, _ = scheduler_and_flags(steps_per_update=2, kind="onecycle")
    prepared.step()
    prepared.step()  # would be steps 3 and 4 of 3
    assert inner.last_epoch == 3


def test_without_step_with_optimizer_every_call_steps():
    prepared, inner, flags = scheduler_and_flags(steps_per_update=4, step_with_optimizer=False)
    flags["sync"] = False
    prepared.step()
    assert inner.last_epoch == 1


def test_state_round_trips_and_attributes_read_through():
    prepared, inner, _ = scheduler_and_flags()
    prepared.step()
    state = prepared.state_dict()
    fresh, fresh_inner, _ = scheduler_and_flags()
    fresh.load_state_dict(state)
    assert fresh_inner.last_epoch == 1 and fresh.gamma == 0.5
