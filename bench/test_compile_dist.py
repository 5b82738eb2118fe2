"""Step time of ddp+compile and fsdp+bf16+compile against the same written by hand, 2 ranks.

Run: python -m pytest bench/test_compile_dist.py --benchmark-only -s   (see bench/README.md)

The method of bench/test_dist_overhead.py (its model, batch, warm-up, and rounds interleaved in
alternating order with a barrier before every step; rank 0's times), with a compile part:

- ddp+compile: compile_for(m, "ddp+compile") against `layer.compile()` on each decoder layer,
  then DistributedDataParallel(m);
- fsdp+bf16+compile: compile_for(m, "fsdp+bf16+compile") against each layer's forward through
  torch.compile, then fully_shard per layer and root (MixedPrecisionPolicy(bf16, reduce fp32))
  and torch.autocast(bf16) around the forward.

Under FSDP the by-hand arm compiles each layer's forward, not the module call, so that FSDP's
hooks run eagerly around the compiled code, as they do around retarget's compiled regions.
The figure is the median over rounds of step(compiled) / step(by hand). Nothing here asserts
on timing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics

import pytest
import torch
from common import barrier_rounds, results_file, source_revision, stepper
from compile_arms import conditions, region_compiles
from test_dist_overhead import rank_batch, tiny_llama

from tests.distributed import run_ranks

ROUNDS = int(os.environ.get("RETARGET_BENCH_ROUNDS", "9"))
WARMUP = 2
CONFIGS = ("ddp+compile", "fsdp+bf16+compile")
RESULTS_FILE = results_file("compile_dist.json")
RESULTS: dict[str, dict] = {}


def by_hand(config: str, world: int) -> tuple[torch.nn.Module, contextlib.AbstractContextManager]:
    """The model and forward context a user writes for `config` without retarget."""
    model = tiny_llama()
    if config == "ddp+compile":
        from torch.nn.parallel import DistributedDataParallel

        for layer in model.model.layers:
            layer.compile(backend="inductor")
        return DistributedDataParallel(model), contextlib.nullcontext()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        layer.forward = torch.compile(layer.forward, backend="inductor")
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, torch.autocast("cpu", dtype=torch.bfloat16)


def _ranks(rank: int, world: int, config: str, rounds: int) -> dict[str, list[float]]:

    from retarget.driver.compile import compile_for

    inputs = rank_batch(rank, world)
    compiled = compile_for(tiny_llama(), config, example_inputs=inputs)
    hand_model, hand_context = by_hand(config, world)
    steps = {
        "compiled": stepper(compiled, inputs),
        "by_hand": stepper(hand_model, inputs, hand_context),
    }
    seconds = barrier_rounds(steps, rounds=rounds, warmup=WARMUP)
    seconds["compile_stats"] = region_compiles(compiled)
    return seconds


@pytest.mark.parametrize("config", CONFIGS)
def test_compile_dist_step(benchmark, config: str) -> None:
    seconds: dict[str, list] = {}

    def launch() -> None:
        seconds.update(run_ranks(_ranks, 2, config, ROUNDS, timeout=1800)[0])

    benchmark.group = "compile: step time, 2 gloo ranks"
    benchmark.pedantic(launch, rounds=1, iterations=1)
    compile_stats = seconds.pop("compile_stats")
    ratios = [c / h for c, h in zip(seconds["compiled"], seconds["by_hand"], strict=True)]
    median = {name: statistics.median(s) for name, s in seconds.items()}
    info = {
        "config": config,
        "rounds": ROUNDS,
        "median_step_seconds": {k: round(v, 4) for k, v in median.items()},
        "ratio compiled / by hand (median of rounds)": round(statistics.median(ratios), 3),
        "ratio compiled / by hand (geometric mean of rounds)": round(
            math.exp(statistics.fmean(math.log(r) for r in ratios)), 3
        ),
        "ratio of medians": round(median["compiled"] / median["by_hand"], 3),
        "per-round ratios": [round(r, 3) for r in ratios],
        "regions compiled": compile_stats,
        **source_revision(),
        **conditions(),
    }
    benchmark.extra_info.update(info)
    RESULTS[config] = info
    print("\n" + json.dumps(info))


@pytest.mark.bench_summary
def test_compile_dist_summary() -> None:
    """Write what the benchmarks measured to bench/compile_dist.json (a full run only)."""
    if set(RESULTS) != set(CONFIGS):
        pytest.skip("not every configuration ran (partial run or --benchmark-disable)")
    RESULTS_FILE.write_text(json.dumps(RESULTS, indent=2) + "\n")
