"""Activation memory and step time with activation checkpointing off / full / selective / budget.

Run: python -m pytest bench/test_ac_memory.py --benchmark-only -s

One deep, narrow Llama-style model (retarget.models.TinyLM, 16 blocks of width 64, sequences of
512 tokens) where activations dominate memory. Per configuration:
- memory: one untimed step under the dispatcher-level tracker (memory/measure.py):
  `activations` (bytes alive after forward: what backward needs, and the outputs) and `peak`
  (most bytes alive during forward and backward: recompute and gradients included), next to
  what checkpoint_blocks predicted;
- step time: forward + backward (gradients dropped), one step of every configuration per round,
  interleaved (the first configuration rotates each round) so that load from other jobs falls on
  all alike; per round, each step's wall and process CPU time over `off`'s in that round. The
  ratio reported is the median over rounds, with its min and max (the spread).
The summary prints the ratios and writes them to bench/ac_memory.json. Nothing here asserts on
timing.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Iterator
from datetime import date
from typing import Any

import pytest
import torch
from common import results_file, source_revision

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
RESULTS_FILE = results_file("ac_memory.json")

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


def _memory(name: str, compiled, inputs) -> dict[str, Any]:
    memory = measure_training_step(lambda: compiled(**inputs)["loss"])
    compiled.zero_grad(set_to_none=True)
    record = next((r for r in compiled.history if r.name == "checkpoint_blocks"), None)
    stats = record.stats if record else {}
    return {
        "target": CONFIGS[name],
        "activations": memory.activations,
        "peak": memory.peak,
        "predicted_activations": stats.get("activations_after"),
        "recompute_flops": stats.get("recompute_flops", 0),
        "plan": {k: stats.get(k, 0) for k in ("full", "selective", "repeats")},
    }


def _spread(ratios: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(ratios), 3),
        "min": round(min(ratios), 3),
        "max": round(max(ratios), 3),
    }


def test_ac_steps_interleaved(benchmark) -> None:
    inputs = batch()
    models = {name: compile_for(model(), CONFIGS[name], example_inputs=inputs) for name in CONFIGS}
    for name, compiled in models.items():
        RESULTS[name] = _memory(name, compiled, inputs)
    wall: dict[str, list[float]] = {name: [] for name in models}
    cpu: dict[str, list[float]] = {name: [] for name in models}
    names = list(models)

    def train_step(compiled) -> None:
        compiled(**inputs)["loss"].backward()
        compiled.zero_grad(set_to_none=True)

    for compiled in models.values():  # warm-up, untimed
        train_step(compiled)

    def one_round() -> None:
        start = len(wall["off"]) % len(names)
        for name in names[start:] + names[:start]:
            started, started_cpu = time.perf_counter(), time.process_time()
            train_step(models[name])
            wall[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - started_cpu)

    benchmark.group = "ac"
    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    for name in names:
        RESULTS[name].update(
            median_seconds=statistics.median(wall[name]),
            wall_ratio=_spread([a / b for a, b in zip(wall[name], wall["off"], strict=True)]),
            cpu_ratio=_spread([a / b for a, b in zip(cpu[name], cpu["off"], strict=True)]),
        )
    benchmark.extra_info.update({n: RESULTS[n]["wall_ratio"] for n in names})


@pytest.mark.bench_summary
def test_ac_summary() -> None:
    """Ratios to `off` from this run: printed and written, never asserted."""
    if "median_seconds" not in RESULTS.get("off", {}):
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
            "step_time_ratio": r["wall_ratio"]["median"],
            "step_time_ratio_spread": r["wall_ratio"],
            "cpu_time_ratio_spread": r["cpu_ratio"],
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
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "revision": source_revision(),
        "configs": rows,
    }
    if len(RESULTS) == len(CONFIGS):
        RESULTS_FILE.write_text(json.dumps(summary, indent=2) + "\n")
    print()
    print(f"load average {summary['load_average_1_5_15']}")
    print(
        f"{'config':<12}{'act MiB':>9}{'act':>7}{'peak MiB':>10}{'peak':>7}{'step s':>9}"
        f"{'wall (min-max)':>20}{'cpu (min-max)':>20}"
    )
    for name, row in rows.items():
        w, c = row["step_time_ratio_spread"], row["cpu_time_ratio_spread"]
        print(
            f"{name:<12}{row['activations_MiB']:>9.2f}{row['activations_ratio']:>9.2f}"
            f"{row['peak_MiB']:>9.2f}{row['peak_ratio']:>9.2f}{row['step_seconds']:>9.3f}"
            f"{w['median']:>8.2f} ({w['min']:.2f}-{w['max']:.2f})"
            f"{c['median']:>8.2f} ({c['min']:.2f}-{c['max']:.2f})"
        )
