"""The suite's own report: per-file time and memory are attributed to the file that ran."""

from __future__ import annotations

import time

import pytest

from tests.memory_report import MemoryReport


def test_each_file_is_charged_the_time_until_the_next_file_starts():
    report = MemoryReport()
    report.enter("tests/a/test_slow.py")
    time.sleep(0.2)
    report.enter("tests/a/test_slow.py")  # a second test of the same file: still one span
    time.sleep(0.1)
    report.enter("tests/b/test_quick.py")
    report.close()
    assert report.seconds["tests/a/test_slow.py"] >= 0.3
    assert report.seconds["tests/b/test_quick.py"] < 0.3
    line = report.slowest_line()
    assert line.index("test_slow.py") < line.index("test_quick.py")
    assert any(line == text for text in report.lines())


MODULE_THAT_COMPILES = """
import torch
from torch import nn

def test_compiles_and_steps():
    model = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)),
                          backend="eager")
    model(torch.randn(4, 8)).sum().backward()
"""

MODULE_AFTER = """
from tests.conftest import graph_tensors_alive

def test_nothing_of_the_previous_module_is_alive():
    import json, os
    before = json.loads(os.environ["GRAPH_TENSORS_BEFORE"])
    assert graph_tensors_alive() <= before
"""


def test_a_finished_module_leaves_no_graph_behind(pytester, monkeypatch):
    """A module that compiles leaves dynamo's cache holding its graph's fake tensors (each with
    an autograd graph); the suite's module fixture releases them before the next module."""
    from tests.conftest import graph_tensors_alive

    monkeypatch.setenv("GRAPH_TENSORS_BEFORE", str(graph_tensors_alive()))
    pytester.makeconftest("from tests.conftest import release_what_the_module_left  # noqa")
    pytester.makepyfile(test_a=MODULE_THAT_COMPILES, test_b=MODULE_AFTER)
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=2)
    # Without the fixture the second module sees the first one's graph alive.
    pytester.makeconftest("")
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1, failed=1)


def test_tests_run_alone_are_ranked_by_the_core_seconds_they_left_idle():
    worker = MemoryReport()
    worker.record_alone("t.py::busy", (100.0, 50.0), (119.0, 51.0))  # 19 busy, 1 idle
    worker.record_alone("t.py::sleepy", (0.0, 0.0), (2.0, 18.0))  # 2 busy, 18 idle
    worker.record_alone("t.py::unmeasured", None, (1.0, 1.0))
    worker.waited = {True: 12.0, False: 30.0}
    controller = MemoryReport()
    controller.merge("gw0", worker.to_dict())
    lines = controller.idle_lines()
    assert lines[0] == "waited for the cores: 12 s before tests run alone, 30 s before the others"
    assert lines[1].startswith("tests run alone: 2, 0.3 core-minutes busy and 0.3 idle (48%)")
    assert [line.split()[-1] for line in lines[2:]] == ["t.py::sleepy", "t.py::busy"]
    assert lines[2].split()[:2] == ["18.0", "10%"]


def test_the_machines_cpu_seconds_grow_with_work():
    from tests.memory_report import cpu_seconds

    before = cpu_seconds()
    if before is None:
        pytest.skip("no /proc/stat here")
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        pass
    busy, idle = cpu_seconds()
    assert busy - before[0] >= 0.2 and idle >= before[1]
