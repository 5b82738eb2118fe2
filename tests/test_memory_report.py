"""The suite's own report: per-file time and memory are attributed to the file that ran."""

from __future__ import annotations

import time

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
