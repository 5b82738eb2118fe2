"""Resident memory and time of the test run: per-file peaks and seconds, the run's peak, checked.

A fresh machine's CI was killed by the kernel at 23.8 GB (a sweep that built 144 models in one
process). This plugin makes the suite's memory a number CI prints and checks: before each test
file the process's peak resident set (VmHWM) is reset (Linux: `clear_refs` with 5), and after the
file its peak is read, so each file's figure is what that file needed with the suite's baseline
under it, not what earlier files left. The end of the run prints the run's peak, its duration and
the largest files, and fails the run when the peak or a file's peak passes its limit
(`RETARGET_TEST_RSS_LIMIT_GB`, `RETARGET_TEST_FILE_RSS_LIMIT_GB`; 8 and 4 by default).
Subprocesses (the ranks of distributed tests) are measured apart: the largest one is printed.
The slowest files are printed too (wall time from a file's first test to the next file's), and
the slowest tests (setup, call and teardown together), so a CI log says where its minutes went.
A test that runs alone (the distributed ones, tests/core_share.py) has the machine to itself, so
the machine's idle CPU time while it runs (/proc/stat) is what it left unused: the run prints
their total and the tests that left the most core-seconds idle.

Under pytest-xdist every worker measures the files it ran and hands its figures to the
controller at the end (`to_dict` / `merge`); the controller prints one report: a file's peak is
that of the worker process that ran it, the run's peak is the largest worker's, and the workers'
peaks are also printed summed (what the machine held at most).

Where /proc is missing (not Linux), nothing is measured and nothing is checked.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

GIB = 1024**3
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_STAT = Path("/proc/stat")


def cpu_seconds() -> tuple[float, float] | None:
    """The machine's (busy, idle) CPU seconds since boot, all cores summed (iowait is idle)."""
    try:
        fields = _STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    tick = os.sysconf("SC_CLK_TCK")
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / tick, idle / tick


def _status_bytes(field: str) -> int | None:
    try:
        text = _STATUS.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def _reset_peak() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def _children_bytes() -> int:
    """The largest subprocess this process has waited for (its peak resident set)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def _limit(name: str, default: float) -> float:
    return float(os.environ.get(name, default)) * GIB


class MemoryReport:
    """Per-file peaks of this process's resident set over one pytest run."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.file: str | None = None
        self.peaks: dict[str, int] = {}
        #: Wall seconds per test file, from its first test's setup to the next file's.
        self.seconds: dict[str, float] = {}
        self.entered = time.monotonic()
        #: Start-up and collection (importing every test module), read at the first test.
        self.collection_peak: int | None = None
        self.measured = _status_bytes("VmHWM") is not None
        #: Seconds per test (node id), setup + call + teardown.
        self.tests: dict[str, float] = {}
        #: Peak resident bytes of each xdist worker (merged in; empty without xdist).
        self.worker_peaks: dict[str, int] = {}
        #: The largest subprocess any worker started (merged in).
        self.worker_children = 0
        #: Seconds the workers waited for the cores, tests run alone (True) and shared (False).
        self.waited: dict[bool, float] = {True: 0.0, False: 0.0}
        #: Per test run alone (node id): (busy, idle) core-seconds of the machine meanwhile.
        self.alone: dict[str, tuple[float, float]] = {}

    def enter(self, file: str) -> None:
        if file == self.file:
            return
        if self.collection_peak is None and self.measured:
            self.collection_peak = _status_bytes("VmHWM")
            self.measured = _reset_peak()
        self.close()
        self.file = file
        _reset_peak()

    def close(self) -> None:
        now = time.monotonic()
        if self.file is not None:
            self.seconds[self.file] = self.seconds.get(self.file, 0.0) + now - self.entered
        self.entered = now
        if self.file is not None and self.measured:
            peak = _status_bytes("VmHWM") or 0
            self.peaks[self.file] = max(peak, self.peaks.get(self.file, 0))
        self.file = None

    def record_test(self, nodeid: str, seconds: float) -> None:
        """Add one phase (setup, call or teardown) of a test to its time."""
        self.tests[nodeid] = self.tests.get(nodeid, 0.0) + seconds

    def record_alone(self, nodeid: str, before, after) -> None:
        """A test that ran alone: the machine's CPU seconds (`cpu_seconds`) around it."""
        if before is not None and after is not None:
            self.alone[nodeid] = (after[0] - before[0], after[1] - before[1])

    def idle_lines(self, top: int = 15) -> list[str]:
        """What the tests run alone left of the cores: in total, and the `top` that left most."""
        if not self.alone:
            return []
        busy = sum(b for b, _ in self.alone.values())
        idle = sum(i for _, i in self.alone.values())
        worst = sorted(self.alone.items(), key=lambda kv: -kv[1][1])[:top]
        return [
            f"waited for the cores: {self.waited[True]:.0f} s before tests run alone, "
            f"{self.waited[False]:.0f} s before the others",
            f"tests run alone: {len(self.alone)}, {busy / 60:.1f} core-minutes busy and "
            f"{idle / 60:.1f} idle ({100 * idle / max(busy + idle, 1e-9):.0f}%); "
            f"the {len(worst)} that left most idle (idle core-seconds, busy %):",
        ] + [
            f"  {i:7.1f}  {100 * b / max(b + i, 1e-9):3.0f}%  {nodeid}" for nodeid, (b, i) in worst
        ]

    def to_dict(self) -> dict:
        """A worker's figures, for the controller's `merge` (plain types: xdist sends them)."""
        self.close()
        return {
            "peaks": self.peaks,
            "seconds": self.seconds,
            "collection_peak": self.collection_peak,
            "measured": self.measured,
            "children": _children_bytes(),
            "alone": self.alone,
            "waited": [self.waited[True], self.waited[False]],
        }

    def merge(self, worker: str, figures: dict) -> None:
        """Take in one worker's figures (a file's peak is the larger of two, seconds add)."""
        for file, peak in figures["peaks"].items():
            self.peaks[file] = max(peak, self.peaks.get(file, 0))
        for file, seconds in figures["seconds"].items():
            self.seconds[file] = self.seconds.get(file, 0.0) + seconds
        peak = max([figures["collection_peak"] or 0, *figures["peaks"].values()])
        self.worker_peaks[worker] = peak
        self.collection_peak = max(self.collection_peak or 0, figures["collection_peak"] or 0)
        self.measured = self.measured and figures["measured"]
        self.worker_children = max(self.worker_children, figures["children"])
        self.alone.update({k: tuple(v) for k, v in figures["alone"].items()})
        alone, shared = figures["waited"]
        self.waited = {True: self.waited[True] + alone, False: self.waited[False] + shared}

    def run_peak(self) -> int:
        return max([self.collection_peak or 0, *self.peaks.values()])

    def slowest_tests(self, top: int = 30) -> list[str]:
        """The `top` slowest tests, one line each (seconds, then the test's id)."""
        slowest = sorted(self.tests.items(), key=lambda kv: -kv[1])[:top]
        return [f"slowest {len(slowest)} tests (seconds, setup + call + teardown):"] + [
            f"  {seconds:7.1f}  {nodeid}" for nodeid, seconds in slowest
        ]

    def slowest_line(self, top: int = 12) -> str:
        slowest = sorted(self.seconds.items(), key=lambda kv: -kv[1])[:top]
        return "slowest test files (seconds): " + ", ".join(
            f"{Path(f).name} {s:.0f}" for f, s in slowest
        )

    def lines(self, top: int = 5) -> list[str]:
        minutes, seconds = divmod(time.monotonic() - self.started, 60)
        if not self.measured:
            return [
                f"test run: {int(minutes)}:{seconds:04.1f}; resident memory not measured here",
                self.slowest_line(),
            ]
        children = max(_children_bytes(), self.worker_children)
        largest = sorted(self.peaks.items(), key=lambda kv: -kv[1])[:top]
        limit = _limit("RETARGET_TEST_RSS_LIMIT_GB", 8)
        workers = ""
        if self.worker_peaks:
            each = ", ".join(f"{w} {b / GIB:.2f}" for w, b in sorted(self.worker_peaks.items()))
            total = sum(self.worker_peaks.values()) / GIB
            workers = f"; {len(self.worker_peaks)} workers ({each}; together at most {total:.2f})"
        return [
            f"test run: {int(minutes)}:{seconds:04.1f}, peak resident memory "
            f"{self.run_peak() / GIB:.2f} GiB (limit {limit / GIB:g}),"
            f" collection {(self.collection_peak or 0) / GIB:.2f} GiB, largest subprocess "
            f"{children / GIB:.2f} GiB{workers}",
            "largest test files (peak resident memory while each ran): "
            + ", ".join(f"{Path(f).name} {b / GIB:.2f}" for f, b in largest),
            self.slowest_line(),
        ]

    def over_limits(self) -> list[str]:
        if not self.measured:
            return []
        run_limit = _limit("RETARGET_TEST_RSS_LIMIT_GB", 8)
        file_limit = _limit("RETARGET_TEST_FILE_RSS_LIMIT_GB", 4)
        over = [
            f"{Path(f).name} peaked at {b / GIB:.2f} GiB (limit {file_limit / GIB:g} GiB)"
            for f, b in self.peaks.items()
            if b > file_limit
        ]
        if self.run_peak() > run_limit:
            over.append(
                f"the run peaked at {self.run_peak() / GIB:.2f} GiB (limit {run_limit / GIB:g})"
            )
        return over
