"""Step time of tp+compile on 2 gloo ranks: against tp uncompiled, and against the same model
written by hand with torch's parallel styles and a per-block torch.compile.

Run: python -m pytest bench/test_tp_compile.py --benchmark-only -s   (see bench/README.md)

The method of bench/test_compile_dist.py (its model, warm-up, rounds interleaved in rotated
order with a barrier before every step; rank 0's times). Arms, on one batch both tp ranks share:

- tp: compile_for(m, "tp[size=2]") (the split blocks' graphs, uncompiled);
- tp+compile: compile_for(m, "tp[size=2]+compile") (inductor, each split block type compiled);
- by hand: `parallelize_module` with the model config's base_model_tp_plan styles
  (ColwiseParallel on q/k/v/gate/up, RowwiseParallel on o/down) on each decoder layer, then
  `layer.compile()` on each, as torchtitan applies tp before compile.

Figures: the median over rounds of tp+compile / tp (goal <= 1.0) and tp+compile / by hand (goal
<= 1.02). Nothing here asserts on timing.
"""

from __future__ import annotations

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
RESULTS_FILE = results_file("tp_compile.json")
RESULTS: dict[str, dict] = {}


def by_hand(world: int) -> torch.nn.Module:
    """torch's parallel styles on each decoder layer, then a per-layer torch.compile."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = tiny_llama()
    mesh = init_device_mesh("cpu", (world,))
    styles = {
        **{f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
        "self_attn.o_proj": RowwiseParallel(),
        **{f"mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")},
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, mesh, styles)
        layer.compile(backend="inductor")
    return model


def _ranks(rank: int, world: int, rounds: int) -> dict[str, list]:
    from retarget.driver.compile import compile_for

    inputs = rank_batch(0, 1)  # tp ranks share the batch
    plain = compile_for(tiny_llama(), "tp[size=2]", example_inputs=inputs)
    compiled = compile_for(tiny_llama(), "tp[size=2]+compile", example_inputs=inputs)
    steps = {
        "tp": stepper(plain, inputs),
        "tp+compile": stepper(compiled, inputs),
        "by_hand": stepper(by_hand(world), inputs),
    }
    seconds: dict[str, list] = dict(barrier_rounds(steps, rounds=rounds, warmup=WARMUP))
    seconds["compile_stats"] = region_compiles(compiled)
    return seconds


def _ratio(seconds: dict[str, list], over: str) -> dict[str, object]:
    ratios = [c / o for c, o in zip(seconds["tp+compile"], seconds[over], strict=True)]
    return {
        "median of rounds": round(statistics.median(ratios), 3),
        "geometric mean of rounds": round(
            math.exp(statistics.fmean(math.log(r) for r in ratios)), 3
        ),
        "per-round": [round(r, 3) for r in ratios],
    }


def test_tp_compile_step(benchmark) -> None:
    seconds: dict[str, list] = {}

    def launch() -> None:
        seconds.update(run_ranks(_ranks, 2, ROUNDS, timeout=1800)[0])

    benchmark.group = "tp+compile: step time, 2 gloo ranks"
    benchmark.pedantic(launch, rounds=1, iterations=1)
    compile_stats = seconds.pop("compile_stats")
    median = {name: statistics.median(s) for name, s in seconds.items()}
    info = {
        "rounds": ROUNDS,
        "median_step_seconds": {k: round(v, 4) for k, v in median.items()},
        "tp+compile / tp": _ratio(seconds, "tp"),
        "tp+compile / by hand (parallel styles + per-block compile)": _ratio(seconds, "by_hand"),
        "regions compiled": compile_stats,
        **source_revision(),
        **conditions(),
    }
    benchmark.extra_info.update(info)
    RESULTS["tp_compile"] = info
    print("\n" + json.dumps(info))


@pytest.mark.bench_summary
def test_tp_compile_summary() -> None:
    """Write what the benchmark measured to bench/tp_compile.json (a full run only)."""
    if "tp_compile" not in RESULTS:
        pytest.skip("the benchmark did not run (partial run or --benchmark-disable)")
    RESULTS_FILE.write_text(json.dumps(RESULTS, indent=2) + "\n")
