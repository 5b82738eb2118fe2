"""What bench/gpu/run.sh measures and prints: the environment, then tokens/s and peak memory of
training steps on a Llama-shaped model of about 1B parameters, by hand and through retarget.

    python bench/gpu/gpu_bench.py env
    python bench/gpu/gpu_bench.py measure --out DIR [--dry-run] [--rounds N] [--arms a,b]

Arms (one model each, all resident, so every round runs each arm once, in a rotated order, and
load drifting during the run falls on all alike):

    bf16 by hand                 torch.autocast(bf16) around the forward
    bf16+compile by hand         the same with each decoder layer torch.compile'd (regional)
    fp8 torchao+compile by hand  torchao's recipe: convert_to_float8_training (the same Linears
                                 retarget swaps), regional compile, autocast bf16
    retarget bf16, bf16+compile, bf16+fp8[backend=native] (+compile),
    bf16+fp8[backend=torchao,scaling=current] (+compile)

An arm that cannot be built or run here (torchao missing, an API of a newer torch, a GPU
without fp8) is reported with its error, not fatal: a GPU run is rare and must bring back every
figure it can. The optimizer is plain SGD with gradients set to None after each step, so ten
1B models fit one GPU (what is compared is the forward and backward, the part the targets
change). `--dry-run` runs the same code on CPU with a tiny model, compile's `eager` backend and
two rounds, in seconds: CI runs it, so the script cannot rot between GPU runs.

Writes DIR/gpu_bench.json (every figure with the device name) and DIR/gpu_bench.md (a table).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: The GPU model: Llama-3.2-1B's shape with a smaller vocabulary (about 1.1B parameters).
GPU_SHAPE = dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=32000)
GPU_BATCH, GPU_SEQ = 4, 2048
#: The dry run's model: the same code paths in seconds on a CPU.
DRY_SHAPE = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=256)
DRY_BATCH, DRY_SEQ = 2, 32


@dataclass
class Settings:
    device: torch.device
    dry_run: bool
    shape: dict[str, int]
    batch: int
    seq: int
    compile_backend: str
    fp8_options: str
    """Extra fp8[...] options: the dry run's Linears are below the default min_size."""

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


def settings(dry_run: bool) -> Settings:
    if dry_run:
        return Settings(
            torch.device("cpu"), True, DRY_SHAPE, DRY_BATCH, DRY_SEQ, "eager", ",min_size=1024"
        )
    return Settings(torch.device("cuda"), False, GPU_SHAPE, GPU_BATCH, GPU_SEQ, "inductor", "")


# ------------------------------------------------------------------------------------ environment


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment() -> dict[str, Any]:
    """What the run is on: device, torch and CUDA, the packages the arms use."""
    found: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda (torch built with)": torch.version.cuda or "none",
        "cuda available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        found["device"] = torch.cuda.get_device_name(0)
        found["compute capability"] = f"{props.major}.{props.minor}"
        found["memory GiB"] = round(props.total_memory / 2**30, 1)
        found["bf16 supported"] = torch.cuda.is_bf16_supported()
    else:
        found["device"] = f"cpu ({platform.machine()})"
    packages = ("transformers", "accelerate", "torchao", "transformer_engine", "triton", "peft")
    for name in (*packages, "bitsandbytes"):
        found[name] = _version(name)
    try:
        import retarget

        found["retarget"] = retarget.__version__
    except Exception as error:  # the run goes on and says why retarget is missing
        found["retarget"] = f"import failed: {type(error).__name__}: {error}"
    found["notes"] = [
        "te (Transformer Engine) is not measured: its wheels are too large to carry to the GPU "
        "machine, and the backend stays refused by name there"
    ]
    if _version("torchao") == "not installed":
        found["notes"].append(
            "torchao is not installed: the torchao arms report it (carry the wheel: "
            "bench/gpu/README.md)"
        )
    return found


# ------------------------------------------------------------------------------------------- arms


def llama(s: Settings) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = s.shape
    config = LlamaConfig(
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        vocab_size=shape["vocab"],
        max_position_embeddings=s.seq,
        use_cache=False,
    )
    with torch.device(s.device):
        return LlamaForCausalLM(config)


def batch(s: Settings) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, s.shape["vocab"], (s.batch, s.seq), generator=generator)
    ids = ids.to(s.device)
    return {"input_ids": ids, "labels": ids}


def _autocast(s: Settings) -> contextlib.AbstractContextManager:
    return torch.autocast(s.device.type, dtype=torch.bfloat16)


def _regional_compile(model: torch.nn.Module, s: Settings) -> None:
    """Compile each decoder layer in place, as torchtitan and Accelerate's regional mode do."""
    for layer in model.model.layers:
        layer.compile(backend=s.compile_backend)


def _fp8_filter(module: torch.nn.Module, name: str) -> bool:
    """The Linears retarget's swap_fp8 rules keep in fp8 for this model: not the LM head, dims
    multiples of 16 (the same decision, so the by-hand recipe swaps the same layers)."""
    if not isinstance(module, torch.nn.Linear) or name == "lm_head":
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


Step = Callable[[], torch.Tensor]


def _step(model: torch.nn.Module, inputs: dict, context: Callable | None) -> Step:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)

    def one_step() -> torch.Tensor:
        with context() if context is not None else contextlib.nullcontext():
            loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return one_step


def by_hand_bf16(s: Settings, compiled: bool) -> Step:
    model = llama(s)
    if compiled:
        _regional_compile(model, s)
    return _step(model, batch(s), lambda: _autocast(s))


def by_hand_torchao(s: Settings) -> Step:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = llama(s)
    convert_to_float8_training(model, config=Float8LinearConfig(), module_filter_fn=_fp8_filter)
    _regional_compile(model, s)
    return _step(model, batch(s), lambda: _autocast(s))


def through_retarget(s: Settings, target: str) -> Step:
    import retarget

    if s.dry_run:
        target = target.replace("compile", f"compile[backend={s.compile_backend}]")
        target = target.replace("fp8[", f"fp8[{s.fp8_options.lstrip(',')},", 1)
        target = target.replace(",]", "]")
    inputs = batch(s)
    compiled = retarget.compile_for(llama(s), target, example_inputs=inputs)
    return _step(compiled, inputs, None)


def arms(s: Settings) -> dict[str, Callable[[], Step]]:
    fp8_native = "bf16+fp8[backend=native]"
    fp8_torchao = "bf16+fp8[backend=torchao,scaling=current]"
    return {
        "bf16 by hand": lambda: by_hand_bf16(s, compiled=False),
        "bf16+compile by hand": lambda: by_hand_bf16(s, compiled=True),
        "fp8 torchao+compile by hand": lambda: by_hand_torchao(s),
        "retarget bf16": lambda: through_retarget(s, "bf16"),
        "retarget bf16+compile": lambda: through_retarget(s, "bf16+compile"),
        "retarget fp8 native": lambda: through_retarget(s, fp8_native),
        "retarget fp8 native+compile": lambda: through_retarget(s, fp8_native + "+compile"),
        "retarget fp8 torchao": lambda: through_retarget(s, fp8_torchao),
        "retarget fp8 torchao+compile": lambda: through_retarget(s, fp8_torchao + "+compile"),
    }


#: (figure, arm, its baseline): the ratios the table leads with.
RATIOS = (
    ("retarget bf16 / bf16 by hand (time)", "retarget bf16", "bf16 by hand"),
    (
        "retarget bf16+compile / bf16+compile by hand (time)",
        "retarget bf16+compile",
        "bf16+compile by hand",
    ),
    (
        "retarget fp8 torchao+compile / torchao's recipe by hand (time)",
        "retarget fp8 torchao+compile",
        "fp8 torchao+compile by hand",
    ),
    (
        "bf16+compile by hand / retarget fp8 native+compile (fp8 speed-up)",
        "bf16+compile by hand",
        "retarget fp8 native+compile",
    ),
    (
        "bf16+compile by hand / retarget fp8 torchao+compile (fp8 speed-up)",
        "bf16+compile by hand",
        "retarget fp8 torchao+compile",
    ),
)


# ------------------------------------------------------------------------------------ measurement


def _sync(s: Settings) -> None:
    if s.device.type == "cuda":
        torch.cuda.synchronize()


def _allocated(s: Settings) -> int:
    return torch.cuda.memory_allocated() if s.device.type == "cuda" else 0


def measure(s: Settings, *, rounds: int, warmup: int, only: list[str] | None) -> dict[str, Any]:
    """Build every arm (warm-up steps compile), then `rounds` interleaved rounds of one step
    each; per arm: median seconds, tokens/s, peak memory of its step, its loss, or its error."""
    results: dict[str, dict[str, Any]] = {}
    steps: dict[str, Step] = {}
    for name, build in arms(s).items():
        if only and name not in only:
            continue
        before = _allocated(s)
        started = time.perf_counter()
        try:
            one_step = build()
            for _ in range(warmup):
                loss = one_step()
            _sync(s)
        except Exception as error:
            results[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
            traceback.print_exc(file=sys.stderr)
            continue
        steps[name] = one_step
        results[name] = {
            "build_and_warmup_s": round(time.perf_counter() - started, 2),
            "resident_gib": round((_allocated(s) - before) / 2**30, 2),
            "loss": round(float(loss), 4),
            "seconds": [],
        }
        print(f"built {name}: {results[name]}", file=sys.stderr, flush=True)
    names = list(steps)
    for r in range(rounds if names else 0):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            _sync(s)
            resident = _allocated(s)
            if s.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            steps[name]()
            _sync(s)
            seconds = time.perf_counter() - start
            results[name]["seconds"].append(seconds)
            if s.device.type == "cuda":
                step_peak = torch.cuda.max_memory_allocated() - resident
                results[name]["step_peak_gib"] = round(
                    max(results[name].get("step_peak_gib", 0), step_peak / 2**30), 2
                )
    for name in names:
        median = statistics.median(results[name]["seconds"])
        results[name]["median_step_s"] = round(median, 4)
        results[name]["tokens_per_s"] = round(s.tokens / median)
    return results


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, float | str]:
    out: dict[str, float | str] = {}
    for figure, arm, baseline in RATIOS:
        a, b = results.get(arm, {}), results.get(baseline, {})
        if "median_step_s" in a and "median_step_s" in b:
            out[figure] = round(a["median_step_s"] / b["median_step_s"], 3)
        else:
            out[figure] = "not measured (an arm failed or was not run)"
    return out


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        f"Device: {env['device']}; torch {env['torch']} (CUDA {env['cuda (torch built with)']}); "
        f"torchao {env['torchao']}; transformers {env['transformers']}; "
        f"{'dry run (CPU, tiny model)' if report['dry_run'] else 'GPU run'}; "
        f"model {report['shape']}, batch {report['batch']} x {report['seq']} tokens, "
        f"{report['rounds']} interleaved rounds.",
        "",
        "| arm | tokens/s | median step s | step peak GiB | resident GiB | build+warm-up s "
        "| note |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in report["arms"].items():
        if "error" in r:
            lines.append(f"| {name} | - | - | - | - | - | {r['error'].replace('|', '/')} |")
            continue
        lines.append(
            f"| {name} | {r['tokens_per_s']} | {r['median_step_s']} | "
            f"{r.get('step_peak_gib', '-')} | {r['resident_gib']} | {r['build_and_warmup_s']} | "
            f"loss {r['loss']} |"
        )
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in report["ratios"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="print the environment as JSON")
    run = sub.add_parser("measure", help="time the arms, write DIR/gpu_bench.{json,md}")
    run.add_argument("--out", required=True, type=Path)
    run.add_argument("--dry-run", action="store_true", help="CPU, tiny model, seconds")
    run.add_argument("--rounds", type=int, default=None, help="default 5 (2 for --dry-run)")
    run.add_argument("--warmup", type=int, default=2)
    run.add_argument("--arms", default="", help="comma-separated arm names (default: all)")
    args = parser.parse_args(argv)
    if args.command == "env":
        print(json.dumps(environment(), indent=2))
        return 0
    s = settings(args.dry_run)
    if s.device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device; use --dry-run on a CPU", file=sys.stderr)
        return 2
    rounds = args.rounds or (2 if args.dry_run else 5)
    only = [a.strip() for a in args.arms.split(",") if a.strip()] or None
    results = measure(s, rounds=rounds, warmup=1 if args.dry_run else args.warmup, only=only)
    report = {
        "environment": environment(),
        "dry_run": s.dry_run,
        "shape": s.shape,
        "batch": s.batch,
        "seq": s.seq,
        "rounds": rounds,
        "arms": results,
        "ratios": ratios(results),
    }
    device = report["environment"]["device"]
    for r in results.values():
        r["device"] = device
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "gpu_bench.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
