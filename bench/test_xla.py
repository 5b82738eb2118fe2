"""XLA:CPU step time against eager CPU on the tiny Llama, and XLA graphs compiled per step.

Run in the xla environment (torch 2.9 + torch-xla 2.9, constraints-xla.txt; see bench/README.md
"XLA:CPU"):

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 TF_CPP_MIN_LOG_LEVEL=2 RETARGET_BENCH_ROUNDS=9 \\
        .venv-xla/bin/python -m pytest bench/test_xla.py --benchmark-only -s

Skipped where torch_xla does not import (the main environment, `retarget bench`, which does not
list this file). Informational: XLA:CPU is not a fast path, it is where the xla target's numerics
and compile behaviour can be checked without a TPU.

Each case runs in a fresh process (SPMD is a process-wide switch): the tiny Llama of
test_overhead.py trains with AdamW in eager CPU and compiled for the case's target, one step of
each per round, interleaved, after warm-up steps; the figure is the ratio of medians xla / eager.
The same process records how many graphs XLA compiled in each step (`xla_steps`): the first
steps compile, and after warm-up a fixed shape compiles nothing. pytest-benchmark times the
whole child run once (not a figure); the medians come from the child.

| case      | target            | what runs                                          |
|---|---|---|
| one device | xla[spmd=false]  | the whole model on one XLA:CPU device              |
| spmd 4    | xla               | one SPMD program over 4 virtual devices, blocks sharded on dim 0 |
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import time

import pytest
import torch
from common import llama, results_file, source_revision, stepper, token_batch

from retarget.execution import xla_device as xla

pytestmark = pytest.mark.skipif(not xla.available(), reason="torch_xla is not importable here")

ROUNDS = int(os.environ.get("RETARGET_BENCH_ROUNDS", "9"))
THREADS = int(os.environ.get("RETARGET_BENCH_THREADS", "1"))
WARM_UP = 4
VOCAB, BATCH, SEQ = 1024, 4, 64
CASES = {"one device": "xla[spmd=false]", "spmd 4": "xla"}
RESULTS: dict[str, dict] = {}
RESULTS_FILE = results_file("xla.json")


def tiny_llama() -> torch.nn.Module:
    return llama(layers=4, hidden=256, intermediate=688, heads=4, vocab=VOCAB, positions=SEQ)


def measure(target: str, rounds: int, threads: int) -> dict:
    """In a fresh process: warm-up, then `rounds` interleaved eager / xla steps."""
    import retarget
    from retarget.execution.xla_placement import xla_steps

    torch.set_num_threads(threads)
    batch = token_batch(VOCAB, BATCH, SEQ)
    compiled = retarget.compile_for(tiny_llama(), target, example_inputs=batch)
    steps = {"eager": stepper(tiny_llama(), batch), "xla": stepper(compiled, batch)}
    first = []
    for _ in range(WARM_UP):
        start = time.perf_counter()
        steps["xla"]()
        xla.sync(wait=True)
        first.append(time.perf_counter() - start)
        steps["eager"]()
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, one_step in steps.items():
            start = time.perf_counter()
            one_step()
            if name == "xla":
                xla.sync(wait=True)  # the step runs here: time it, not only its tracing
            seconds[name].append(time.perf_counter() - start)
    compiled(**batch)  # a last call's sync counts the last step's graphs
    counts = xla_steps(compiled).per_step()
    return {
        "target": target,
        "devices": compiled.program.plan.xla.devices,
        "median_step_seconds": {k: round(statistics.median(v), 4) for k, v in seconds.items()},
        "warm_up_step_seconds": [round(s, 3) for s in first],
        "graphs_compiled_per_step": counts,
        "graphs_compiled_after_warm_up": sum(counts[WARM_UP:]),
    }


@pytest.mark.parametrize("case", list(CASES))
def test_xla_step_vs_eager(benchmark, case: str) -> None:
    if case == "spmd 4" and os.environ.get("CPU_NUM_DEVICES") != "4":
        pytest.skip("the spmd case needs CPU_NUM_DEVICES=4")
    context = multiprocessing.get_context("spawn")
    found: dict = {}

    def child_run() -> None:
        with context.Pool(1) as pool:
            found.update(pool.apply(measure, (CASES[case], ROUNDS, THREADS)))

    benchmark.group = "xla:cpu vs eager cpu"
    benchmark.pedantic(child_run, rounds=1, iterations=1)
    median = found["median_step_seconds"]
    info = {
        "case": case,
        **found,
        "ratio xla / eager": round(median["xla"] / median["eager"], 3),
        "rounds": ROUNDS,
        "threads (eager)": THREADS,
        **source_revision(),
    }
    benchmark.extra_info.update(info)
    RESULTS[case] = info
    RESULTS_FILE.write_text(json.dumps(RESULTS, indent=2) + "\n")
    print("\n" + json.dumps(info))
