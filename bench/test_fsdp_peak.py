"""Peak memory per rank under fsdp+bf16: retarget / by hand and retarget / Accelerate (issue 18.8).

Run: python -m pytest bench/test_fsdp_peak.py --benchmark-only -s   (needs `accelerate`;
RETARGET_BENCH_PEAK_REPEATS rounds, default 3, about 2 minutes each on 2 loaded cores)

bench/fsdp_memory.py holds the three arms (the same model, seed, batch, optimizer and steps):
FSDP2 applied by hand, retarget's compile_for, Accelerate's Accelerator. Each run is 2 fresh
gloo ranks; the arms alternate in a rotated order every round. Figures (MB = 10^6 bytes),
medians over rounds for rank 0, rank 1 and both pooled: the peak resident set (VmHWM), the peak
anonymous memory (RssAnon) and the peak heap in use (malloc's, `mallinfo2`), absolute and above
the process's own memory after its imports, the steps' own heap peak and the peaks of the
prepare phase (while the whole model is held); ratios retarget / by hand and retarget /
Accelerate. Accelerate on CPU-only torch runs DDP where FSDP was asked for; the JSON says what
it ran. Results go to bench/fsdp_peak.json; bench/README.md's "FSDP peak memory" section is
written from it by hand (the suite is not in `retarget bench`'s list, retarget/cli/bench.py).
Nothing asserts on the ratios; the test fails if retarget or by hand did not apply FSDP2, or if
their losses differ beyond bf16 rounding.
"""

from __future__ import annotations

import json
import os

import pytest
from common import results_file, source_revision
from fsdp_memory import ARMS, figures, measure

RESULTS_FILE = results_file("fsdp_peak.json")
REPEATS = int(os.environ.get("RETARGET_BENCH_PEAK_REPEATS", "3"))


def test_fsdp_peak_memory_against_by_hand_and_accelerate(benchmark) -> None:
    pytest.importorskip("accelerate")
    runs: dict[str, list[list[dict]]] = {}

    def rounds() -> None:
        runs.update(measure(REPEATS, ARMS))

    benchmark.group = "fsdp+bf16 peak memory per rank, 2 ranks"
    benchmark.pedantic(rounds, rounds=1, iterations=1, warmup_rounds=0)
    result = {
        **source_revision(),
        "repeats": REPEATS,
        "figures": figures(runs),
        "ran": {arm: runs[arm][-1][0]["ran"] for arm in ARMS},
        "fsdp applied": {arm: runs[arm][-1][0]["fsdp_applied"] for arm in ARMS},
        "peak phase": {
            arm: [run[r]["peak_phase"] for run in runs[arm] for r in (0, 1)] for arm in ARMS
        },  # fmt: skip
        "runs": runs,
    }
    RESULTS_FILE.write_text(json.dumps(result, indent=1) + "\n")
    benchmark.extra_info.update({k: v for k, v in result.items() if k != "runs"})
    print("\n" + json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    assert result["fsdp applied"]["retarget"] and result["fsdp applied"]["by_hand"], result["ran"]
    losses = {arm: [run[r]["loss"] for run in runs[arm] for r in (0, 1)] for arm in ARMS}
    # Same model, batch and steps: by hand and retarget train alike (within bf16 rounding).
    gaps = [abs(a - b) for a, b in zip(losses["retarget"], losses["by_hand"], strict=True)]
    assert max(gaps) < 0.01, losses
