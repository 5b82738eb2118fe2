"""Pipeline parallelism (`pp`): how evenly the planner cuts stages, and step time per schedule.

Run: RETARGET_BENCH_ROUNDS=9 python -m pytest bench/test_pipeline_parallel.py --benchmark-only -s

- Imbalance (max stage FLOPs / mean stage FLOPs) of split_stages' plan for 4 stages, at 8, 12 and
  32 layers, with cuts=auto (inside blocks when whole blocks balance worse than 1.10) and
  cuts=blocks: compile_for of (a) a Llama with hidden 512, 8 heads, vocab 1024, and (b) Llama-2-7B
  with every size / 32 (LLAMA_7B_RATIOS: its FLOPs' proportions, the head 0.56 of a block),
  whose FLOPs annotate_shapes counts on a real forward. Goal: <= 1.10.
- Step time per schedule on 2 and 4 gloo ranks (informational: 2 processes fill this 2-core
  CPU, 4 oversubscribe it): one `runtime.forward_backward` + SGD step of an 8-layer Llama with
  8 microbatches, interleaved rounds after a barrier, rank 0's seconds, against one process's
  step on the same batch, for gpipe, 1f1b, interleaved-1f1b and zero-bubble (2 stages per
  rank); the ideal is (1 / p) / (1 - bubble), bubble = (p-1)/(K m + p-1) with K stages per
  rank (for zero-bubble an upper bound), on p cores; on p ranks sharing c < p cores no step
  can beat 1 / c. The one-process step runs on rank 0 alone (the others wait), with the cores
  to itself.
Nothing here asserts on timing.
"""

from __future__ import annotations

import json
import os
import statistics

import pytest
import torch
from common import barrier_rounds, llama, results_file, source_revision

from tests.distributed import run_ranks

ROUNDS = int(os.environ.get("RETARGET_BENCH_ROUNDS", "3"))
LAYERS = (8, 12, 32)
STAGES = 4
RESULTS_FILE = results_file("pipeline_parallel.json")
RESULTS: dict[str, dict] = {}
#: Schedules timed; the looped two run 2 stages of 2 blocks per rank.
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


#: Llama-2-7B with every size / 32 (hidden 4096, intermediate 11008, vocab 32000, sequence 4096;
#: one head of 128 as 7B's head_dim): every FLOPs term of a block and of the head shrinks by
#: 32 x 32, so the planner sees 7B's proportions (the head weighs 0.56 of a block).
LLAMA_7B_RATIOS = {"hidden": 128, "intermediate": 344, "heads": 1, "vocab": 1000}
SEQ_7B_RATIOS = 128


def _plan(layers: int, cuts: str, seq: int, **sizes: int) -> float:
    from retarget.driver.compile import compile_for

    model = llama(layers=layers, positions=seq, **sizes)
    ids = torch.randint(0, sizes["vocab"], (8, seq), generator=torch.Generator().manual_seed(0))
    compiled = compile_for(
        model,
        f"pp[size={STAGES},cuts={cuts}]",
        example_inputs={"input_ids": ids, "labels": ids},
        world_size=STAGES,
    )
    return round(compiled.program.plan.pp.imbalance, 3)


def test_stage_plan_imbalance(benchmark) -> None:
    measured: dict[str, dict[int, float]] = {}

    def plan_all() -> None:
        for cuts in ("auto", "blocks"):
            for layers in LAYERS:
                h512 = {"hidden": 512, "intermediate": 1376, "heads": 8, "vocab": 1024}
                measured.setdefault(f"imbalance, measured h512, cuts={cuts}", {})[layers] = _plan(
                    layers, cuts, 64, **h512
                )
                measured.setdefault(f"imbalance, Llama-2-7B ratios, cuts={cuts}", {})[layers] = (
                    _plan(layers, cuts, SEQ_7B_RATIOS, **LLAMA_7B_RATIOS)
                )

    benchmark.group = "pipeline parallelism"
    benchmark.pedantic(plan_all, rounds=1, iterations=1)
    info = {"stages": STAGES, **measured, **source_revision()}
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

    # Rank 0 alone runs the one-process step (the others wait at the next barrier), so that it
    # is timed with the cores to itself, as one process would have them.
    steps["one process"] = one_process if rank == 0 else (lambda: None)
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


@pytest.mark.parametrize("ranks", [2, 4])
def test_schedule_step_time(benchmark, ranks: int) -> None:
    seconds: dict[str, list[float]] = {}
    benchmark.group = "pipeline parallelism"
    benchmark.pedantic(
        lambda: seconds.update(run_ranks(_times, ranks, ROUNDS, timeout=3000)[0]), rounds=1
    )
    median = {k: statistics.median(v) for k, v in seconds.items()}
    microbatches, per_rank = 8, {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zero-bubble": 2}
    # (p-1)/(K m + p-1); for zero-bubble an upper bound
    bubbles = {k: (ranks - 1) / (per_rank[k] * microbatches + ranks - 1) for k in per_rank}
    info = {
        "ranks": ranks,
        "cores": os.cpu_count(),
        "microbatches": microbatches,
        "rounds": ROUNDS,
        "median_step_seconds": {k: round(v, 4) for k, v in median.items()},
        "step / one process": {k: round(median[k] / median["one process"], 3) for k in SCHEDULES},
        "ideal step / one process": {k: round(1 / ranks / (1 - b), 3) for k, b in bubbles.items()},
        "analytic bubble": {k: round(b, 3) for k, b in bubbles.items()},
    }
    benchmark.extra_info.update(info)
    RESULTS[f"time, {ranks} ranks"] = info
    print("\n" + json.dumps(info))


@pytest.mark.bench_summary
def test_pp_summary() -> None:
    """Write the figures to bench/pipeline_parallel.json (a full run only)."""
    if set(RESULTS) != {"plan", "time, 2 ranks", "time, 4 ranks"}:
        pytest.skip("not every case ran (partial run or --benchmark-disable)")
    RESULTS_FILE.write_text(json.dumps(RESULTS, indent=2) + "\n")
