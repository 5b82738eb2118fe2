"""What fp8 training costs on this CPU: 15 steps of a 1024-wide 2-layer GPT-NeoX, fp8 over fp32.

Run: python -m pytest bench/test_fp8_cpu.py --benchmark-only -s   (see bench/README.md)

The machines this project runs on change processors, and torch's CPU `_scaled_mm` is a slow
reference kernel on some (on an Intel Xeon with AMX: 220x an fp32 matmul of a 128x1024x1024
GEMM; 15 fp8 steps of this model did not finish in 29 minutes). The native backend therefore
emulates the float8 GEMM on the CPU (fp32 matmul of the exact float8 values, then the scales:
retarget/kernels/fp8/layout.py). This bench measures what a CPU user of `fp8` pays for the
recipe now: one round trains 15 steps (forward, loss, backward, AdamW, zero_grad) of each target
in turn, on models compiled by `compile_for(model, target)`; the ratio is of medians over the
rounds. The goal: fp8 at most 3x fp32. A second benchmark times one 128x256x256 float8 GEMM
three ways (torch's `_scaled_mm`, the emulation, an fp32 matmul of the same shape) to show what
the emulation saves on this processor. Nothing here asserts on timing.
"""

from __future__ import annotations

import json
import os

import torch
from common import interleaved_medians, results_file, source_revision, stepper, token_batch

from retarget.driver.compile import compile_for
from retarget.kernels.fp8.layout import emulated_scaled_mm
from retarget.kernels.fp8.native import Float8Linear
from retarget.kernels.fp8.recipe import E4M3

ROUNDS = int(os.environ.get("RETARGET_BENCH_ROUNDS", "9"))
THREADS = int(os.environ.get("RETARGET_BENCH_THREADS", "1"))
STEPS = 15
HIDDEN, LAYERS, HEADS, VOCAB = 1024, 2, 16, 1024
BATCH, SEQ = 2, 64
RESULTS_FILE = results_file("fp8_cpu.json")


def gpt_neox(hidden: int):
    """GPT-NeoX at its default config (intermediate 4x hidden, rotary, parallel residual), sizes
    shrunk."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=SEQ,
    )
    return GPTNeoXForCausalLM(config)


def trainer(target: str, hidden: int = HIDDEN):
    inputs = token_batch(VOCAB, BATCH, SEQ)
    compiled = compile_for(gpt_neox(hidden), target, example_inputs=inputs)
    one_step = stepper(compiled, inputs)
    one_step()  # first call: lazy state (optimizer moments, fp8 scales)

    def fifteen_steps() -> None:
        for _ in range(STEPS):
            one_step()

    fifteen_steps.fp8_linears = sum(isinstance(m, Float8Linear) for m in compiled.modules())
    return fifteen_steps


def test_fp8_training_over_fp32_on_this_cpu(benchmark) -> None:
    steps = {"single": trainer("single"), "fp8[backend=native]": trainer("fp8[backend=native]")}
    benchmark.group = "fp8 on the CPU: 15 training steps"
    median = interleaved_medians(benchmark, steps, rounds=ROUNDS, threads=THREADS)
    info = {
        "model": f"GPT-NeoX h{HIDDEN} i{4 * HIDDEN} {LAYERS} layers, batch {BATCH} seq {SEQ}, "
        f"{STEPS} steps a round",
        "rounds": ROUNDS,
        "threads": THREADS,
        "cpu": cpu_name(),
        "median_seconds_of_15_steps": {t: round(v, 3) for t, v in median.items()},
        "ratio fp8 / fp32": round(median["fp8[backend=native]"] / median["single"], 2),
        # The swap's eligibility (min_size) took every block Linear at this width.
        "fp8_linears": {t: step.fp8_linears for t, step in steps.items()},
        **source_revision(),
    }
    _write("training", info)
    benchmark.extra_info.update(info)
    print("\n" + json.dumps(info, indent=2))


def test_one_fp8_gemm_three_ways_on_this_cpu(benchmark) -> None:
    m, k, n = 128, 256, 256
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    a, b = x.to(E4M3), w.to(E4M3).t()
    one = torch.tensor(1.0)
    steps = {
        "_scaled_mm": lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.float32),
        "emulated": lambda: emulated_scaled_mm(a, b, one, one, torch.float32),
        "fp32 matmul": lambda: x @ w.t(),
    }
    benchmark.group = "fp8 on the CPU: one GEMM"
    median = interleaved_medians(benchmark, steps, rounds=ROUNDS, threads=THREADS)
    info = {
        "gemm": f"{m}x{k}x{n}, float8_e4m3fn operands, fp32 out",
        "rounds": ROUNDS,
        "threads": THREADS,
        "cpu": cpu_name(),
        "median_seconds": {t: round(v, 5) for t, v in median.items()},
        "ratios over fp32 matmul": {
            t: round(v / median["fp32 matmul"], 1) for t, v in median.items()
        },
        **source_revision(),
    }
    _write("one_gemm", info)
    benchmark.extra_info.update(info)
    print("\n" + json.dumps(info, indent=2))


def _write(key: str, info: dict) -> None:
    """Both benchmarks' figures in one file, each under its own key."""
    figures = json.loads(RESULTS_FILE.read_text()) if RESULTS_FILE.exists() else {}
    figures[key] = info
    RESULTS_FILE.write_text(json.dumps(figures, indent=2) + "\n")


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
