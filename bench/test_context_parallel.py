"""Context parallelism (`cp`) on 2 gloo ranks: activation memory per rank against one process,
the longest sequence a fixed activation budget holds, and step time of ring, all-gather and
Ulysses attention.

Run: RETARGET_BENCH_ROUNDS=9 python -m pytest bench/test_context_parallel.py --benchmark-only -s

Model: a 2-layer Llama (hidden 64, 4 heads, default config otherwise), batch 1.

- Activation memory: the bytes of the tensors autograd saves for backward during one forward
  (unique storages, parameters excluded), counted by a saved-tensors hook: one process on the
  whole sequence (transformers' SDPA attention, uncompiled) against one rank of
  `ddp+cp[attention=...]` on the same sequence (each rank is handed the whole batch and keeps
  its half). Goal at sequence 4096: <= 0.6x.
- Budget: the activation bytes of one process at sequence 2048. Saved bytes grow linearly
  with the sequence (the split attention keeps no score matrix), so a line fitted through the
  bytes measured at 1024-4096 (one process) and 1024-8192 (one cp rank, ring) gives the longest
  sequence each fits in the budget; goal: about 2x on 2 ranks.
- Step time (informational on CPU): one AdamW step per attention at sequence 1024, interleaved
  rounds after a barrier (bench/common.py's barrier_rounds), rank 0's seconds; ratios against
  ring in the same run.
Nothing here asserts on timing.
"""

from __future__ import annotations

import json
import os
import statistics

import pytest
import torch
from common import barrier_rounds, llama, results_file, source_revision, stepper

from tests.distributed import run_ranks

ROUNDS = int(os.environ.get("RETARGET_BENCH_ROUNDS", "3"))
VOCAB = 1024
MODES = ("ring", "allgather", "ulysses")
MEMORY_SEQ, BUDGET_SEQ, TIME_SEQ = 4096, 2048, 1024
LENGTHS = (1024, 2048, 4096, 8192)
RESULTS_FILE = results_file("context_parallel.json")
RESULTS: dict[str, dict] = {}


def model() -> torch.nn.Module:
    return llama(layers=2, hidden=64, intermediate=172, heads=4, vocab=VOCAB, positions=8192)


def inputs(seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def saved_bytes(net: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Bytes autograd saves for backward in one forward (unique storages, no parameters)."""
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = net(**batch).loss
    loss.backward()
    net.zero_grad(set_to_none=True)
    return sum(seen.values())


def _memory(rank: int, world: int) -> dict:
    from retarget.driver.compile import compile_for

    one = model()
    whole = {seq: saved_bytes(one, inputs(seq)) for seq in LENGTHS[:3]}
    split = {}
    for mode in MODES:
        compiled = compile_for(
            model(), f"ddp+cp[attention={mode}]", example_inputs=inputs(MEMORY_SEQ)
        )
        split[mode] = saved_bytes(compiled, inputs(MEMORY_SEQ))
    ring = compile_for(model(), "ddp+cp", example_inputs=inputs(MEMORY_SEQ))
    ring_lengths = {seq: saved_bytes(ring, inputs(seq)) for seq in LENGTHS}
    return {"whole": whole, "split": split, "ring_lengths": ring_lengths}


def _times(rank: int, world: int, rounds: int) -> dict[str, list[float]]:
    from retarget.driver.compile import compile_for

    batch = inputs(TIME_SEQ)
    steps = {}
    for mode in MODES:
        compiled = compile_for(model(), f"ddp+cp[attention={mode}]", example_inputs=batch)
        steps[mode] = stepper(compiled, batch)
    return barrier_rounds(steps, rounds=rounds, warmup=1)


def _longest(measured: dict, budget: int) -> int:
    """The sequence at which a least-squares line through (sequence, bytes) reaches `budget`."""
    xs = [float(s) for s in measured]
    ys = [float(b) for b in measured.values()]
    slope, intercept = statistics.linear_regression(xs, ys)
    return int((budget - intercept) / slope)


def test_cp_activation_memory(benchmark) -> None:
    found: list[dict] = []
    benchmark.group = "context parallelism, 2 gloo ranks"
    benchmark.pedantic(lambda: found.extend(run_ranks(_memory, 2, timeout=1800)), rounds=1)
    rank0 = found[0]
    whole = rank0["whole"][MEMORY_SEQ]
    budget = rank0["whole"][BUDGET_SEQ]
    fits_one = _longest(rank0["whole"], budget)
    fits_cp = _longest(rank0["ring_lengths"], budget)
    info = {
        "sequence": MEMORY_SEQ,
        "one process saved bytes": rank0["whole"],
        "cp rank saved bytes": rank0["split"],
        "ratio cp rank / one process": {
            mode: round(b / whole, 3) for mode, b in rank0["split"].items()
        },
        "budget (one process at 2048)": budget,
        "ring saved bytes by sequence": rank0["ring_lengths"],
        "longest sequence in budget": {"one process": fits_one, "cp[size=2] ring": fits_cp},
        "longest sequence ratio cp / one process": round(fits_cp / fits_one, 3),
        **source_revision(),
    }
    benchmark.extra_info.update(info)
    RESULTS["memory"] = info
    print("\n" + json.dumps(info))


def test_cp_step_time(benchmark) -> None:
    seconds: dict[str, list[float]] = {}
    benchmark.group = "context parallelism, 2 gloo ranks"
    benchmark.pedantic(
        lambda: seconds.update(run_ranks(_times, 2, ROUNDS, timeout=1800)[0]), rounds=1
    )
    median = {mode: statistics.median(s) for mode, s in seconds.items()}
    info = {
        "sequence": TIME_SEQ,
        "rounds": ROUNDS,
        "median_step_seconds": {k: round(v, 4) for k, v in median.items()},
        "ratio to ring": {k: round(v / median["ring"], 3) for k, v in median.items()},
    }
    benchmark.extra_info.update(info)
    RESULTS["time"] = info
    print("\n" + json.dumps(info))


@pytest.mark.bench_summary
def test_cp_summary() -> None:
    """Write the figures to bench/context_parallel.json (a full run only)."""
    if set(RESULTS) != {"memory", "time"}:
        pytest.skip("not every case ran (partial run or --benchmark-disable)")
    RESULTS_FILE.write_text(json.dumps(RESULTS, indent=2) + "\n")
