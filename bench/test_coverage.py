"""Capture coverage of the Hugging Face zoo: per model, what was captured and whether it is exact.

Run: retarget bench coverage [--write-readme]   (or python -m pytest bench/test_coverage.py
--benchmark-only)

For each model of the zoo (built at its default config, only the sizes shrunk), one benchmark
times `compile_for(model, "single", example_inputs=...)` once and records: the regions, how many
were captured by a graph frontend (not eager), which frontends, the seconds spent inside the
region captures, and whether one training forward/backward of the compiled model is bitwise
equal to the same model run eagerly (loss, logits, every gradient, the returned cache), with the
first difference or eager region's reason as the note. The summary writes bench/coverage.json,
from which `retarget bench` makes the coverage table of bench/README.md. A model that fails to
build or compile is a row saying so, not a crash of the suite.
"""

from __future__ import annotations

import json
import os
import platform
import time
from datetime import date
from typing import Any

import pytest
import torch
import transformers
from common import results_file, source_revision
from coverage_zoo import ZOO, ZOO_SOURCE

from retarget.driver.compile import compile_for

RESULTS_FILE = results_file("coverage.json")
THREADS = int(os.environ.get("RETARGET_BENCH_THREADS", "1"))
BATCH = 2

#: model name -> its row; filled by the benchmarks, written by the summary.
RESULTS: dict[str, dict[str, Any]] = {}


def _loss_and_logits(output: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(output, torch.Tensor):
        return output.float().square().mean(), output
    return output.loss, getattr(output, "logits", None)


def _cache_tensors(output: Any) -> list[torch.Tensor]:
    """Every tensor of a returned cache (an EncoderDecoderCache holds two caches)."""
    cache = getattr(output, "past_key_values", None)
    caches = [
        getattr(cache, "self_attention_cache", cache),
        getattr(cache, "cross_attention_cache", None),
    ]
    return [
        t.detach()
        for c in caches
        if c is not None
        for layer in getattr(c, "layers", ())
        for t in (layer.keys, layer.values)
        if isinstance(t, torch.Tensor)
    ]


def _train_step(model: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    output = model(**inputs)
    loss, logits = _loss_and_logits(output)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    cache = _cache_tensors(output)
    return {"loss": loss.detach(), "logits": logits, "cache": cache, "grads": grads}


def first_difference(compiled: dict[str, Any], eager: dict[str, Any]) -> str | None:
    """None when the two steps are bitwise equal, else what differs first."""
    for part in ("loss", "logits"):
        a, b = compiled[part], eager[part]
        if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
            return part
    if len(compiled["cache"]) != len(eager["cache"]):
        return f"cache has {len(compiled['cache'])} tensors, eager {len(eager['cache'])}"
    if not all(torch.equal(a, b) for a, b in zip(compiled["cache"], eager["cache"], strict=True)):
        return "cache"
    if compiled["grads"].keys() != eager["grads"].keys():
        return "the set of parameters with a gradient"
    for name, grad in eager["grads"].items():
        if not torch.equal(compiled["grads"][name], grad):
            return f"grad of {name}"
    return None


def coverage_row(entry: Any, benchmark) -> dict[str, Any]:
    inputs = entry.inputs(BATCH)
    reference, model = entry.factory(), entry.factory()
    compiled: list[torch.nn.Module] = []

    def compile_once() -> None:
        compiled.append(compile_for(model, "single", example_inputs=inputs))

    start = time.perf_counter()
    benchmark.pedantic(compile_once, rounds=1, iterations=1, warmup_rounds=0)
    seconds = time.perf_counter() - start
    regions = compiled[-1].program.regions
    captured = [r for r in regions if not r.eager_only and r.frontend != "eager"]
    difference = first_difference(_train_step(compiled[-1], inputs), _train_step(reference, inputs))
    eager = [f"{r.name}: {r.reason}" for r in regions if r not in captured]
    # A captured region can still meet a call signature it could not capture during the step.
    eager += [
        f"{r.name}: {len(r.eager_keys)} call signature(s) ran eagerly"
        for r in captured
        if r.eager_keys
    ]
    return {
        "model": entry.name,
        "class": type(reference).__name__,
        "regions": len(regions),
        "repeats": sum(r.repeats for r in regions),
        "captured": len(captured),
        "frontends": sorted({r.frontend for r in regions}),
        "blocks": [r.block_type for r in regions],
        "capture_seconds": round(sum(r.capture_seconds for r in regions), 3),
        "compile_seconds": round(seconds, 3),
        "bitwise": difference is None,
        "note": "; ".join(eager) or (f"differs: {difference}" if difference else ""),
    }


@pytest.fixture(scope="module", autouse=True)
def bench_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", list(ZOO))
def test_coverage(benchmark, name: str) -> None:
    entry = ZOO[name]
    benchmark.group = "coverage: compile_for single"
    try:
        row = coverage_row(entry, benchmark)
    except Exception as exc:  # a row that says why, so one model cannot hide the others
        first_line = (str(exc).splitlines() or [""])[0][:200]
        row = {"model": name, "error": f"{type(exc).__name__}: {first_line}", "bitwise": False}
    benchmark.extra_info.update(row)
    RESULTS[name] = row


@pytest.mark.bench_summary
def test_coverage_summary() -> None:
    """Writes bench/coverage.json when every model of the zoo has a row (never asserts)."""
    if not RESULTS:
        pytest.skip("no coverage rows in this session (run the whole file)")
    summary = {
        "date": date.today().isoformat(),
        "source": source_revision(),
        "zoo": ZOO_SOURCE,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "torch_threads": THREADS,
        },
        "target": "single",
        "models": [RESULTS[name] for name in ZOO if name in RESULTS],
    }
    complete = len(RESULTS) == len(ZOO)
    if complete:  # a partial run (-k) does not overwrite the rows of a full one
        RESULTS_FILE.write_text(json.dumps(summary, indent=2) + "\n")
    print()
    for row in summary["models"]:
        print(json.dumps(row))
    print(f"written to {RESULTS_FILE}" if complete else "partial run, coverage.json not written")
