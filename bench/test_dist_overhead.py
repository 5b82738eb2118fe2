"""Step time of compile_for for ddp and fsdp+bf16 against the same written by hand, on 2 ranks.

Run: python -m pytest bench/test_dist_overhead.py --benchmark-only -s   (see bench/README.md)

Each configuration launches 2 gloo ranks (tests/distributed.py: spawned processes with
torchrun's environment, one intra-op thread each). Every rank builds both models from the same
seed: the compiled one, and the one a user would write without retarget. They train on the same
batch (each rank its own half of a global batch). After warm-up steps (the first compiled
fsdp+bf16 step captures the blocks' bf16 signature), each round times one optimizer step of
each, interleaved and in alternating order, with a barrier before every step so both ranks start
it together: load from other jobs falls on both alike. Rank 0's times are reported (a step ends
with collectives, so both ranks see the same step time). The figure is the median over rounds of
step(compiled) / step(by hand), robust to the rounds another job disturbed; the geometric mean
of the per-round ratios and the ratio of median step times are recorded too (goal: <= 1.02).
Nothing here asserts on timing.

| configuration | compiled                    | by hand                                           |
|---|---|---|
| ddp           | compile_for(m, "ddp")       | DistributedDataParallel(m)                        |
| fsdp+bf16     | compile_for(m, "fsdp+bf16") | fully_shard per layer and root with               |
|               |                             | MixedPrecisionPolicy(bf16, reduce fp32), autocast |
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics

import pytest
import torch
from common import barrier_rounds, llama, results_file, stepper

from tests.distributed import run_ranks

ROUNDS = int(os.environ.get("RETARGET_BENCH_ROUNDS", "9"))
WARMUP = 2
VOCAB, BATCH, SEQ = 1024, 8, 64  # global batch; each of the 2 ranks takes 4 rows
CONFIGS = ("ddp", "fsdp+bf16")
RESULTS_FILE = results_file("dist_overhead.json")
RESULTS: dict[str, dict] = {}


def tiny_llama() -> torch.nn.Module:
    return llama(layers=4, hidden=256, intermediate=688, heads=4, vocab=VOCAB, positions=SEQ)


def rank_batch(rank: int, world: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    rows = BATCH // world
    mine = ids[rank * rows : (rank + 1) * rows]
    return {"input_ids": mine, "labels": mine.clone()}


def by_hand(config: str, world: int) -> tuple[torch.nn.Module, contextlib.AbstractContextManager]:
    """The model and forward context a user writes for `config` without retarget."""
    model = tiny_llama()
    if config == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model), contextlib.nullcontext()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
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
    return barrier_rounds(steps, rounds=rounds, warmup=WARMUP)


@pytest.mark.parametrize("config", CONFIGS)
def test_dist_step_overhead(benchmark, config: str) -> None:
    seconds: dict[str, list[float]] = {}

    def launch() -> None:
        seconds.update(run_ranks(_ranks, 2, config, ROUNDS, timeout=900)[0])

    benchmark.group = "distributed overhead, 2 gloo ranks"
    benchmark.pedantic(launch, rounds=1, iterations=1)
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
    }
    benchmark.extra_info.update(info)
    RESULTS[config] = info
    print("\n" + json.dumps(info))


@pytest.mark.bench_summary
def test_dist_overhead_summary() -> None:
    """Write what the benchmarks measured to bench/dist_overhead.json (a full run only)."""
    if set(RESULTS) != set(CONFIGS):
        pytest.skip("not every configuration ran (partial run or --benchmark-disable)")
    RESULTS_FILE.write_text(json.dumps(RESULTS, indent=2) + "\n")
