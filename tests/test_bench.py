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
