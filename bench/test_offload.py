"""Disk offload for generation within a memory budget: ours vs the model in memory vs Accelerate.

Run: python -m pytest bench/test_offload.py --benchmark-only -s

The ~200 MB Llama of test_big_load.py (16 layers, hidden 512) is saved once. Each round runs every
variant of bench/bigload/offload.py, each in a fresh process, rotating which goes first:
`memory` (the model held in memory: reference tokens and time per token), `ours` and
`ours_prefetch` (init_empty_weights + load_checkpoint_and_dispatch, device_map="auto",
max_memory={"cpu": "70MB"}, prefetch 0 / 1), `accelerate` (Accelerate 1.15's same two calls on
the same files), and `cold0` / `cold2` (ours, a 384-token forward after the offloaded files' pages
were dropped from the page cache, prefetch 0 / 2, beside the same forward with them cached).
Figures (medians over ROUNDS rounds): RssAnon growth against the budget + the largest block,
time per token and peak RSS against Accelerate, and the share of the cold-load time prefetch
hides: (cold0 - cold2) / (cold0 - warm).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from common import llama, results_file

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "bigload" / "offload.py"
RESULTS_FILE = results_file("offload.json")
ROUNDS = int(os.environ.get("RETARGET_BENCH_ROUNDS", "9"))
VARIANTS = ("memory", "ours", "ours_prefetch", "accelerate", "cold0", "cold2")
SHAPE = dict(layers=16, hidden=512, intermediate=1024, heads=8, vocab=8000)
BUDGET = 70 * 10**6
GENERATING = ("memory", "ours", "ours_prefetch", "accelerate")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("offload")
    llama(**SHAPE).save_pretrained(folder)
    return folder


def run_once(variant: str, folder: Path) -> dict:
    work = folder.parent / f"work-{variant}"
    shutil.rmtree(work, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(SCRIPT.parent)])}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), variant, str(folder), str(work)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def largest_block_bytes() -> int:
    model = llama(**SHAPE)
    layer = model.model.layers[0]
    blocks = [layer, model.lm_head]
    return max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks)


def test_disk_offload_generate(benchmark, checkpoint):
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    order = list(VARIANTS)

    def interleaved() -> None:
        for variant in order:
            runs[variant].append(run_once(variant, checkpoint))
        order.append(order.pop(0))

    benchmark.group = "disk offload"
    benchmark.pedantic(interleaved, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    tokens = {json.dumps(r["tokens"]) for v in GENERATING for r in runs[v]}
    assert len(tokens) == 1, "an offloaded model generated other tokens than the one in memory"

    def median(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[variant])

    largest = largest_block_bytes()
    warm = statistics.median([*(r["warm_seconds"] for r in runs["cold0"])])
    load = median("cold0", "cold_seconds") - warm
    hidden = (median("cold0", "cold_seconds") - median("cold2", "cold_seconds")) / load
    info = {
        "rounds": ROUNDS,
        "budget_mb": BUDGET / 1e6,
        "largest_block_mb": round(largest / 1e6, 1),
        "anon_growth_mb": {v: round(median(v, "peak_anon_growth") / 1e6, 1) for v in GENERATING},
        "anon_growth ours / (budget + largest block)": round(
            median("ours", "peak_anon_growth") / (BUDGET + largest), 3
        ),
        "seconds_per_token": {v: round(median(v, "seconds_per_token"), 4) for v in GENERATING},
        **{
            f"{figure} {v}/accelerate": round(median(v, key) / median("accelerate", key), 3)
            for v in ("ours", "ours_prefetch")
            for figure, key in (
                ("time_per_token", "seconds_per_token"),
                ("peak_rss", "peak_rss_growth"),
            )
        },
        "time_per_token ours/memory": round(
            median("ours", "seconds_per_token") / median("memory", "seconds_per_token"), 3
        ),
        "cold forward seconds (warm, prefetch 0, prefetch 2)": [
            round(warm, 3),
            round(median("cold0", "cold_seconds"), 3),
            round(median("cold2", "cold_seconds"), 3),
        ],
        "load time hidden by prefetch": round(hidden, 3),
        "runs": runs,
    }
    benchmark.extra_info.update({k: v for k, v in info.items() if k != "runs"})
    RESULTS_FILE.write_text(json.dumps(info, indent=2) + "\n")
    print("\n" + json.dumps({k: v for k, v in info.items() if k != "runs"}))
