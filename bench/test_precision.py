"""Training-step time of a tiny-but-wide Llama in fp32, bf16 and fp8 (native), as ratios.

Run: python -m pytest bench/test_precision.py --benchmark-only -s   (see bench/README.md)

One step = forward, loss, backward, AdamW step, zero_grad, on the model compiled by
`compile_for(model, target)`. The three targets are timed in one session, each round
interleaving them (fp32, bf16, fp8, fp32, ...) so that load from other jobs falls on all three
alike; the ratios are of medians over the rounds. On this CPU bf16 matmuls have native support
(AVX512-BF16) while fp8 `_scaled_mm` is emulated, so fp8 is expected to be slower than bf16 here:
the CPU figures show the overhead of the recipe (amax, scale, cast), not FP8 speed. Nothing here
asserts on timing.
"""

from __future__ import annotations

import json
import os

from common import interleaved_medians, llama, results_file, stepper, token_batch

from retarget.driver.compile import compile_for

TARGETS = ("single", "bf16", "fp8[backend=native]")
ROUNDS = int(os.environ.get("RETARGET_BENCH_ROUNDS", "5"))
THREADS = int(os.environ.get("RETARGET_BENCH_THREADS", "1"))
HIDDEN, INTERMEDIATE, LAYERS, HEADS, VOCAB = 1024, 2816, 2, 16, 1024
BATCH, SEQ = 2, 64
RESULTS_FILE = results_file("precision.json")


def trainer(target: str):
    inputs = token_batch(VOCAB, BATCH, SEQ)
    model = llama(
        layers=LAYERS, hidden=HIDDEN, intermediate=INTERMEDIATE, heads=HEADS, positions=SEQ
    )
    one_step = stepper(compile_for(model, target, example_inputs=inputs), inputs)
    one_step()  # first call: lazy state (optimizer moments, fp8 amax history)
    return one_step


def test_step_time_by_precision(benchmark) -> None:
    steps = {target: trainer(target) for target in TARGETS}
    benchmark.group = "precision step time"
    median = interleaved_medians(benchmark, steps, rounds=ROUNDS, threads=THREADS)
    ratios = {f"{t} / single": round(median[t] / median["single"], 2) for t in TARGETS[1:]}
    info = {
        "model": f"Llama h{HIDDEN} i{INTERMEDIATE} {LAYERS} layers, batch {BATCH} seq {SEQ}",
        "threads": THREADS,
        "median_step_seconds": {t: round(v, 4) for t, v in median.items()},
        "ratios": ratios,
    }
    benchmark.extra_info.update(info)
    RESULTS_FILE.write_text(json.dumps(info, indent=2) + "\n")
    print("\n" + json.dumps(info, indent=2))
