"""Empty init + checkpoint load against plain construction + load_state_dict.

Run: python -m pytest bench/test_big_load.py --benchmark-only -s

A Llama-style model of about 200 MB (16 layers, hidden 512, fp32, untied head) is saved once with
save_pretrained (one model.safetensors). Each round runs every variant, each in a fresh process
(bench/bigload/load.py), rotating which goes first: `plain` builds the model with its random
init and calls load_state_dict(load_file(...)); `empty_init` builds it under
retarget.init_empty_weights() and calls retarget.load_checkpoint_in_model; `accelerate` does the
same with Accelerate 1.15's functions (the peer); `empty_init_mmap` is ours with `mmap=True`
(weights left backed by the file's memory map, as Accelerate leaves them). Every weight is then
summed once (a weight backed by the file's memory map is read in only when used). Figures
(medians over ROUNDS rounds): time and peak-RSS-growth ratios of empty_init to plain and to
accelerate, of empty_init_mmap to accelerate, and each variant's peak growth over the bytes of
one copy of the weights (RSS with mapped file pages, and anonymous memory alone).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from common import llama, results_file

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "bigload" / "load.py"
RESULTS_FILE = results_file("big_load.json")
ROUNDS = int(os.environ.get("RETARGET_BENCH_ROUNDS", "9"))
VARIANTS = ("plain", "empty_init", "empty_init_mmap", "accelerate")
SHAPE = dict(layers=16, hidden=512, intermediate=1024, heads=8, vocab=8000)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("big_load")
    llama(**SHAPE).save_pretrained(folder)
    return folder


def run_once(variant: str, folder: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), variant, str(folder)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_empty_init_load_vs_plain(benchmark, checkpoint):
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    order = list(VARIANTS)

    def interleaved() -> None:
        for variant in order:
            runs[variant].append(run_once(variant, checkpoint))
        order.append(order.pop(0))  # each variant takes each place in turn

    benchmark.group = "big-model load"
    benchmark.pedantic(interleaved, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    assert len({r["checksum"] for v in VARIANTS for r in runs[v]}) == 1  # same weights loaded

    def median(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[variant])

    weights = runs["plain"][0]["weights_bytes"]
    info = {
        "rounds": ROUNDS,
        "weights_mb": round(weights / 1e6, 1),
        "seconds": {v: round(median(v, "seconds"), 3) for v in VARIANTS},
        **{
            f"time_ratio empty_init/{base}": round(
                median("empty_init", "seconds") / median(base, "seconds"), 3
            )
            for base in ("plain", "accelerate")
        },
        "time_ratio empty_init_mmap/accelerate": round(
            median("empty_init_mmap", "seconds") / median("accelerate", "seconds"), 3
        ),
        "peak_rss_ratio empty_init_mmap/accelerate": round(
            median("empty_init_mmap", "peak_rss_growth") / median("accelerate", "peak_rss_growth"),
            3,
        ),
        **{
            f"peak_rss_ratio empty_init/{base}": round(
                median("empty_init", "peak_rss_growth") / median(base, "peak_rss_growth"), 3
            )
            for base in ("plain", "accelerate")
        },
        "peak_rss_growth / weights": {
            v: round(median(v, "peak_rss_growth") / weights, 3) for v in VARIANTS
        },
        "peak_anon_growth / weights": {
            v: round(median(v, "peak_anon_growth") / weights, 3) for v in VARIANTS
        },
        "runs": runs,
    }
    benchmark.extra_info.update({k: v for k, v in info.items() if k != "runs"})
    RESULTS_FILE.write_text(json.dumps(info, indent=2) + "\n")
    print("\n" + json.dumps({k: v for k, v in info.items() if k != "runs"}))
