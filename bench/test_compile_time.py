"""Cold compile times of the `compile` part: the first step against the same regional
torch.compile by hand and Accelerate's, and how compile time grows with depth.

Run: python -m pytest bench/test_compile_time.py --benchmark-only -s   (see bench/README.md)

Every measurement is a fresh process (`python bench/compile_arms.py --arm A --layers N`: no
dynamo state, nothing compiled in memory) with its own empty TORCHINDUCTOR_CACHE_DIR, so every
compile is cold: inductor's FX-graph and kernel caches start empty. The process times, from the
model's construction, its first training step (capture, compile, first forward and backward:
what a user waits for), then 2 more steps; "compile seconds" is the first step minus the median
later step. Each round runs every measurement once, in an order rotated from round to round;
figures are ratios of medians over `RETARGET_BENCH_COMPILE_ROUNDS` (default 2: a round is
minutes) rounds, the whole-model compile over `RETARGET_BENCH_WHOLE_ROUNDS` (default 1).
Nothing here asserts on timing.

| measurement      | arm (compile_arms.py)                 | layers |
|---|---|---|
| first step       | compile, by_hand, accelerate, retarget_accel | 4 |
| depth            | compile (scope=regions)               | 2, 32  |
| whole model      | whole (`model.compile()`)             | 32     |
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from common import results_file, source_revision
from compile_arms import conditions

ROUNDS = int(os.environ.get("RETARGET_BENCH_COMPILE_ROUNDS", "2"))
#: The whole 32-layer model compiles for minutes (7 on a loaded 2-core machine): fewer rounds.
WHOLE_ROUNDS = int(os.environ.get("RETARGET_BENCH_WHOLE_ROUNDS", "1"))
WHOLE = ("whole", 32)
THREADS = int(os.environ.get("RETARGET_BENCH_THREADS", "1"))
SCRIPT = Path(__file__).with_name("compile_arms.py")
ROOT = SCRIPT.parent.parent
RESULTS_FILE = results_file("compile_time.json")
LATER_STEPS = 2

#: (arm, layers) measured each round.
MEASUREMENTS = (
    ("compile", 4),
    ("by_hand", 4),
    ("accelerate", 4),
    ("retarget_accel", 4),
    ("compile", 2),
    ("compile", 32),
    WHOLE,
)
#: figure -> (what is compared: "first" step or "compile" seconds, numerator, denominator)
RATIOS = {
    "first step, 4 layers: compile / by hand": ("first", ("compile", 4), ("by_hand", 4)),
    "first step, 4 layers: retarget Accelerator / Accelerate": (
        "first",
        ("retarget_accel", 4),
        ("accelerate", 4),
    ),
    "compile seconds: regions 32 / 2 layers": ("compile", ("compile", 32), ("compile", 2)),
    "compile seconds: regions 32 layers / whole model 32 layers": (
        "compile",
        ("compile", 32),
        ("whole", 32),
    ),
}


def measure(arm: str, layers: int) -> dict:
    """One cold first step (and LATER_STEPS steps) of `arm` in a fresh process."""
    with tempfile.TemporaryDirectory(prefix="retarget-inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
        command = [sys.executable, str(SCRIPT), "--arm", arm, "--layers", str(layers)]
        command += ["--steps", str(LATER_STEPS), "--threads", str(THREADS)]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{arm} at {layers} layers failed:\n{done.stderr[-4000:]}")
    result = json.loads(lines[-1])
    result["compile_seconds"] = result["first_step_seconds"] - result["step_seconds"]
    return result


def test_compile_times(benchmark) -> None:
    pytest.importorskip("accelerate")
    runs: dict[tuple[str, int], list[dict]] = {m: [] for m in MEASUREMENTS}
    rounds_done = []

    def one_round() -> None:
        shift = len(rounds_done) % len(MEASUREMENTS)
        for m in MEASUREMENTS[shift:] + MEASUREMENTS[:shift]:
            if m != WHOLE or len(runs[m]) < WHOLE_ROUNDS:
                runs[m].append(measure(*m))
        rounds_done.append(shift)

    benchmark.group = "compile: cold compile times, fresh processes"
    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    median = {
        m: {
            "first": statistics.median(r["first_step_seconds"] for r in runs[m]),
            "compile": statistics.median(r["compile_seconds"] for r in runs[m]),
            "step": statistics.median(r["step_seconds"] for r in runs[m]),
        }
        for m in MEASUREMENTS
    }
    info = {
        "rounds": ROUNDS,
        "whole_model_rounds": WHOLE_ROUNDS,
        "threads": THREADS,
        "median_seconds": {
            f"{a}@{n}": {k: round(v, 3) for k, v in s.items()} for (a, n), s in median.items()
        },
        "ratios": {
            name: round(median[a][what] / median[b][what], 3)
            for name, (what, a, b) in RATIOS.items()
        },
        "runs": {f"{a}@{n}": r for (a, n), r in runs.items()},
        **source_revision(),
        **conditions(),
    }
    benchmark.extra_info.update({k: v for k, v in info.items() if k != "runs"})
    RESULTS_FILE.write_text(json.dumps(info, indent=2) + "\n")
    print("\n" + json.dumps({k: v for k, v in info.items() if k != "runs"}))
