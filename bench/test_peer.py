"""retarget against Hugging Face Accelerate: the same script, the same target, 2 ranks.

Run: python -m pytest bench/test_peer.py --benchmark-only -s   (needs `accelerate` installed:
`pip install -c constraints.txt -e ".[bench]"`)

`bench/peer/train.py` is one training script whose only difference between the two runs is the
Accelerator it imports. For each target ("ddp+bf16", "fsdp") both frameworks run under
`torchrun --nproc_per_node 2`, alternating (accelerate, retarget, accelerate, ...) REPEATS times,
so drifting load falls on both. Figures: step time ratio retarget / Accelerate (geometric mean of
the per-pair ratios of median step times) and peak resident memory ratio (max over ranks). Each
run also says what the framework really ran: on a CPU-only machine Accelerate ignores an FSDP
plugin and runs DDP (docs/facts.md), so the "fsdp" pair compares our FSDP2 with its DDP; the table
says so rather than hiding it. Results go to bench/peer.json. Nothing asserts on timing.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from common import results_file

from tests.distributed import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "peer" / "train.py"
RESULTS_FILE = results_file("peer.json")
REPEATS = int(os.environ.get("RETARGET_BENCH_PEER_REPEATS", "3"))
TARGETS = ("ddp+bf16", "fsdp")
FRAMEWORKS = ("accelerate", "retarget")
RESULTS: dict[str, dict] = {}


def run_once(framework: str, target: str) -> dict:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(free_port()), str(SCRIPT),
        "--framework", framework, "--target", target,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        output = done.stdout[-2000:] + done.stderr[-4000:]
        raise RuntimeError(f"{framework} {target} failed:\n{output}")
    return json.loads(lines[-1])


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


@pytest.mark.parametrize("target", TARGETS)
def test_same_script_retarget_vs_accelerate(benchmark, target: str) -> None:
    pytest.importorskip("accelerate")
    runs: dict[str, list[dict]] = {f: [] for f in FRAMEWORKS}

    def interleaved() -> None:
        for framework in FRAMEWORKS:
            runs[framework].append(run_once(framework, target))

    benchmark.group = "peer: retarget vs accelerate, 2 ranks"
    benchmark.pedantic(interleaved, rounds=REPEATS, iterations=1, warmup_rounds=0)
    pairs = list(zip(runs["accelerate"], runs["retarget"], strict=True))
    time_ratio = _geomean([r["median_step_seconds"] / a["median_step_seconds"] for a, r in pairs])
    memory_ratio = _geomean([r["peak_rss_mib"] / a["peak_rss_mib"] for a, r in pairs])
    info = {
        "target": target,
        "repeats": REPEATS,
        "step_time_ratio retarget/accelerate": round(time_ratio, 3),
        "peak_memory_ratio retarget/accelerate": round(memory_ratio, 3),
        "accelerate ran": runs["accelerate"][-1]["ran"],
        "accelerate applied fsdp": runs["accelerate"][-1]["fsdp_applied"],
        "retarget ran": runs["retarget"][-1]["ran"],
        "retarget applied fsdp": runs["retarget"][-1]["fsdp_applied"],
        "runs": runs,
    }
    benchmark.extra_info.update({k: v for k, v in info.items() if k != "runs"})
    RESULTS[target] = info
    if len(RESULTS) == len(TARGETS):
        RESULTS_FILE.write_text(json.dumps(RESULTS, indent=2) + "\n")
    print("\n" + json.dumps({k: v for k, v in info.items() if k != "runs"}))
