"""`retarget bench`: suite selection, reading the figures the suites write, the README table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from retarget.cli import bench
from retarget.cli.main import main


def _bench_dir(tmp_path: Path) -> Path:
    where = tmp_path / "bench"
    where.mkdir()
    (where / "conftest.py").write_text("")
    (where / "overhead.json").write_text(json.dumps({"bf16": {"ratio compiled / by hand": 1.0125}}))
    (where / "peer.json").write_text(
        json.dumps(
            {
                "fsdp": {
                    "accelerate ran": "DistributedType.MULTI_CPU",
                    "accelerate applied fsdp": False,
                    "step_time_ratio retarget/accelerate": 0.9,
                    "peak_memory_ratio retarget/accelerate": 0.8,
                }
            }
        )
    )
    return where


def test_selection_quick_full_and_unknown():
    assert [s.name for s in bench.select([], quick=True)] == ["overhead", "precision"]
    assert len(bench.select([], quick=False)) == len(bench.SUITES)
    assert [s.name for s in bench.select(["peer"], quick=True)] == ["peer"]
    with pytest.raises(bench.BenchError, match="unknown suite 'nope'; suites: overhead"):
        bench.select(["nope"], quick=False)


def test_rows_come_from_each_suites_json_and_say_what_the_peer_ran(tmp_path):
    where = _bench_dir(tmp_path)
    rows = bench.collect(bench.select([], quick=False), where)
    assert ("overhead, 1 process", "bf16: compiled / by hand", "1.012") in rows
    peer = [r for r in rows if r[0].startswith("peer")]
    assert "fsdp applied: False" in peer[0][1] and peer[0][2] == "0.900"
    assert peer[1] == ("peer: retarget / Accelerate", "fsdp peak memory", "0.800")
    assert "bf16: compiled / by hand" in bench.table(rows)


def test_readme_table_is_replaced_between_markers(tmp_path):
    where = _bench_dir(tmp_path)
    readme = where / "README.md"
    readme.write_text("# Benchmarks\n\nintro\n")
    rows = bench.collect(bench.select([], quick=False), where)
    bench.write_readme(rows, readme)
    bench.write_readme(rows[:1], readme)  # a second write replaces, never appends
    text = readme.read_text()
    assert text.count(bench.BEGIN) == 1 and "intro" in text
    assert "| overhead, 1 process | bf16: compiled / by hand | 1.012 |" in text
    assert "fsdp peak memory" not in text


def test_cli_reads_figures_without_running(tmp_path, monkeypatch, capsys):
    where = _bench_dir(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--no-run", "overhead"]) == 0
    assert "1.012" in capsys.readouterr().out
    assert main(["bench", "nope"]) == 2
    assert "unknown suite 'nope'" in capsys.readouterr().err
    if "matplotlib" not in sys.modules:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            assert main(["bench", "--no-run", "--plot", str(where / "x.png")]) == 2
            assert "needs matplotlib" in capsys.readouterr().err
            return
    assert main(["bench", "--no-run", "--plot", str(where / "x.png")]) == 0
    assert (where / "x.png").stat().st_size > 0


def _coverage(where: Path) -> None:
    models = [
        {
            "model": "llama",
            "class": "LlamaForCausalLM",
            "regions": 1,
            "repeats": 2,
            "captured": 1,
            "frontends": ["export"],
            "blocks": ["LlamaDecoderLayer"],
            "capture_seconds": 0.5444,
            "compile_seconds": 0.6,
            "bitwise": True,
            "note": "",
        },
        {
            "model": "t5",
            "class": "T5ForConditionalGeneration",
            "regions": 2,
            "repeats": 4,
            "captured": 1,
            "frontends": ["eager", "export"],
            "blocks": ["T5Block", "T5LayerFF"],
            "capture_seconds": 1.0,
            "compile_seconds": 1.2,
            "bitwise": False,
            "note": "decoder.block.*: export: a | b",
        },
        {"model": "falcon", "error": "RuntimeError: boom", "bitwise": False},
    ]
    data = {
        "date": "2026-11-24",
        "source": {"commit": "0123456789abcdef", "retarget_dirty": False},
        "zoo": "the zoo",
        "machine": {"platform": "Linux", "cpus": 2, "torch": "2.13", "transformers": "5.23"},
        "target": "single",
        "models": models,
    }
    (where / "coverage.json").write_text(json.dumps(data))


def test_coverage_rows_say_captured_frontends_seconds_and_bitwise(tmp_path):
    where = _bench_dir(tmp_path)
    _coverage(where)
    rows = bench.collect(bench.select(["coverage"], quick=False), where)
    assert rows == [
        ("coverage", "llama", "1/1 regions (2 repeats) by export, 0.54 s, bitwise"),
        ("coverage", "t5", "1/2 regions (4 repeats) by eager+export, 1.00 s, NOT bitwise"),
        ("coverage", "falcon", "error: RuntimeError: boom"),
    ]
    # Its own table, not rows of the full one.
    assert all(r[0] != "coverage" for r in bench.collect(bench.table_suites(), where))


def test_coverage_table_has_its_section_and_leaves_the_full_table_alone(tmp_path, monkeypatch):
    where = _bench_dir(tmp_path)
    readme = where / "README.md"
    bench.write_readme(bench.collect(bench.table_suites(), where), readme)
    full = readme.read_text().replace("Date: ", "Date: 1999-01-01, was ")  # a rewrite shows
    readme.write_text(full)
    _coverage(where)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--no-run", "coverage", "--write-readme"]) == 0
    assert main(["bench", "--no-run", "coverage", "--write-readme"]) == 0  # replaces
    text = readme.read_text()
    begin, end = bench.section_markers(bench.SUITES["coverage"])
    assert text.count(begin) == 1 and text.count(end) == 1
    section = text.partition(begin)[2].partition(end)[0]

    def full_table(readme_text: str) -> str:
        return readme_text.partition(bench.BEGIN)[2].partition(bench.END)[0]

    assert full_table(text) == full_table(full) != ""  # the full table and its date untouched
    assert "Commit: 0123456. Target: single. Models: the zoo." in section
    llama = "| llama | LlamaForCausalLM | 1 (LlamaDecoderLayer) | 1/1 regions (2 repeats) |"
    assert llama in section
    assert "| 1.00 | no | decoder.block.*: export: a \\| b |" in section  # pipes escaped
    assert "| falcon |" in section and "error: RuntimeError: boom" in section


def test_offload_rows_read_the_offload_suites_figures():
    figures = {
        "anon_growth ours / (budget + largest block)": 0.646,
        "time_per_token ours/accelerate": 0.386,
        "peak_rss ours/accelerate": 0.853,
        "load time hidden by prefetch": 0.57,
    }
    rows = bench.SUITES["offload"].rows(figures)
    assert ("disk offload", "time_per_token ours / Accelerate", "0.39x") in rows
    assert ("disk offload", "cold load time hidden by prefetch", "57%") in rows
    assert ("disk offload", "RssAnon growth / (budget + largest block)", "0.65x") in rows


FAKE_SUITE = """
import json, os, pathlib

def test_figures(benchmark):
    benchmark(lambda: None)
    folder = pathlib.Path(os.environ.get("RETARGET_BENCH_RESULTS") or pathlib.Path(__file__).parent)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "overhead.json").write_text(json.dumps({"bf16": {"ratio compiled / by hand": 2.5}}))
"""


@pytest.mark.distributed  # the suite runs in its own pytest process
def test_quick_writes_apart_from_the_tracked_figures_and_marks_its_rows(
    tmp_path, monkeypatch, capsys
):
    where = _bench_dir(tmp_path)
    tracked = (where / "overhead.json").read_text()
    (where / "test_overhead.py").write_text(FAKE_SUITE)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--quick", "overhead", "--write-readme"]) == 2
    assert "not written into bench/README.md" in capsys.readouterr().err
    assert main(["bench", "--quick", "overhead"]) == 0
    out = capsys.readouterr().out
    assert "2.500 (quick)" in out and "fsdp peak memory" in out  # the rest: the tracked figures
    assert (where / "overhead.json").read_text() == tracked
    assert (where / ".quick" / "overhead.json").is_file()


def test_startup_rows_read_the_startup_suites_figures():
    figures = {
        "import torch s": 1.81,
        "import retarget s": 0.05,
        "retarget --help s": 0.27,
        "import accelerate s": 2.2,
    }
    for label, ours, theirs in (("uncompiled", 0.6, 0.08), ("compiled, warm cache", 3.9, 0.45)):
        figures[f"prepare-to-first-step {label}: retarget s"] = ours
        figures[f"prepare-to-first-step {label}: accelerate s"] = theirs
        figures[f"prepare-to-first-step {label}: retarget / accelerate"] = ours / theirs
        figures[f"capture share of script wall time, {label}"] = 0.083
    rows = bench.SUITES["startup"].rows(figures)
    assert ("start-up", "retarget --help (fresh process)", "0.27 s") in rows
    assert (
        "start-up",
        "prepare-to-first-step uncompiled: retarget / Accelerate",
        "7.50x (0.60 s vs 0.08 s)",
    ) in rows
    assert ("start-up", "capture's share of a short script's wall time, uncompiled", "8%") in rows


def test_cp_rows_read_the_context_parallel_suites_figures():
    figures = {
        "memory": {
            "sequence": 4096,
            "ratio cp rank / one process": {"ring": 0.516, "ulysses": 0.52},
            "longest sequence ratio cp / one process": 1.94,
        },
        "time": {"sequence": 1024, "ratio to ring": {"ring": 1.0, "allgather": 1.154}},
    }
    rows = bench.SUITES["cp"].rows(figures)
    group = "context parallelism, 2 ranks"
    assert (group, "activations per rank / one process, ring, sequence 4096", "0.516x") in rows
    assert (
        group,
        "longest sequence in a fixed activation budget, cp / one process",
        "1.94x",
    ) in rows
    assert (group, "step time allgather / ring, sequence 1024", "1.15x") in rows
    assert len(rows) == 4


def test_pp_rows_read_the_pipeline_suites_figures():
    figures = {
        "plan": {
            "imbalance, Llama-2-7B ratios, cuts=auto": {"8": 1.034},
            "imbalance, Llama-2-7B ratios, cuts=blocks": {"8": 1.195},
            "imbalance, measured h512, cuts=auto": {},
        },
        "time": {"step / one process": {"1f1b": 1.512}, "ideal step / one process": 0.562},
    }
    rows = bench.SUITES["pp"].rows(figures)
    group = "pipeline parallelism"
    assert (group, "stage imbalance, 4 stages, 8 layers (Llama-2-7B ratios)", "1.03") in rows
    blocks_only = "stage imbalance, 4 stages, 8 layers (Llama-2-7B ratios, cuts=blocks)"
    assert (group, blocks_only, "1.20") in rows
    assert (group, "1f1b step / one process, 2 ranks (ideal 0.562)", "1.51x") in rows
    # Since the looped schedules, the ideal is per schedule (their bubble is smaller).
    figures["time"] = {
        "step / one process": {"1f1b": 1.512, "interleaved-1f1b": 1.7},
        "ideal step / one process": {"1f1b": 0.562, "interleaved-1f1b": 0.531},
    }
    rows = bench.SUITES["pp"].rows(figures)
    assert (group, "interleaved-1f1b step / one process, 2 ranks (ideal 0.531)", "1.70x") in rows
    # Since the 4-rank arm, one entry per rank count.
    del figures["time"]
    figures["time, 2 ranks"] = {"ranks": 2, "step / one process": {"gpipe": 1.3},
                                "ideal step / one process": {"gpipe": 0.562}}  # fmt: skip
    figures["time, 4 ranks"] = {"ranks": 4, "step / one process": {"gpipe": 1.25},
                                "ideal step / one process": {"gpipe": 0.344}}  # fmt: skip
    rows = bench.SUITES["pp"].rows(figures)
    assert (group, "gpipe step / one process, 2 ranks (ideal 0.562)", "1.30x") in rows
    assert (group, "gpipe step / one process, 4 ranks (ideal 0.344)", "1.25x") in rows


def test_quant_rows_show_the_bytes_saved_for_backward_when_measured():
    step = {
        "step_time_ratios": {"full fine-tuning / full fine-tuning": 1.0, "quant LoRA / full": 1.1},
        "memory_ratios": {"full fine-tuning / full fine-tuning": 1.0, "quant LoRA / full": 0.1},
    }
    rows = bench.SUITES["quant"].rows({"step": step})
    assert ("quantized fine-tuning", "quant LoRA / full", "step 1.10x, memory 0.100x") in rows
    step["saved_ratios"] = {"quant LoRA / full": 0.9}
    rows = bench.SUITES["quant"].rows({"step": step})
    value = "step 1.10x, memory 0.100x, saved for backward 0.90x"
    assert ("quantized fine-tuning", "quant LoRA / full", value) in rows


def test_fp8_cpu_rows_read_the_suites_figures():
    figures = {
        "training": {"cpu": "Intel(R) Xeon(R) Processor", "ratio fp8 / fp32": 2.114},
        "one_gemm": {
            "gemm": "128x256x256, float8_e4m3fn operands, fp32 out",
            "ratios over fp32 matmul": {"_scaled_mm": 1967.5, "emulated": 4.5, "fp32 matmul": 1.0},
        },
    }
    rows = bench.SUITES["fp8-cpu"].rows(figures)
    group = "fp8 on the CPU"
    assert rows == [
        (group, "15 training steps fp8 / fp32 (Intel(R) Xeon(R) Processor)", "2.11x"),
        (group, "one GEMM 128x256x256: _scaled_mm / fp32", "1967.5x"),
        (group, "one GEMM 128x256x256: emulated / fp32", "4.5x"),
    ]
