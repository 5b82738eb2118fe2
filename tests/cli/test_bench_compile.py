"""The compile suites' rows and README sections (`retarget bench compile-step ...`)."""

from __future__ import annotations

import json
from pathlib import Path

from retarget.cli import bench
from retarget.cli.bench_compile import (
    compile_dist_markdown,
    compile_dist_rows,
    compile_step_markdown,
    compile_step_rows,
    compile_time_markdown,
    compile_time_rows,
)

RUN = {"commit": "abcdef0123", "retarget_dirty": False, "date": "2026-11-25", "cpus": 2}
STEP = {
    "fp32": {
        "rounds": 9,
        "median_step_seconds": {"uncompiled": 0.15, "compile": 0.09, "by_hand": 0.088},
        "ratios": {"compile / uncompiled": 0.6, "compile / by hand": 1.0227},
        **RUN,
        "load_average": 3.5,
    }
}
TIME = {
    "rounds": 3,
    "median_seconds": {"compile@2": {"first": 20.0, "compile": 19.9, "step": 0.1}},
    "ratios": {"compile seconds: regions 32 / 2 layers": 1.2},
    **RUN,
}
DIST = {
    "ddp+compile": {
        "rounds": 9,
        "median_step_seconds": {"compiled": 0.1, "by_hand": 0.1},
        "ratio compiled / by hand (median of rounds)": 1.031,
        "ratio compiled / by hand (geometric mean of rounds)": 1.01,
        **RUN,
    }
}


def test_rows_name_each_ratio():
    assert compile_step_rows(STEP) == [
        ("compile: step, 1 process", "fp32: compile / uncompiled", "0.600"),
        ("compile: step, 1 process", "fp32: compile / by hand", "1.023"),
    ]
    assert compile_time_rows(TIME) == [
        ("compile: cold compile", "compile seconds: regions 32 / 2 layers", "1.200")
    ]
    assert compile_dist_rows(DIST) == [
        ("compile: 2 ranks", "ddp+compile: compiled / by hand", "1.031")
    ]


def test_sections_say_when_where_and_whether_each_goal_is_met():
    step = compile_step_markdown(STEP)
    assert "Date: 2026-11-25. Commit: abcdef0. Rounds: 9." in step
    assert "load average 3.5" in step
    assert "| fp32 | compile / uncompiled | 0.600 | <= 0.60: met |" in step
    assert "| fp32 | compile / by hand | 1.023 | <= 1.02: missed |" in step
    bf16 = compile_step_markdown({"bf16": STEP["fp32"]})  # the 0.60 goal is fp32's alone
    assert "| bf16 | compile / uncompiled | 0.600 |  |" in bf16
    assert "uncompiled 0.1500, compile 0.0900, by_hand 0.0880" in step
    time = compile_time_markdown(TIME)
    assert "| compile@2 | 20.00 | 19.90 | 0.1000 |" in time
    assert "| 1.200 | <= 1.50: met |" in time
    dist = compile_dist_markdown(DIST)
    assert "| ddp+compile | 1.031 | 1.010 | 0.1000, 0.1000 | <= 1.02: missed |" in dist


def test_compile_suites_write_their_own_sections(tmp_path: Path):
    where = tmp_path / "bench"
    where.mkdir()
    (where / "README.md").write_text("# Benchmarks\n\nintro\n")
    (where / "compile_step.json").write_text(json.dumps(STEP))
    suite = bench.SUITES["compile-step"]
    assert suite.section is not None and suite not in bench.table_suites()
    assert bench.write_section(suite, where)
    assert bench.write_section(suite, where)  # a second write replaces, never appends
    text = (where / "README.md").read_text()
    begin, end = bench.section_markers(suite)
    assert text.count(begin) == 1 and text.count(end) == 1
    assert "| fp32 | compile / by hand | 1.023 |" in text
    assert not bench.write_section(bench.SUITES["compile-time"], where)  # no JSON yet
