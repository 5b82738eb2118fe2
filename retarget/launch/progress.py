"""Which rank stopped making progress: the launcher's reading of the ranks' reports.

Every rank's worker (launch/worker.py) writes, twice a second while the script runs, where its
main thread is and whether that is inside torch (computing, or waiting in a collective) or in
the script's own code. When a run fails with a collective timeout, the ranks that were waiting
are not the problem: the rank whose last report is outside torch (asleep, looping, blocked on a
lock) is. The launcher names it with the line it was at.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

#: The worker's variable (launch/worker.py is run by path, so the name is written twice).
PROGRESS_DIR_ENV = "RETARGET_PROGRESS_DIR"


@contextlib.contextmanager
def progress_dir() -> Iterator[Path]:
    """A folder the ranks report in, exported as RETARGET_PROGRESS_DIR."""
    with tempfile.TemporaryDirectory(prefix="retarget-progress-") as folder:
        previous = os.environ.get(PROGRESS_DIR_ENV)
        os.environ[PROGRESS_DIR_ENV] = folder
        try:
            yield Path(folder)
        finally:
            if previous is None:
                os.environ.pop(PROGRESS_DIR_ENV, None)
            else:
                os.environ[PROGRESS_DIR_ENV] = previous


def last_reports(folder: Path) -> dict[int, dict]:
    """Each rank's last report, by rank."""
    reports = {}
    for path in folder.glob("rank_*.json"):
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(path.read_text())
            reports[int(record["rank"])] = record
    return reports


def stalled_lines(folder: Path) -> list[str]:
    """Lines naming the ranks that were outside torch while others waited inside it."""
    reports = last_reports(folder)
    waiting = sorted(r for r, rec in reports.items() if rec["in_torch"])
    stalled = sorted(r for r, rec in reports.items() if not rec["in_torch"])
    if not waiting or not stalled:
        return []
    others = ", ".join(str(r) for r in waiting)
    return [
        f"rank {r} stopped making progress: it was at {reports[r]['where']} (its own code, "
        f"outside any collective) while rank{'s' if len(waiting) > 1 else ''} {others} waited "
        "inside torch"
        for r in stalled
    ]
