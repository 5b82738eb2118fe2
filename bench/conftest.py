"""pytest configuration for the benchmarks in bench/ (not part of the project's test run).

`python -m pytest bench/ --benchmark-only` runs every benchmark, then the tests marked
`bench_summary`, which read the timings the benchmarks left behind. pytest-benchmark's
`--benchmark-only` skips every test that does not use the `benchmark` fixture; a summary test
is not a benchmark, so that skip is taken off it again here.
"""

from __future__ import annotations

import pytest

_ONLY_REASON = "--benchmark-only"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "bench_summary: reads the benchmarks' timings; runs under --benchmark-only"
    )
    config.addinivalue_line(
        "markers", "soak: a long-running reliability check, not a timing; runs by hand"
    )


@pytest.hookimpl(trylast=True)  # after pytest-benchmark has added its skip markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("bench_summary") is None and not item.get_closest_marker("soak"):
            continue
        item.own_markers = [
            mark
            for mark in item.own_markers
            if not (mark.name == "skip" and _ONLY_REASON in str(mark.kwargs.get("reason", "")))
        ]
