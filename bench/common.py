"""What the benchmarks share: the Llama-style model they time, its batch, one training step, and
timing several steps interleaved so that load from other jobs falls on all of them alike.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

#: Where a suite writes its figures: bench/ itself (the tracked files the README's table is made
#: from), or the folder `retarget bench --quick` names, so a quick run never rewrites them.
RESULTS_ENV = "RETARGET_BENCH_RESULTS"


def results_file(name: str) -> Path:
    """The file a suite writes its figures `name` to."""
    folder = Path(os.environ.get(RESULTS_ENV) or Path(__file__).resolve().parent)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


def llama(
    *,
    layers: int,
    hidden: int,
    intermediate: int,
    heads: int,
    vocab: int = 1024,
    positions: int = 128,
) -> LlamaForCausalLM:
    """A Llama-style causal LM with random weights from seed 0 (the same model every call)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        num_hidden_layers=layers,
        vocab_size=vocab,
        max_position_embeddings=positions,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def token_batch(vocab: int, batch: int, seq: int) -> dict[str, torch.Tensor]:
    """`input_ids` of shape (batch, seq) from seed 0, and the same ids as `labels`."""
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def stepper(model: torch.nn.Module, inputs: dict, context=None) -> Callable[[], None]:
    """One AdamW training step of `model` on `inputs`, the forward under `context` if given."""
    context = context if context is not None else contextlib.nullcontext()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def one_step() -> None:
        with context:
            loss = model(**inputs).loss
        loss.float().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return one_step


def barrier_rounds(
    steps: dict[str, Callable[[], None]], *, rounds: int, warmup: int
) -> dict[str, list[float]]:
    """Seconds of each step per round on this rank, after `warmup` untimed steps of each: one
    step of each per round in an order rotated every round, each after a barrier so that the
    ranks start it together (load from other jobs falls on every step alike)."""
    import torch.distributed as dist

    for one_step in steps.values():
        for _ in range(warmup):
            one_step()
    names = list(steps)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            steps[name]()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def interleaved_medians(
    benchmark, steps: dict[str, Callable[[], object]], *, rounds: int, threads: int
) -> dict[str, float]:
    """Median seconds of each step over `rounds` rounds (one step of each per round, after one
    warm-up round), timed by pytest-benchmark as a whole, with `threads` torch threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    seconds: dict[str, list[float]] = {name: [] for name in steps}

    def interleaved_round() -> None:
        for name, one_step in steps.items():
            start = time.perf_counter()
            one_step()
            seconds[name].append(time.perf_counter() - start)

    try:
        benchmark.pedantic(interleaved_round, rounds=rounds, iterations=1, warmup_rounds=1)
    finally:
        torch.set_num_threads(before)
    return {name: statistics.median(s[-rounds:]) for name, s in seconds.items()}


def source_revision() -> dict[str, Any]:
    """The commit measured, and whether retarget/ differed from it (others edit concurrently)."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        return {
            "commit": git("rev-parse", "HEAD"),
            "retarget_dirty": bool(git("status", "--porcelain", "--", "retarget")),
        }
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "retarget_dirty": None}
