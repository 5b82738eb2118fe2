"""`retarget demo`: train the built-in TinyLM for a few steps, compiled for a target.

    result = run_demo(target="single", steps=20)
    print(result.compiled.report); print(result.summary())

The data is a small fixed pool of synthetic batches, cycled: random tokens hold nothing to learn
beyond their frequencies, but a pool the model can memorise makes the loss visibly fall, which
is the point of the demo (the compiled model trains).
"""

from __future__ import annotations

import io
import sys
import time
from dataclasses import dataclass
from typing import IO

import torch

from retarget.driver.compile import compile_for
from retarget.driver.compiled import CompiledModule
from retarget.models import synthetic_batch, tiny_lm
from retarget.report.memory_estimate import estimate_memory
from retarget.targets.grammar import Target

#: Distinct batches the demo cycles through.
POOL = 4
LEARNING_RATE = 3e-3


class ProgressBar:
    """`[#####-----] step k/N  loss L  R steps/s` on one line when `stream` is a terminal;
    otherwise (logs, CI) a plain line about every N/5 steps, since carriage returns garble them.
    """

    def __init__(self, total: int, stream: IO[str], width: int = 24):
        self.total, self.stream, self.width = total, stream, width
        self.tty = getattr(stream, "isatty", lambda: False)()
        self.every = max(1, total // 5)
        self.start = time.perf_counter()

    def update(self, step: int, loss: float) -> None:
        """Show that `step` (1-based) finished with `loss`."""
        rate = step / max(time.perf_counter() - self.start, 1e-9)
        status = f"step {step}/{self.total}  loss {loss:.4f}  {rate:.1f} steps/s"
        if self.tty:
            filled = self.width * step // self.total
            bar = "#" * filled + "-" * (self.width - filled)
            self.stream.write(f"\r[{bar}] {status}")
        elif step % self.every == 0 or step == self.total:
            self.stream.write(status + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line on a terminal."""
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


@dataclass
class DemoResult:
    """The trained CompiledModule, the loss of every step and the training time."""

    compiled: CompiledModule
    losses: list[float]
    seconds: float

    def summary(self) -> str:
        """One line: first and last loss, steps and speed."""
        steps = len(self.losses)
        return (
            f"loss: first {self.losses[0]:.4f} -> last {self.losses[-1]:.4f} "
            f"over {steps} steps ({steps / max(self.seconds, 1e-9):.1f} steps/s)"
        )


def run_demo(
    *,
    target: str | Target = "single",
    steps: int = 20,
    batch: int = 4,
    seq: int = 32,
    capture: str = "regions",
    stream: IO[str] | None = None,
) -> DemoResult:
    """Compile a seeded TinyLM for `target` and train it `steps` steps with AdamW.

    A line saying what it trains, then progress, go to `stream` (stderr by default), from the
    main process only when launched on several. The activations are measured after training,
    so the report shows them.
    """
    torch.manual_seed(0)
    model = tiny_lm()
    generator = torch.Generator().manual_seed(0)
    pool = [synthetic_batch(model.config, batch, seq, generator=generator) for _ in range(POOL)]
    compiled = compile_for(model, target, example_inputs=pool[0], capture=capture)
    main = compiled.runtime.is_main_process
    stream = (stream or sys.stderr) if main else io.StringIO()  # one rank speaks under launch
    parameters = sum(p.numel() for p in model.parameters())
    print(
        f"retarget demo: a TinyLM ({model.config.layers} blocks, {parameters:,} parameters) "
        f"compiled for '{compiled.program.target}', trained {steps} steps with AdamW on "
        f"{POOL} synthetic batches of {batch} x {seq} tokens",
        file=stream,
        flush=True,
    )
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=LEARNING_RATE)
    bar = ProgressBar(steps, stream)
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(steps):
        loss = compiled(**pool[step % POOL])["loss"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        bar.update(step + 1, losses[-1])
    bar.close()
    seconds = time.perf_counter() - start
    estimate_memory(compiled)  # one profiled forward: the report then shows the activations
    return DemoResult(compiled, losses, seconds)
