"""The arms the compile benchmarks time: one Llama trained uncompiled, with retarget's `compile`
part, with the same regional torch.compile written by hand, and under Accelerate 1.15's regional
compilation, each built from the same seed and batch.

Used in-process by bench/test_compile_step.py and bench/test_compile_dist.py, and run as a
script by bench/test_compile_time.py, one fresh process per measurement (no dynamo state, no
compiled code in memory, and a fresh TORCHINDUCTOR_CACHE_DIR chosen by the caller):

    python bench/compile_arms.py --arm compile --layers 32     # prints one JSON line

| arm            | what trains                                                                  |
|---|---|
| uncompiled     | the plain model                                                              |
| compile        | compile_for(model, "<precision>+compile"): each block type's graph compiled   |
| by_hand        | `layer.compile()` on each decoder layer (torch.compile, in place)            |
| whole          | `model.compile()`: the whole model through torch.compile                     |
| accelerate     | accelerate.Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="inductor",    |
|                | use_regional_compilation=True)).prepare(model, optimizer, loader)           |
| retarget_accel | retarget.Accelerator with that same plugin (Accelerate's own instance)       |

The by-hand forms of the other precisions: bf16 is `torch.autocast("cpu", bfloat16)` around the
forward; bf16+ac also runs each compiled layer under `torch.utils.checkpoint` (non-reentrant),
the order retarget uses (the checkpoint wraps the compiled call, so recompute reuses it).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from common import llama
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

VOCAB = 1024
LR = 1e-3


@dataclass(frozen=True)
class Shape:
    """A Llama-style model and its batch."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    batch: int = 4
    seq: int = 128

    def model(self) -> torch.nn.Module:
        return llama(
            layers=self.layers,
            hidden=self.hidden,
            intermediate=self.hidden * 11 // 4,
            heads=self.heads,
            vocab=VOCAB,
            positions=self.seq,
        )

    def batch_rows(self) -> list[dict[str, torch.Tensor]]:
        ids = torch.randint(
            0, VOCAB, (self.batch, self.seq), generator=torch.Generator().manual_seed(0)
        )
        return [{"input_ids": row, "labels": row.clone()} for row in ids]

    def inputs(self) -> dict[str, torch.Tensor]:
        rows = self.batch_rows()
        return {key: torch.stack([r[key] for r in rows]) for key in rows[0]}


#: The issue's fp32 Llama (hidden 256, 4 layers, seq 128, batch 4).
FP32 = Shape()
#: bf16 matmuls are ~58x slower than fp32 on a CPU without AVX512-BF16: a smaller model keeps a
#: bf16 round at seconds; its rows are overhead ratios, not speedups.
BF16 = Shape(layers=2, hidden=256, heads=4, batch=2, seq=64)

Step = Callable[[], None]


def sgd_step(model: torch.nn.Module, inputs: dict, context=None, backward=None) -> Step:
    """One SGD training step of `model` on `inputs` (forward under `context` if given)."""
    context = context if context is not None else contextlib.nullcontext()
    backward = backward if backward is not None else torch.Tensor.backward
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def one_step() -> None:
        with context:
            loss = model(**inputs).loss
        backward(loss.float())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    one_step.model = model
    return one_step


def conditions() -> dict:
    """When and on what a measurement ran: date, CPUs, torch, and the load average (1 minute)
    from other jobs on the machine."""
    return {
        "date": datetime.date.today().isoformat(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "load_average": round(os.getloadavg()[0], 2),
    }


def region_compiles(compiled) -> list[dict]:
    """Per region of a CompiledModule: compiles, recompiles, graph breaks, fallback."""
    keys = ("compiles", "recompiles", "graph_breaks", "compile_seconds", "fallback")
    regions = compiled.report.to_dict()["regions"]
    return [{"region": r["name"], **{k: r["compile"][k] for k in keys}} for r in regions]


def autocast_for(precision: str):
    if "bf16" in precision:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def compile_each_layer(model: torch.nn.Module, *, checkpointed: bool = False) -> torch.nn.Module:
    """The regional torch.compile a user writes: each decoder layer compiled in place; with
    `checkpointed`, each compiled layer's call under a non-reentrant checkpoint."""
    for layer in model.model.layers:
        if not checkpointed:
            layer.compile(backend="inductor")
            continue
        compiled_forward = torch.compile(layer.forward, backend="inductor")
        layer.forward = functools.partial(checkpoint, compiled_forward, use_reentrant=False)
    return model


def uncompiled(shape: Shape, precision: str = "fp32") -> Step:
    return sgd_step(shape.model(), shape.inputs(), autocast_for(precision))


def retarget_compile(shape: Shape, precision: str = "fp32") -> Step:
    from retarget.driver.compile import compile_for

    target = "single+compile" if precision == "fp32" else f"{precision}+compile"
    compiled = compile_for(shape.model(), target, example_inputs=shape.inputs())
    return sgd_step(compiled, shape.inputs())


def by_hand(shape: Shape, precision: str = "fp32") -> Step:
    model = compile_each_layer(shape.model(), checkpointed="ac" in precision)
    return sgd_step(model, shape.inputs(), autocast_for(precision))


def whole(shape: Shape, precision: str = "fp32") -> Step:
    model = shape.model()
    model.compile(backend="inductor")
    return sgd_step(model, shape.inputs(), autocast_for(precision))


def _accelerator_step(accelerator, shape: Shape) -> Step:
    """The training script both Accelerators run: prepare model, optimizer and loader, then
    forward, `accelerator.backward`, step, zero_grad on the loader's (one) batch."""
    model = shape.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = DataLoader(shape.batch_rows(), batch_size=shape.batch)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batch = next(iter(loader))

    def one_step() -> None:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return one_step


def regional_plugin():
    from accelerate.utils import TorchDynamoPlugin

    return TorchDynamoPlugin(backend="inductor", use_regional_compilation=True)


def accelerate(shape: Shape, precision: str = "fp32") -> Step:
    from accelerate import Accelerator

    assert precision == "fp32", "the Accelerate arm is the fp32 row's"
    return _accelerator_step(Accelerator(cpu=True, dynamo_plugin=regional_plugin()), shape)


def retarget_accel(shape: Shape, precision: str = "fp32") -> Step:
    from retarget import Accelerator

    assert precision == "fp32", "the Accelerate arm is the fp32 row's"
    accelerator = Accelerator(cpu=True, dynamo_plugin=regional_plugin())
    assert "compile" in str(accelerator.target), accelerator.target
    return _accelerator_step(accelerator, shape)


ARMS: dict[str, Callable[..., Step]] = {
    "uncompiled": uncompiled,
    "compile": retarget_compile,
    "by_hand": by_hand,
    "whole": whole,
    "accelerate": accelerate,
    "retarget_accel": retarget_accel,
}


def time_to_trained_steps(arm: str, shape: Shape, precision: str, steps: int) -> dict:
    """Seconds from the model's construction to the end of the first step (what a user waits
    for: capture, compile and the first forward/backward), and the median of the next steps."""
    start = time.perf_counter()
    one_step = ARMS[arm](shape, precision)
    one_step()
    first = time.perf_counter() - start
    later = []
    for _ in range(steps):
        t = time.perf_counter()
        one_step()
        later.append(time.perf_counter() - t)
    later.sort()
    return {
        "arm": arm,
        "layers": shape.layers,
        "precision": precision,
        "first_step_seconds": round(first, 3),
        "step_seconds": round(later[len(later) // 2], 4) if later else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", choices=list(ARMS), required=True)
    parser.add_argument("--layers", type=int, default=FP32.layers)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--steps", type=int, default=0, help="steps timed after the first")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = Shape(layers=args.layers)
    print(json.dumps(time_to_trained_steps(args.arm, shape, args.precision, args.steps)))


if __name__ == "__main__":
    main()
