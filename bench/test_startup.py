"""Start-up cost, in fresh processes: what a user waits for before training starts.

Run: python -m pytest bench/test_startup.py --benchmark-only -s

- `import retarget`, `retarget --help` and `import torch` (the floor both frameworks pay);
- prepare-to-first-step (bench/startup/first_step.py: a 4-layer Qwen2 at its default config,
  sizes shrunk; `accelerator.prepare` to the end of the first optimizer step) under Accelerate
  and under retarget, the script the same but for the Accelerator imported, uncompiled and with
  regional compile on a warm inductor cache (one unmeasured run of each fills the cache first),
  and uncompiled under bf16 (a graph rewrite: retarget captures the block there, while fp32
  captures nothing, capture="auto");
- capture's share: the seconds retarget's regions spent being captured, over that script's wall
  time from its first line.

Each round runs every arm once, in turn (ROUNDS rounds, interleaved), so load drifting during the
run falls on all; figures are medians. Results go to bench/startup.json. Nothing asserts on time.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from common import results_file

ROOT = Path(__file__).resolve().parent.parent
FIRST_STEP = ROOT / "bench" / "startup" / "first_step.py"
RESULTS_FILE = results_file("startup.json")
ROUNDS = int(os.environ.get("RETARGET_BENCH_ROUNDS", "9"))
IMPORTS = {
    "import torch": [sys.executable, "-c", "import torch"],
    "import retarget": [sys.executable, "-c", "import retarget"],
    "retarget --help": [sys.executable, "-m", "retarget", "--help"],
    "import accelerate": [sys.executable, "-c", "import accelerate"],
}


def _wall(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    return time.perf_counter() - start


#: Each arm's label and first_step.py's flags beyond --framework.
SETTINGS: dict[str, list[str]] = {
    "uncompiled": [],
    "uncompiled bf16": ["--mixed-precision", "bf16"],
    "compiled, warm cache": ["--compile"],
}


def _first_step(framework: str, flags: list[str], env: dict[str, str]) -> dict:
    command = [sys.executable, str(FIRST_STEP), "--framework", framework]
    done = subprocess.run(
        command + flags,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{framework} {flags} failed:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1])


def test_startup_retarget_vs_accelerate(benchmark) -> None:
    pytest.importorskip("accelerate")
    cache = tempfile.mkdtemp(prefix="retarget-bench-inductor-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
    arms = [(f, label) for label in SETTINGS for f in ("accelerate", "retarget")]
    for framework in ("accelerate", "retarget"):  # fill the inductor cache: warm from here on
        _first_step(framework, SETTINGS["compiled, warm cache"], env)
    walls: dict[str, list[float]] = {name: [] for name in IMPORTS}
    steps: dict[tuple[str, str], list[dict]] = {arm: [] for arm in arms}

    def one_round() -> None:
        for name, command in IMPORTS.items():
            walls[name].append(_wall(command))
        for framework, label in arms:
            steps[(framework, label)].append(_first_step(framework, SETTINGS[label], env))

    benchmark.group = "start-up"
    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=0)

    def median(arm: tuple[str, str], key: str) -> float:
        return statistics.median(run[key] for run in steps[arm])

    info: dict[str, object] = {"rounds": ROUNDS}
    info.update({f"{name} s": round(statistics.median(v), 3) for name, v in walls.items()})
    for label in SETTINGS:
        ours, theirs = ("retarget", label), ("accelerate", label)
        first = "prepare_to_first_step_s"
        info[f"prepare-to-first-step {label}: retarget s"] = round(median(ours, first), 3)
        info[f"prepare-to-first-step {label}: accelerate s"] = round(median(theirs, first), 3)
        info[f"prepare-to-first-step {label}: retarget / accelerate"] = round(
            median(ours, first) / median(theirs, first), 2
        )
        info[f"script wall {label}: retarget / accelerate"] = round(
            median(ours, "wall_s") / median(theirs, "wall_s"), 2
        )
        info[f"capture share of script wall time, {label}"] = round(
            median(ours, "capture_s") / median(ours, "wall_s"), 3
        )
    benchmark.extra_info.update(info)
    RESULTS_FILE.write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2))
