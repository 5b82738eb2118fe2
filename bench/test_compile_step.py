"""Step time of the `compile` part against the same model uncompiled, the same regional
torch.compile written by hand, and Accelerate 1.15's regional compilation, in one process.

Run: python -m pytest bench/test_compile_step.py --benchmark-only -s   (see bench/README.md)

Every arm (bench/compile_arms.py) is built and compiled (its first step run) before any timing;
then each round times one SGD step of every arm, interleaved, so load from other jobs falls on
all alike; figures are ratios of the medians over `RETARGET_BENCH_ROUNDS` (default 9) rounds,
after one warm-up round. Dynamo is reset before each row, so no row reuses another's compiled
code. Nothing here asserts on timing.

- fp32 (FP32: h256, 4 layers, batch 4x128): uncompiled, compile, by_hand, accelerate,
  retarget_accel;
- bf16 (BF16: h256, 2 layers, 2x64): uncompiled, compile ("bf16+compile"), by_hand (autocast);
- bf16+ac (BF16): uncompiled, compile ("bf16+ac+compile"), by_hand (autocast, checkpoint).

Figures per row: compile / uncompiled, compile / by hand, and for fp32 retarget's Accelerator /
Accelerate's (the same script and plugin). The first-step times are bench/test_compile_time.py's
(each needs a fresh process and a cold compile cache).
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from common import interleaved_medians, results_file, source_revision
from compile_arms import ARMS, BF16, FP32, conditions, region_compiles

ROUNDS = int(os.environ.get("RETARGET_BENCH_ROUNDS", "9"))
THREADS = int(os.environ.get("RETARGET_BENCH_THREADS", "1"))
RESULTS_FILE = results_file("compile_step.json")
RESULTS: dict[str, dict] = {}

ROWS = {
    "fp32": (FP32, ("uncompiled", "compile", "by_hand", "accelerate", "retarget_accel")),
    "bf16": (BF16, ("uncompiled", "compile", "by_hand")),
    "bf16+ac": (BF16, ("uncompiled", "compile", "by_hand")),
}
#: figure name -> (numerator arm, denominator arm)
RATIOS = {
    "compile / uncompiled": ("compile", "uncompiled"),
    "compile / by hand": ("compile", "by_hand"),
    "retarget Accelerator / Accelerate": ("retarget_accel", "accelerate"),
}


@pytest.mark.parametrize("row", list(ROWS))
def test_compile_step(benchmark, row: str) -> None:
    if row == "fp32":
        pytest.importorskip("accelerate")
    shape, arms = ROWS[row]
    torch._dynamo.reset()
    before = torch.get_num_threads()
    # inductor's C++ kernels take the thread count in force when they are generated
    torch.set_num_threads(THREADS)
    try:
        steps = {arm: ARMS[arm](shape, row) for arm in arms}
        for one_step in steps.values():
            one_step()  # compiles
    finally:
        torch.set_num_threads(before)
    benchmark.group = "compile: step time, one process"
    median = interleaved_medians(benchmark, steps, rounds=ROUNDS, threads=THREADS)
    info = {
        "row": row,
        "shape": dataclasses.asdict(shape),
        "rounds": ROUNDS,
        "median_step_seconds": {k: round(v, 4) for k, v in median.items()},
        "ratios": {
            name: round(median[a] / median[b], 3)
            for name, (a, b) in RATIOS.items()
            if a in median and b in median
        },
        "regions compiled": region_compiles(steps["compile"].model),
        **source_revision(),
        **conditions(),
    }
    benchmark.extra_info.update(info)
    RESULTS[row] = info
    print("\n" + json.dumps(info))


@pytest.mark.bench_summary
def test_compile_step_summary() -> None:
    """Write what the benchmarks measured to bench/compile_step.json (a full run only)."""
    if set(RESULTS) != set(ROWS):
        pytest.skip("not every row ran (partial run or --benchmark-disable)")
    RESULTS_FILE.write_text(json.dumps(RESULTS, indent=2) + "\n")
