"""What `retarget launch` prints when ranks fail: one line per rank, the first failure first.

torch's ProcessFailure has the exit code, the signal and the per-rank error file; worker.py
writes the exception there with a nanosecond timestamp, so the rank that failed first is named
first even within one second, and ranks torchrun stopped afterwards come last.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Any

_TIME_NS_KEY = "retarget_time_ns"  # worker.TIME_NS_KEY (that file is run, not imported)


def failure_summary(failures: Mapping[int, Any]) -> list[str]:
    """One line per failed rank, the first failure first: `rank 1 failed: ValueError: ...`.

    `failures` maps global rank -> torch's ProcessFailure. The first failure is the earliest
    recorded exception (nanosecond timestamps from worker), else the earliest observed
    exit; ranks that torchrun itself stopped with SIGTERM after a failure come last.
    """

    def order(rank: int) -> tuple[bool, int, int]:
        failure = failures[rank]
        recorded = _recorded(failure)
        stopped = recorded is None and failure.exitcode == -signal.SIGTERM
        return stopped, recorded[0] if recorded else failure.timestamp * 10**9, rank

    first, *rest = sorted(failures, key=order)
    lines = [f"rank {first} failed: {cause(failures[first])}"]
    lines += [f"rank {rank} stopped after it: {cause(failures[rank])}" for rank in rest]
    return lines


def _recorded(failure: Any) -> tuple[int, str] | None:
    """(time_ns, "Type: message") from the rank's error file, when worker.py wrote one."""
    message = failure.error_file_data.get("message")
    if not isinstance(message, dict) or _TIME_NS_KEY not in message.get("extraInfo", {}):
        return None
    return int(message["extraInfo"][_TIME_NS_KEY]), str(message.get("message", ""))


def cause(failure: Any, limit: int = 300) -> str:
    """The rank's exception as one bounded line, else how it exited."""
    recorded = _recorded(failure)
    if recorded:
        text = " ".join(recorded[1].split())
        return text if len(text) <= limit else text[: limit - 3] + "..."
    if failure.exitcode < 0:
        return f"killed by {failure.signal_name()}"
    return (
        f"exited with code {failure.exitcode} without a Python exception (os._exit or a crash "
        "in native code: see its output above)"
    )
