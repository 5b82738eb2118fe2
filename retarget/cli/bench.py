"""`retarget bench`: run the benchmark suite in bench/ and show its figures as one table.

Each suite is one pytest-benchmark file in bench/ that writes its figures to a JSON file next to
it; this module runs the files (each in its own `python -m pytest ... --benchmark-only`
process, so a crash or a hang in one does not take the others with it), shows progress, then
reads the JSON files and prints one row per figure. `--quick` runs a small subset with fewer
rounds (a couple of minutes); the full suite can write the table into bench/README.md between
the markers below, and plot the step-time and memory ratios to a PNG (needs matplotlib).

Every figure is a ratio measured in one run against a baseline from the same run (never an
absolute time compared across runs), as bench/README.md explains.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

from retarget.cli.bench_bigmodel import big_load_rows, offload_rows
from retarget.cli.bench_compile import (
    compile_dist_markdown,
    compile_dist_rows,
    compile_step_markdown,
    compile_step_rows,
    compile_time_markdown,
    compile_time_rows,
)
from retarget.cli.bench_coverage import coverage_markdown, coverage_rows
from retarget.cli.bench_plot import PlotError, plot
from retarget.cli.commands import CliError, Handler, command

#: What `bench/common.py` reads to know where to write (kept equal to its RESULTS_ENV), and the
#: folder under bench/ a --quick run writes to (ignored by git).
RESULTS_ENV = "RETARGET_BENCH_RESULTS"
QUICK_DIR = ".quick"

BEGIN = "<!-- retarget bench table: begin -->"
END = "<!-- retarget bench table: end -->"

Row = tuple[str, str, str]  # (suite, figure, value)


@dataclass(frozen=True, kw_only=True)
class Suite:
    name: str
    file: str
    """The pytest file in bench/."""
    results: str
    """The JSON file it writes in bench/."""
    rows: Callable[[dict[str, Any]], list[Row]]
    quick_env: dict[str, str] = field(default_factory=dict)
    """Environment for --quick (fewer rounds); a suite with None here is left out of --quick."""
    in_quick: bool = False
    needs: tuple[str, ...] = ()
    """Importable modules the suite needs (else it is skipped with the reason)."""
    section: Callable[[dict[str, Any]], str] | None = None
    """A suite with its own table in bench/README.md (markdown from its JSON), between its own
    markers, instead of rows in the full table."""


def _capture_rows(d: dict) -> list[Row]:
    return [
        ("pipeline cost", f"compile_for time, {k}", f"{v:.2f}x") for k, v in d["ratios"].items()
    ]


def _precision_rows(d: dict) -> list[Row]:
    return [("precision", f"step time {k}", f"{v:.2f}x") for k, v in d["ratios"].items()]


def _overhead_rows(d: dict) -> list[Row]:
    return [
        ("overhead, 1 process", f"{k}: compiled / by hand", f"{v['ratio compiled / by hand']:.3f}")
        for k, v in d.items()
    ]


def _dist_rows(d: dict) -> list[Row]:
    key = "ratio compiled / by hand (geometric mean of rounds)"
    return [
        ("overhead, 2 ranks", f"{k}: compiled / by hand", f"{v[key]:.3f}") for k, v in d.items()
    ]


def _ac_rows(d: dict) -> list[Row]:
    rows = []
    for name, c in d["configs"].items():
        figures = (
            f"peak {c['peak_ratio']:.2f}x, activations {c['activations_ratio']:.2f}x, "
            f"step {c['step_time_ratio']:.2f}x"
        )
        rows.append(("activation checkpointing", f"ac {name} vs off", figures))
    return rows


def _peer_rows(d: dict) -> list[Row]:
    rows = []
    for target, r in d.items():
        ran = (
            f"(Accelerate ran {r['accelerate ran']}, fsdp applied: {r['accelerate applied fsdp']})"
        )
        rows.append(
            (
                "peer: retarget / Accelerate",
                f"{target} step time {ran}",
                f"{r['step_time_ratio retarget/accelerate']:.3f}",
            )
        )
        rows.append(
            (
                "peer: retarget / Accelerate",
                f"{target} peak memory",
                f"{r['peak_memory_ratio retarget/accelerate']:.3f}",
            )
        )
    return rows


def _startup_rows(d: dict) -> list[Row]:
    rows = [
        ("start-up", f"{name} (fresh process)", f"{d[f'{name} s']:.2f} s")
        for name in ("import torch", "import retarget", "retarget --help", "import accelerate")
    ]
    for label in ("uncompiled", "uncompiled bf16", "compiled, warm cache"):
        if f"prepare-to-first-step {label}: retarget s" not in d:
            continue  # a results file from before the arm existed
        rows.append(
            (
                "start-up",
                f"prepare-to-first-step {label}: retarget / Accelerate",
                f"{d[f'prepare-to-first-step {label}: retarget / accelerate']:.2f}x "
                f"({d[f'prepare-to-first-step {label}: retarget s']:.2f} s vs "
                f"{d[f'prepare-to-first-step {label}: accelerate s']:.2f} s)",
            )
        )
        rows.append(
            (
                "start-up",
                f"capture's share of a short script's wall time, {label}",
                f"{100 * d[f'capture share of script wall time, {label}']:.0f}%",
            )
        )
    return rows


def _quant_rows(d: dict) -> list[Row]:
    rows = []
    step = d.get("step", {})
    for name, ratio in step.get("step_time_ratios", {}).items():
        if not name.startswith("full fine-tuning"):
            memory = step["memory_ratios"][name]
            value = f"step {ratio:.2f}x, memory {memory:.3f}x"
            saved = step.get("saved_ratios", {}).get(name)
            if saved is not None:
                value += f", saved for backward {saved:.2f}x"
            rows.append(("quantized fine-tuning", name, value))
    load = d.get("load", {})
    for name, ratio in load.get("peak_added / loaded model bytes", {}).items():
        rows.append(("quantized loading", f"peak RSS added / model bytes, {name}", f"{ratio:.2f}x"))
    refused = load.get("arms", {}).get("accelerate", {}).get("refused")
    if refused:
        rows.append(("quantized loading", "Accelerate's load_and_quantize_model", "refused here"))
    return rows


def _tp_compile_rows(d: dict) -> list[Row]:
    info = d.get("tp_compile", {})
    rows = []
    for key, label in (
        ("tp+compile / tp", "step time tp+compile / tp"),
        (
            "tp+compile / by hand (parallel styles + per-block compile)",
            "step time tp+compile / parallel styles + per-block compile by hand",
        ),
    ):
        if key in info:
            ratio = info[key]["median of rounds"]
            rows.append(("tensor parallelism, 2 ranks", label, f"{ratio:.3f}x"))
    return rows


def _fp8_cpu_rows(d: dict) -> list[Row]:
    """fp8 training over fp32 on the machine's CPU, and one float8 GEMM over an fp32 matmul."""
    group, rows = "fp8 on the CPU", []
    training = d.get("training", {})
    if "ratio fp8 / fp32" in training:
        label = f"15 training steps fp8 / fp32 ({training.get('cpu', 'CPU')})"
        rows.append((group, label, f"{training['ratio fp8 / fp32']:.2f}x"))
    gemm = d.get("one_gemm", {})
    for way, ratio in gemm.get("ratios over fp32 matmul", {}).items():
        if way != "fp32 matmul":
            rows.append(
                (group, f"one GEMM {gemm['gemm'].split(',')[0]}: {way} / fp32", f"{ratio:.1f}x")
            )
    return rows


def _cp_rows(d: dict) -> list[Row]:
    rows = []
    memory = d.get("memory", {})
    seq = memory.get("sequence")
    for mode, ratio in memory.get("ratio cp rank / one process", {}).items():
        rows.append(
            (
                "context parallelism, 2 ranks",
                f"activations per rank / one process, {mode}, sequence {seq}",
                f"{ratio:.3f}x",
            )
        )
    if "longest sequence ratio cp / one process" in memory:
        rows.append(
            (
                "context parallelism, 2 ranks",
                "longest sequence in a fixed activation budget, cp / one process",
                f"{memory['longest sequence ratio cp / one process']:.2f}x",
            )
        )
    time = d.get("time", {})
    for mode, ratio in time.get("ratio to ring", {}).items():
        if mode != "ring":
            rows.append(
                (
                    "context parallelism, 2 ranks",
                    f"step time {mode} / ring, sequence {time.get('sequence')}",
                    f"{ratio:.2f}x",
                )
            )
    return rows


def _pp_rows(d: dict) -> list[Row]:
    rows, group = [], "pipeline parallelism"
    plan = d.get("plan", {})
    for label, key in (
        ("Llama-2-7B ratios", "imbalance, Llama-2-7B ratios, cuts=auto"),
        ("Llama-2-7B ratios, cuts=blocks", "imbalance, Llama-2-7B ratios, cuts=blocks"),
        ("h512", "imbalance, measured h512, cuts=auto"),
        ("h512, cuts=blocks", "imbalance, measured h512, cuts=blocks"),
    ):
        for layers, ratio in plan.get(key, {}).items():
            rows.append(
                (group, f"stage imbalance, 4 stages, {layers} layers ({label})", f"{ratio:.2f}")
            )
    # "time, N ranks" per rank count (older files: "time", 2 ranks)
    timings = {k: v for k, v in d.items() if k == "time" or k.startswith("time, ")}
    for timing in timings.values():
        ranks = timing.get("ranks", 2)
        for schedule, ratio in timing.get("step / one process", {}).items():
            ideal = timing.get("ideal step / one process")
            if isinstance(ideal, dict):  # per schedule since the looped schedules
                ideal = ideal.get(schedule)
            label = f"{schedule} step / one process, {ranks} ranks (ideal {ideal})"
            rows.append((group, label, f"{ratio:.2f}x"))
    return rows


SUITES: dict[str, Suite] = {
    s.name: s
    for s in (
        Suite(
            name="overhead",
            file="test_overhead.py",
            results="overhead.json",
            rows=_overhead_rows,
            quick_env={"RETARGET_BENCH_ROUNDS": "3"},
            in_quick=True,
        ),
        Suite(
            name="precision",
            file="test_precision.py",
            results="precision.json",
            rows=_precision_rows,
            quick_env={"RETARGET_BENCH_ROUNDS": "2"},
            in_quick=True,
        ),
        Suite(name="capture", file="test_capture.py", results="results.json", rows=_capture_rows),
        Suite(name="ac", file="test_ac_memory.py", results="ac_memory.json", rows=_ac_rows),
        Suite(
            name="distributed",
            file="test_dist_overhead.py",
            results="dist_overhead.json",
            rows=_dist_rows,
        ),
        Suite(
            name="peer",
            file="test_peer.py",
            results="peer.json",
            rows=_peer_rows,
            needs=("accelerate",),
        ),
        Suite(
            name="quant",
            file="test_quant.py",
            results="quant.json",
            rows=_quant_rows,
            needs=("peft",),
        ),
        Suite(
            name="fp8-cpu",
            file="test_fp8_cpu.py",
            results="fp8_cpu.json",
            rows=_fp8_cpu_rows,
        ),
        Suite(
            name="cp",
            file="test_context_parallel.py",
            results="context_parallel.json",
            rows=_cp_rows,
        ),
        Suite(
            name="tp-compile",
            file="test_tp_compile.py",
            results="tp_compile.json",
            rows=_tp_compile_rows,
        ),
        Suite(
            name="pp",
            file="test_pipeline_parallel.py",
            results="pipeline_parallel.json",
            rows=_pp_rows,
        ),
        Suite(
            name="startup",
            file="test_startup.py",
            results="startup.json",
            rows=_startup_rows,
            quick_env={"RETARGET_BENCH_ROUNDS": "1"},
            needs=("accelerate",),
        ),
        Suite(
            name="coverage",
            file="test_coverage.py",
            results="coverage.json",
            rows=coverage_rows,
            section=coverage_markdown,
        ),
        # The compile suites (minutes of inductor compiles each) keep their own tables, with
        # the date, commit and load of their run, rather than rows of the full table.
        Suite(
            name="compile-step",
            file="test_compile_step.py",
            results="compile_step.json",
            rows=compile_step_rows,
            needs=("accelerate",),
            section=compile_step_markdown,
        ),
        Suite(
            name="compile-time",
            file="test_compile_time.py",
            results="compile_time.json",
            rows=compile_time_rows,
            needs=("accelerate",),
            section=compile_time_markdown,
        ),
        Suite(
            name="compile-dist",
            file="test_compile_dist.py",
            results="compile_dist.json",
            rows=compile_dist_rows,
            section=compile_dist_markdown,
        ),
        Suite(
            name="bigload",
            file="test_big_load.py",
            results="big_load.json",
            rows=big_load_rows,
            quick_env={"RETARGET_BENCH_ROUNDS": "3"},
        ),
        Suite(
            name="offload",
            file="test_offload.py",
            results="offload.json",
            rows=offload_rows,
            quick_env={"RETARGET_BENCH_ROUNDS": "3"},
            needs=("accelerate",),
        ),
    )
}


class BenchError(RuntimeError):
    """The bench/ directory is missing, or a suite name is unknown."""


def bench_dir(start: Path | None = None) -> Path:
    """bench/ of the source checkout (the suite is not installed with the package)."""
    for root in (start or Path.cwd(), Path(__file__).resolve().parent.parent):
        if (root / "bench" / "conftest.py").is_file():
            return root / "bench"
    raise BenchError(
        "no bench/ directory here or next to the retarget package: run `retarget bench` from a "
        "source checkout (git clone ...; pip install -e '.[bench]')"
    )


def select(names: Iterable[str], quick: bool) -> list[Suite]:
    names = list(names)
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise BenchError(f"unknown suite {unknown[0]!r}; suites: {', '.join(SUITES)}")
    if names:
        return [SUITES[n] for n in names]
    return [s for s in SUITES.values() if s.in_quick or not quick]


def run_suites(suites: list[Suite], *, quick: bool, bench: Path, out=sys.stdout) -> dict[str, str]:
    """Run each suite's pytest file; returns suite name -> "ok" / "failed ..." / "skipped ..."."""
    status: dict[str, str] = {}
    for index, suite in enumerate(suites, 1):
        missing = [m for m in suite.needs if not _importable(m)]
        prefix = f"[{index}/{len(suites)}] {suite.name:<12}"
        if missing:
            status[suite.name] = f"skipped: {', '.join(missing)} not installed"
            print(f"{prefix} {status[suite.name]}", file=out, flush=True)
            continue
        print(f"{prefix} running bench/{suite.file} ...", end="", file=out, flush=True)
        env = {**os.environ, **(suite.quick_env if quick else {})}
        if quick:  # figures of fewer rounds: apart from the tracked files the README reads
            env[RESULTS_ENV] = str(bench / QUICK_DIR)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(bench.parent), env.get("PYTHONPATH")])
        )
        command = [sys.executable, "-m", "pytest", str(bench / suite.file), "--benchmark-only"]
        command += ["-q", "-p", "no:cacheprovider"]
        start = time.perf_counter()
        done = subprocess.run(command, cwd=bench.parent, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if done.returncode == 0:
            status[suite.name] = "ok"
        else:
            tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or ["no output"]
            status[suite.name] = f"failed (exit {done.returncode}): {tail[0]}"
        print(f" {status[suite.name]} ({seconds:.0f} s)", file=out, flush=True)
    return status


def collect(suites: list[Suite], bench: Path, quick: Iterable[Suite] = ()) -> list[Row]:
    """Every suite's last figures; those of the suites in `quick` from this --quick run,
    marked as such (the others are the tracked figures of the last full run)."""
    fresh = {s.name for s in quick}
    rows: list[Row] = []
    for suite in suites:
        path = bench / (QUICK_DIR if suite.name in fresh else "") / suite.results
        if path.is_file():
            found = suite.rows(json.loads(path.read_text()))
            rows += [(s, f, f"{v} (quick)") for s, f, v in found] if suite.name in fresh else found
    return rows


def table(rows: list[Row]) -> str:
    header: Row = ("suite", "figure", "value")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def machine() -> str:
    import torch

    return (
        f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, CUDA {'yes' if torch.cuda.is_available() else 'no'}"
    )


def markdown(rows: list[Row]) -> str:
    lines = [
        f"Date: {date.today().isoformat()}. Machine: {machine()}.",
        "",
        "| suite | figure | value |",
        "|---|---|---|",
        *(f"| {s} | {f} | {v} |" for s, f, v in rows),
    ]
    return "\n".join(lines)


def section_markers(suite: Suite) -> tuple[str, str]:
    return (
        f"<!-- retarget bench {suite.name} table: begin -->",
        f"<!-- retarget bench {suite.name} table: end -->",
    )


def _replace_block(text: str, begin: str, end: str, body: str, heading: str) -> str:
    """`body` between the markers; a new block goes under `heading` after the title line."""
    block = f"{begin}\n{body}\n{end}"
    if begin in text and end in text:
        head, _, rest = text.partition(begin)
        _, _, tail = rest.partition(end)
        return head + block + tail
    first, _, rest = text.partition("\n")
    return f"{first}\n\n{heading}\n\n{block}\n{rest}"


def write_readme(rows: list[Row], readme: Path) -> None:
    """Replace the table between the markers in bench/README.md (added at the top if absent)."""
    text = readme.read_text() if readme.is_file() else "# Benchmarks\n"
    heading = "## Latest full table (`retarget bench --write-readme`)"
    readme.write_text(_replace_block(text, BEGIN, END, markdown(rows), heading))


def write_section(suite: Suite, bench: Path) -> bool:
    """Write `suite`'s own table from its JSON into bench/README.md; False if it has no JSON."""
    path = bench / suite.results
    if suite.section is None or not path.is_file():
        return False
    readme = bench / "README.md"
    text = readme.read_text() if readme.is_file() else "# Benchmarks\n"
    begin, end = section_markers(suite)
    heading = f"## {suite.name.capitalize()} (`retarget bench {suite.name} --write-readme`)"
    body = suite.section(json.loads(path.read_text()))
    readme.write_text(_replace_block(text, begin, end, body, heading))
    return True


def table_suites() -> list[Suite]:
    """The suites whose rows make the full table (the others have a section of their own)."""
    return [s for s in SUITES.values() if s.section is None]


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@command("bench", "run the benchmark suite (bench/) and print its ratios as one table")
def bench_arguments(parser: argparse.ArgumentParser) -> Handler:
    """`retarget bench [--quick] [SUITE ...] [--write-readme] [--plot PNG] [--no-run]`."""
    parser.add_argument("suites", nargs="*", metavar="SUITE", help=", ".join(SUITES))
    parser.add_argument("--quick", action="store_true", help="a small subset, fewer rounds")
    parser.add_argument(
        "--no-run", action="store_true", help="only read and show the figures last written"
    )
    parser.add_argument(
        "--write-readme", action="store_true", help="write the table into bench/README.md"
    )
    parser.add_argument("--plot", metavar="PNG", help="plot the ratios (needs matplotlib)")

    def handle(args: argparse.Namespace) -> int:
        try:
            where = bench_dir()
            suites = select(args.suites, args.quick)
            if args.quick and args.write_readme:
                raise BenchError(
                    "--quick figures (fewer rounds) are not written into bench/README.md; "
                    "run the suites without --quick to update the table"
                )
            status = {} if args.no_run else run_suites(suites, quick=args.quick, bench=where)
            # Every suite's last figures: running one suite refreshes its rows, not the table;
            # a quick run's rows are shown marked, from bench/.quick, never the tracked files.
            ran = [s for s in suites if status.get(s.name) == "ok"] if args.quick else []
            print(table(collect(list(SUITES.values()), where, quick=ran)))
            if args.write_readme:
                # The full table is rewritten when a suite of it was selected; a suite with its
                # own section (coverage) run alone leaves the full table and its date as they are.
                if any(s.section is None for s in suites):
                    write_readme(collect(table_suites(), where), where / "README.md")
                    print(f"wrote the table into {where / 'README.md'}")
                for suite in suites:
                    if write_section(suite, where):
                        print(f"wrote the {suite.name} table into {where / 'README.md'}")
            if args.plot:
                plot(collect(table_suites(), where), Path(args.plot))
                print(f"wrote {args.plot}")
        except (BenchError, PlotError) as exc:
            raise CliError(str(exc)) from None
        return 0 if all(v == "ok" or v.startswith("skipped") for v in status.values()) else 1

    return handle
