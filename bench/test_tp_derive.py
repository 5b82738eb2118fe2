"""Cost of deriving the tensor-parallel plan, against the compile_for that captured the graphs.

Run: python -m pytest bench/test_tp_derive.py --benchmark-only   (see bench/README.md)

`derive_tp_plan` walks each distinct block type's graph once and runs that block a few times, so
its time should not grow with depth. Each benchmark times it on a Llama-style model of 2 and 32
layers (hidden 512) already compiled, and stores the compile_for seconds and the ratio in
`benchmark.extra_info` (the issue's goal: under 5% of compile_for at 32 layers). Nothing here
asserts on timing.
"""

from __future__ import annotations

import os
import time

import common
import pytest
import torch

from retarget.driver.compile import compile_for
from retarget.passes.shard.tp_derive import derive_tp_plan

THREADS = int(os.environ.get("RETARGET_BENCH_THREADS", "1"))


@pytest.mark.parametrize("layers", [2, 32])
def test_derive_tp_plan(benchmark, layers):
    torch.set_num_threads(THREADS)
    model = common.llama(layers=layers, hidden=512, intermediate=1376, heads=8)
    start = time.perf_counter()
    compiled = compile_for(model, "single", example_inputs=common.token_batch(1024, 2, 32))
    compile_seconds = time.perf_counter() - start
    plan = benchmark(derive_tp_plan, compiled.program, 4)
    benchmark.extra_info.update(
        compile_for_seconds=round(compile_seconds, 3),
        ratio_to_compile_for=round(benchmark.stats.stats.median / compile_seconds, 4),
        plan=plan.describe(),
    )
