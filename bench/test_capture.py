"""Capture + pipeline time of `compile_for` on a Llama-style model, by depth and capture mode.

Run: python -m pytest bench/ --benchmark-only   (see bench/README.md)

Each benchmark times the whole `compile_for(model, "single", example_inputs=..., capture=mode)`
call on one model built beforehand (compile_for never edits the model, so every round compiles
the same one) and stores in `benchmark.extra_info` the median per-pass seconds of its rounds,
the regions' frontends and the seconds spent inside the region captures themselves. The last
test prints the ratios time(32 layers) / time(2 layers) per mode and writes every figure to
bench/results.json. Nothing here asserts on timing.
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

import common
import pytest
import torch
import transformers
from common import results_file, source_revision

from retarget.driver.compile import compile_for

LAYERS = (2, 8, 32)
MODES = ("regions", "whole")
ROUNDS = int(os.environ.get("RETARGET_BENCH_ROUNDS", "3"))
#: torch intra-op threads while benchmarking. 1 by default: on a small machine shared with other
#: jobs, 2 OpenMP threads per process oversubscribe the cores and an eager forward of the
#: 32-layer model swings from 0.17 s to 4 s; with 1 thread it stays near 0.25 s.
THREADS = int(os.environ.get("RETARGET_BENCH_THREADS", "1"))
BATCH, SEQ, VOCAB = 2, 32, 1024
RESULTS_FILE = results_file("results.json")
#: Ratio time(32 layers) / time(2 layers) that region reuse aims for (the issue's goal).
GOAL_RATIO = 1.5

#: (layers, mode) -> what one benchmark measured; filled by the benchmarks, read by the summary.
RESULTS: dict[tuple[int, str], dict[str, Any]] = {}


def llama(layers: int, hidden: int = 512, intermediate: int = 1376, heads: int = 8):
    return common.llama(
        layers=layers, hidden=hidden, intermediate=intermediate, heads=heads, vocab=VOCAB
    )


def example_inputs() -> dict[str, torch.Tensor]:
    return common.token_batch(VOCAB, BATCH, SEQ)


@pytest.fixture(scope="session", autouse=True)
def bench_session() -> Iterator[None]:
    """Set the thread count, then pay torch.export's first-call cost (about 2 s) up front."""
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    tiny = llama(2, hidden=64, intermediate=128, heads=4)
    for mode in MODES:
        compile_for(tiny, example_inputs=example_inputs(), capture=mode)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layers", LAYERS)
def test_compile_for(benchmark, layers: int, mode: str) -> None:
    model = llama(layers)
    inputs = example_inputs()
    reports: list[dict[str, Any]] = []

    def compile_once() -> None:
        cpu = time.process_time()
        compiled = compile_for(model, "single", example_inputs=inputs, capture=mode)
        cpu = time.process_time() - cpu
        report = compiled.report.to_dict()
        reports.append({"passes": report["passes"], "regions": report["regions"], "cpu": cpu})

    benchmark.group = f"capture={mode}"
    benchmark.pedantic(compile_once, rounds=ROUNDS, iterations=1, warmup_rounds=0)

    timed = reports[-ROUNDS:]
    passes = {
        record["name"]: round(statistics.median(r["passes"][i]["seconds"] for r in timed), 4)
        for i, record in enumerate(timed[0]["passes"])
    }
    regions = timed[-1]["regions"]
    info = {
        "layers": layers,
        "mode": mode,
        "pass_seconds": passes,
        "frontends": {r["name"]: r["frontend"] for r in regions},
        "repeats": {r["name"]: r["repeats"] for r in regions},
        "region_capture_seconds": round(
            statistics.median(sum(x["capture_seconds"] for x in r["regions"]) for r in timed), 4
        ),
        "cpu_seconds": round(statistics.median(r["cpu"] for r in timed), 4),
    }
    benchmark.extra_info.update(info)
    assert all(r["frontend"] != "eager" for r in regions), f"a region stayed eager: {regions}"
    stats = getattr(benchmark.stats, "stats", None)  # None under --benchmark-disable
    if stats is not None:
        info["median_seconds"] = round(stats.median, 4)
        info["round_seconds"] = [round(s, 4) for s in stats.data]
        RESULTS[(layers, mode)] = info


@pytest.mark.bench_summary
def test_depth_scaling_summary() -> None:
    """Ratios time(32 layers) / time(2 layers) per mode: printed and written, never asserted."""
    low, high = min(LAYERS), max(LAYERS)
    modes = [m for m in MODES if (low, m) in RESULTS and (high, m) in RESULTS]
    if not modes:
        pytest.skip("no benchmark timings in this session (run the whole bench/ directory)")

    def ratio(mode: str, key: str) -> float:
        return round(RESULTS[(high, mode)][key] / RESULTS[(low, mode)][key], 2)

    ratios = {f"{mode} {high}/{low} layers": ratio(mode, "median_seconds") for mode in modes}
    cpu_ratios = {f"{mode} {high}/{low} layers": ratio(mode, "cpu_seconds") for mode in modes}
    summary = {
        "date": date.today().isoformat(),
        "machine": {
            "platform": platform.platform(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "transformers": transformers.__version__,
        },
        "source": source_revision(),
        "model": f"LlamaForCausalLM h512 i1376 8 heads vocab {VOCAB}, batch {BATCH} seq {SEQ}",
        "rounds": ROUNDS,
        "goal": f"capture=regions: time({high} layers) <= {GOAL_RATIO} x time({low} layers)",
        "ratios": ratios,
        "cpu_time_ratios": cpu_ratios,
        "goal_met": "regions" in modes and ratio("regions", "median_seconds") <= GOAL_RATIO,
        "cases": [RESULTS[key] for key in sorted(RESULTS)],
    }
    complete = len(RESULTS) == len(LAYERS) * len(MODES)
    if complete:  # a partial run (-k) does not overwrite the figures of a full one
        RESULTS_FILE.write_text(json.dumps(summary, indent=2) + "\n")
    print()
    for key in sorted(RESULTS):
        r = RESULTS[key]
        line = f"{r['mode']:>8} {r['layers']:>3} layers: {r['median_seconds']:.3f} s"
        print(f"{line} (cpu {r['cpu_seconds']:.3f} s)  {r['pass_seconds']}")
    for name, value in ratios.items():
        print(f"ratio {name}: {value:.2f} (cpu time: {cpu_ratios[name]:.2f})")
    where = f"written to {RESULTS_FILE}" if complete else "partial run, results.json not written"
    print(f"goal ({summary['goal']}) met: {summary['goal_met']}; {where}")
