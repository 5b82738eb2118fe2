"""The training both sides of the Accelerate-checkpoint test run: model, data, loop.

Dropout draws from the global torch RNG (restored from random_states_0.pkl), AdamW has state
(optimizer.bin), StepLR changes the learning rate (scheduler.bin), Counter is a registered
object (custom_checkpoint_0.pkl)."""

from __future__ import annotations

import torch
from torch import nn


class Counter:
    def __init__(self) -> None:
        self.n = 0
        self.total = torch.zeros(())

    def state_dict(self) -> dict:
        return {"n": self.n, "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.n, self.total = state["n"], state["total"]


def make_training():
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Dropout(0.3), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def batches(steps: int, rank: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # The same data whatever the global RNG; each process its own.
    generator = torch.Generator().manual_seed(1234 + rank)
    return [
        (torch.randn(8, 6, generator=generator), torch.randn(8, 1, generator=generator))
        for _ in range(steps)
    ]


def train(accelerator, model, optimizer, scheduler, counter, data) -> None:
    model.train()
    for inputs, targets in data:
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        counter.n += 1
        counter.total = counter.total + loss.detach()
