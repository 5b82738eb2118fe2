"""Overhead of compile_for against the same configuration written by hand, one process.

Run: python -m pytest bench/test_overhead.py --benchmark-only -s   (see bench/README.md)

For each configuration the compiled model and a hand-written equivalent train the same tiny
Llama (same initial weights, same batch); each round times one step of each, interleaved, so
load from other jobs falls on both alike. The figure is the ratio of medians
compiled / by hand (goal: <= 1.02). Nothing here asserts on timing.

| configuration | compiled                 | by hand                                          |
|---|---|---|
| fp32          | compile_for(m, "single") | the plain model                                  |
| bf16          | compile_for(m, "bf16")   | torch.autocast("cpu", bfloat16) around forward   |
| ac            | compile_for(m, "ac")     | torch.utils.checkpoint (non-reentrant) per layer |
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable

import pytest
import torch
from common import interleaved_medians, llama, results_file, stepper, token_batch
from torch.utils.checkpoint import checkpoint

from retarget.driver.compile import compile_for

ROUNDS = int(os.environ.get("RETARGET_BENCH_ROUNDS", "9"))
THREADS = int(os.environ.get("RETARGET_BENCH_THREADS", "1"))
VOCAB, BATCH, SEQ = 1024, 4, 64
RESULTS: dict[str, dict] = {}
RESULTS_FILE = results_file("overhead.json")


def tiny_llama() -> torch.nn.Module:
    return llama(layers=4, hidden=256, intermediate=688, heads=4, vocab=VOCAB, positions=SEQ)


def batch() -> dict[str, torch.Tensor]:
    return token_batch(VOCAB, BATCH, SEQ)


def by_hand(config: str) -> tuple[torch.nn.Module, contextlib.AbstractContextManager]:
    """The model and the forward context a user would write for `config` without retarget."""
    model = tiny_llama()
    if config == "bf16":
        return model, torch.autocast("cpu", dtype=torch.bfloat16)
    if config == "ac":
        for layer in model.model.layers:
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    return model, contextlib.nullcontext()


def warm_stepper(model: torch.nn.Module, context) -> Callable[[], None]:
    one_step = stepper(model, batch(), context)
    one_step()
    return one_step


TARGETS = {"fp32": "single", "bf16": "bf16", "ac": "ac"}


@pytest.mark.parametrize("config", list(TARGETS))
def test_compiled_vs_by_hand(benchmark, config: str) -> None:
    compiled = compile_for(tiny_llama(), TARGETS[config], example_inputs=batch())
    steps = {
        "compiled": warm_stepper(compiled, contextlib.nullcontext()),
        "by_hand": warm_stepper(*by_hand(config)),
    }
    benchmark.group = "overhead, one process"
    median = interleaved_medians(benchmark, steps, rounds=ROUNDS, threads=THREADS)
    info = {
        "config": config,
        "median_step_seconds": {k: round(v, 4) for k, v in median.items()},
        "ratio compiled / by hand": round(median["compiled"] / median["by_hand"], 3),
    }
    benchmark.extra_info.update(info)
    RESULTS[config] = info
    RESULTS_FILE.write_text(json.dumps(RESULTS, indent=2) + "\n")
    print("\n" + json.dumps(info))
