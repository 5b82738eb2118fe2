"""Activation memory and step time with activation checkpointing off / full / selective / budget.

Run: python -m pytest bench/test_ac_memory.py --benchmark-only -s

One deep, narrow Llama-style model (retarget.models.TinyLM, 16 blocks of width 64, sequences of
512 tokens) where activations dominate memory. Per configuration:
- step time: `benchmark.pedantic` times forward + backward (gradients dropped between rounds);
- memory: one separate, untimed step under the dispatcher-level tracker (memory/measure.py):
  `activations` (bytes alive after forward: what backward needs, and the outputs) and `peak`
  (most bytes alive during forward and backward: recompute and gradients included), next to
  what checkpoint_blocks predicted.
The summary test prints every configuration as ratios to `off` from the same run and writes
them to bench/ac_memory.json. Nothing here asserts on timing.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Iterator
from datetime import date
from pathlib import Path
from typing import Any

import pytest
import torch

from retarget.driver.compile import compile_for
from retarget.models import TinyConfig, synthetic_batch, tiny_lm
from retarget.passes.memory.measure import measure_training_step

CONFIGS = {
    "off": "single",
    "full": "ac",
    "selective": "ac[policy=selective]",
    "budget=0.5": "ac[budget=0.5]",
}
SHAPE = dict(hidden=64, heads=4, layers=16, max_seq=512, vocab_size=256)
BATCH, SEQ = 4, 512
ROUNDS = int(os.environ.get("RETARGET_BENCH_ROUNDS", "5"))
THREADS = int(os.environ.get("RETARGET_BENCH_THREADS", "1"))
RESULTS_FILE = Path(__file__).with_name("ac_memory.json")

#: config name -> what its benchmark measured; read by the summary.
RESULTS: dict[str, dict[str, Any]] = {}


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny_lm(**SHAPE)


def batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return synthetic_batch(TinyConfig(**SHAPE), BATCH, SEQ, generator=generator)


@pytest.fixture(scope="session", autouse=True)
def bench_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ac_step(benchmark, name: str) -> None:
    inputs = batch()
    compiled = compile_for(model(), CONFIGS[name], example_inputs=inputs)

    def train_step() -> None:
        compiled(**inputs)["loss"].backward()
        compiled.zero_grad(set_to_none=True)

    memory = measure_training_step(lambda: compiled(**inputs)["loss"])
    compiled.zero_grad(set_to_none=True)
    record = next((r for r in compiled.history if r.name == "checkpoint_blocks"), None)
    stats = record.stats if record else {}
    info = {
        "target": CONFIGS[name],
        "activations": memory.activations,
        "peak": memory.peak,
        "predicted_activations": stats.get("activations_after"),
        "recompute_flops": stats.get("recompute_flops", 0),
        "plan": {k: stats.get(k, 0) for k in ("full", "selective", "repeats")},
    }
    benchmark.group = "ac"
    benchmark.extra_info.update(info)
    benchmark.pedantic(train_step, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    timings = getattr(benchmark.stats, "stats", None)  # None under --benchmark-disable
    if timings is not None:
        RESULTS[name] = {**info, "median_seconds": timings.median}


@pytest.mark.bench_summary
def test_ac_summary() -> None:
    """Ratios to `off` from this run: printed and written, never asserted."""
    if "off" not in RESULTS:
        pytest.skip("no benchmark timings in this session (run the whole file)")
    off = RESULTS["off"]
    rows = {}
    for name, r in RESULTS.items():
        rows[name] = {
            "activations_MiB": round(r["activations"] / 2**20, 2),
            "activations_ratio": round(r["activations"] / off["activations"], 3),
            "peak_MiB": round(r["peak"] / 2**20, 2),
            "peak_ratio": round(r["peak"] / off["peak"], 3),
            "step_seconds": round(r["median_seconds"], 4),
            "step_time_ratio": round(r["median_seconds"] / off["median_seconds"], 3),
            "predicted_activations_MiB": (
                round(r["predicted_activations"] / 2**20, 2) if r["predicted_activations"] else None
            ),
            "plan": r["plan"],
        }
    summary = {
        "date": date.today().isoformat(),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        "model": f"TinyLM {SHAPE}, batch {BATCH}, seq {SEQ}",
        "rounds": ROUNDS,
        "configs": rows,
    }
    if len(RESULTS) == len(CONFIGS):
        RESULTS_FILE.write_text(json.dumps(summary, indent=2) + "\n")
    print()
    print(
        f"{'config':<12}{'act MiB':>9}{'act':>7}{'peak MiB':>10}{'peak':>7}{'step s':>9}{'time':>7}"
    )
    for name, row in rows.items():
        print(
            f"{name:<12}{row['activations_MiB']:>9.2f}{row['activations_ratio']:>9.2f}"
            f"{row['peak_MiB']:>9.2f}{row['peak_ratio']:>9.2f}"
            f"{row['step_seconds']:>9.3f}{row['step_time_ratio']:>9.2f}"
        )
