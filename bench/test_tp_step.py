"""tp[size=2] against one process and against fsdp on 2 ranks: step time and memory per rank.

Run: python -m pytest bench/test_tp_step.py --benchmark-only -s   (informational, CPU)

The Llama of test_dist_overhead.py (h256, 4 layers, AdamW, global batch 8x64). Three arms:
- `one process`: the plain model on the whole batch, uncompiled, in rank 0 while rank 1 waits;
- `tp[size=2]`: both ranks run the whole batch (tp ranks share it), each Linear split;
- `fsdp`: each rank its half of the batch, parameters sharded.
Each round times one AdamW step of each arm in rotating order, with a barrier before each (the
one-process arm runs on rank 0 alone, so it has the machine's two cores to itself only if the
other rank idles at the barrier: it does). Step figures are the median of per-round ratios.
Memory per rank, on rank 0 after warm-up: parameter bytes the rank holds (local shards of
DTensors) and the peak of storages allocated during forward and backward
(`passes/memory/measure.py`). Written to bench/tp_step.json. Nothing asserts on timing.
"""

from __future__ import annotations

import json
import os
import statistics

import torch
from common import barrier_rounds, results_file, stepper
from test_dist_overhead import VOCAB, rank_batch, tiny_llama

from tests.distributed import run_ranks

ROUNDS = int(os.environ.get("RETARGET_BENCH_ROUNDS", "9"))
WARMUP = 2
ARMS = ("one process", "tp[size=2]", "fsdp")
RESULTS_FILE = results_file("tp_step.json")


def _local_bytes(model: torch.nn.Module) -> int:
    total = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    return total


def _step_peak(model: torch.nn.Module, inputs: dict) -> int:
    from retarget.passes.memory.measure import measure_training_step

    measured = measure_training_step(lambda: model(**inputs).loss)
    model.zero_grad(set_to_none=True)
    return measured.peak


def _idle() -> None:
    """Rank 1's part in the one-process arm: wait at the barrier while rank 0 steps."""


def _ranks(rank: int, world: int, rounds: int) -> dict:

    from retarget.driver.compile import compile_for

    whole = rank_batch(0, 1)
    half = rank_batch(rank, world)
    models = {
        "tp[size=2]": (compile_for(tiny_llama(), "tp[size=2]", example_inputs=whole), whole),
        "fsdp": (compile_for(tiny_llama(), "fsdp", example_inputs=half), half),
    }
    if rank == 0:
        models["one process"] = (tiny_llama(), whole)
    steps = {name: stepper(*models[name]) if name in models else _idle for name in ARMS}
    seconds = barrier_rounds(steps, rounds=rounds, warmup=WARMUP)
    memory = {
        name: {"parameter_bytes": _local_bytes(model), "step_peak_bytes": _step_peak(model, inp)}
        for name, (model, inp) in models.items()
    }
    return {"seconds": seconds, "memory": memory}


def test_tp_step_and_memory(benchmark) -> None:
    result: dict = {}

    def launch() -> None:
        result.update(run_ranks(_ranks, 2, ROUNDS, timeout=900)[0])

    benchmark.group = "tp, 2 gloo ranks"
    benchmark.pedantic(launch, rounds=1, iterations=1)
    seconds, memory = result["seconds"], result["memory"]

    def ratio(a: str, b: str) -> float:
        return round(
            statistics.median(x / y for x, y in zip(seconds[a], seconds[b], strict=True)), 3
        )

    def mem(a: str, b: str, key: str) -> float:
        return round(memory[a][key] / memory[b][key], 3)

    info = {
        "rounds": ROUNDS,
        "vocab": VOCAB,
        "median_step_seconds": {k: round(statistics.median(v), 4) for k, v in seconds.items()},
        "step tp / one process": ratio("tp[size=2]", "one process"),
        "step tp / fsdp": ratio("tp[size=2]", "fsdp"),
        "parameter bytes per rank tp / one process": mem(
            "tp[size=2]", "one process", "parameter_bytes"
        ),
        "parameter bytes per rank tp / fsdp": mem("tp[size=2]", "fsdp", "parameter_bytes"),
        "step peak per rank tp / one process": mem("tp[size=2]", "one process", "step_peak_bytes"),
        "step peak per rank tp / fsdp": mem("tp[size=2]", "fsdp", "step_peak_bytes"),
        "memory": memory,
    }
    benchmark.extra_info.update(info)
    RESULTS_FILE.write_text(json.dumps(info, indent=2) + "\n")
    print("\n" + json.dumps(info))
    assert set(memory) == set(ARMS)
