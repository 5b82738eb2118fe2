"""Pipeline parallelism (`pp`): how evenly the planner cuts stages, and step time per schedule.

Run: RETARGET_BENCH_ROUNDS=9 python -m pytest bench/test_pipeline_parallel.py --benchmark-only -s

- Imbalance (max stage FLOPs / mean stage FLOPs) of split_stages' plan for 4 stages, at 8, 12 and
  32 layers: (a) measured, compile_for of a Llama (hidden 512, 8 heads, vocab 1024) whose FLOPs
  annotate_shapes counts on a real forward; (b) the same planner (`balance`) on the FLOPs of
  Llama-2-7B's shapes (hidden 4096, intermediate 11008, vocab 32000, sequence 4096), where the
  head weighs 0.56 of a block. Goal: <= 1.10.
- Step time per schedule on 2 gloo ranks (2 processes for the 2 cores; informational on this
  2-core CPU): one `runtime.forward_backward` + SGD step of an 8-layer Llama with 8
  microbatches, interleaved rounds after a barrier, rank 0's seconds, against one process's
  step on the same batch, for gpipe, 1f1b, interleaved-1f1b and zero-bubble (2 stages per
  rank); the ideal is (1 / p) / (1 - bubble), bubble = (p-1)/(K m + p-1) with K stages per
  rank (for zero-bubble an upper bound).
Nothing here asserts on timing.
"""

from __future__ import annotations

import json
import os
import statistics

import pytest
import torch
from common import barrier_rounds, llama, results_file, source_revision

from retarget.passes.shard.split_stages import balance
from tests.distributed import run_ranks

ROUNDS = int(os.environ.get("RETARGET_BENCH_ROUNDS", "3"))
LAYERS = (8, 12, 32)
STAGES = 4
RESULTS_FILE = results_file("pipeline_parallel.json")
RESULTS: dict[str, dict] = {}
#: Schedules timed; the looped two run 2 stages of 2 blocks per rank.
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


def _imbalance(costs: list[int], tail: int, stages: int) -> float:
    runs = balance(costs, tail, stages)
    totals = [sum(costs[a:b]) for a, b in runs]
    totals[-1] += tail
    return max(totals) / (sum(totals) / len(totals))


def _llama_7b_flops(seq: int = 4096) -> tuple[int, int]:
    """Forward FLOPs per token of one Llama-2-7B block (matmuls and attention) and its head."""
    hidden, inter, vocab = 4096, 11008, 32000
    block = 2 * (4 * hidden * hidden + 3 * hidden * inter) + 2 * 2 * seq * hidden
    return block, 2 * hidden * vocab


def test_stage_plan_imbalance(benchmark) -> None:
    from retarget.driver.compile import compile_for

    measured, shaped = {}, {}

    def plan_all() -> None:
        for layers in LAYERS:
            model = llama(layers=layers, hidden=512, intermediate=1376, heads=8)
            ids = torch.randint(0, 1024, (8, 64), generator=torch.Generator().manual_seed(0))
            compiled = compile_for(
                model,
                f"pp[size={STAGES}]",
                example_inputs={"input_ids": ids, "labels": ids},
                world_size=STAGES,
            )
            measured[layers] = round(compiled.program.plan.pp.imbalance, 3)
            block, head = _llama_7b_flops()
            shaped[layers] = round(_imbalance([block] * layers, head, STAGES), 3)

    benchmark.group = "pipeline parallelism"
    benchmark.pedantic(plan_all, rounds=1, iterations=1)
    block, head = _llama_7b_flops()
    info = {
        "stages": STAGES,
        "imbalance, measured (h512, vocab 1024)": measured,
        "imbalance, Llama-2-7B shapes": shaped,
        "head / block FLOPs, Llama-2-7B shapes": round(head / block, 3),
        **source_revision(),
    }
    benchmark.extra_info.update(info)
    RESULTS["plan"] = info
    print("\n" + json.dumps(info))


def _times(rank: int, world: int, rounds: int) -> dict[str, list[float]]:
    from retarget.driver.compile import compile_for

    ids = torch.randint(0, 1024, (8, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    steps = {}
    reference = llama(layers=8, hidden=256, intermediate=688, heads=4)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-4)

    def one_process() -> None:
        reference(**batch).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

    steps["one process"] = one_process
    for schedule in SCHEDULES:
        model = llama(layers=8, hidden=256, intermediate=688, heads=4)
        compiled = compile_for(
            model, f"pp[schedule={schedule},microbatches=8]", example_inputs=batch
        )
        optimizer = torch.optim.SGD(compiled.parameters(), lr=1e-4)

        def one_step(compiled=compiled, optimizer=optimizer) -> None:
            compiled.runtime.forward_backward(batch)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        steps[schedule] = one_step
    return barrier_rounds(steps, rounds=rounds, warmup=1)


def test_schedule_step_time(benchmark) -> None:
    seconds: dict[str, list[float]] = {}
    benchmark.group = "pipeline parallelism"
    benchmark.pedantic(
        lambda: seconds.update(run_ranks(_times, 2, ROUNDS, timeout=1800)[0]), rounds=1
    )
    median = {k: statistics.median(v) for k, v in seconds.items()}
    # (p-1)/(K m + p-1); for zero-bubble an upper bound
    bubbles = {"gpipe": 1 / 9, "1f1b": 1 / 9, "interleaved-1f1b": 1 / 17, "zero-bubble": 1 / 17}
    info = {
        "ranks": 2,
        "microbatches": 8,
        "rounds": ROUNDS,
        "median_step_seconds": {k: round(v, 4) for k, v in median.items()},
        "step / one process": {k: round(median[k] / median["one process"], 3) for k in SCHEDULES},
        "ideal step / one process": {k: round(0.5 / (1 - b), 3) for k, b in bubbles.items()},
        "analytic bubble": {k: round(b, 3) for k, b in bubbles.items()},
    }
    benchmark.extra_info.update(info)
    RESULTS["time"] = info
    print("\n" + json.dumps(info))


@pytest.mark.bench_summary
def test_pp_summary() -> None:
    """Write the figures to bench/pipeline_parallel.json (a full run only)."""
    if set(RESULTS) != {"plan", "time"}:
        pytest.skip("not every case ran (partial run or --benchmark-disable)")
    RESULTS_FILE.write_text(json.dumps(RESULTS, indent=2) + "\n")
