"""The launcher's side of preemption: SIGUSR1 relayed to the ranks, clean stops recorded.

torchrun's agent handles SIGTERM itself: it sends SIGTERM to every rank and waits up to 30 s
before SIGKILL, then raises SignalException. SIGUSR1 (what SLURM sends before a time limit with
`--signal=USR1@T`) it does not handle, so the launcher relays it to its child processes (the
ranks) and keeps waiting. A rank that stops on purpose (`PreemptionWatch.exit_after`, in
runtime/preemption.py) touches a file in RETARGET_STOPPED_DIR; when every rank of this machine
did, the launcher exits 0 even though it was signalled: the job was preempted, saved, and will
resume.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

from retarget.core.world import STOPPED_DIR_ENV


def children(pid: int | None = None) -> list[int]:
    """Process ids whose parent is `pid` (default: this process), from /proc."""
    pid = os.getpid() if pid is None else pid
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text()
            # pid (comm) state ppid ...: comm may hold spaces, so split after its ')'.
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


@contextlib.contextmanager
def relay_usr1() -> Iterator[None]:
    """While inside, a SIGUSR1 to the launcher goes to each of its child processes instead."""

    def relay(signum, frame) -> None:
        for child in children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, relay)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)


@contextlib.contextmanager
def stopped_dir() -> Iterator[Path]:
    """A folder the ranks record clean stops in, exported as RETARGET_STOPPED_DIR."""
    with tempfile.TemporaryDirectory(prefix="retarget-stopped-") as folder:
        previous = os.environ.get(STOPPED_DIR_ENV)
        os.environ[STOPPED_DIR_ENV] = folder
        try:
            yield Path(folder)
        finally:
            if previous is None:
                os.environ.pop(STOPPED_DIR_ENV, None)
            else:
                os.environ[STOPPED_DIR_ENV] = previous


def stopped_ranks(folder: Path) -> int:
    """How many ranks recorded a clean stop."""
    return sum(1 for p in folder.iterdir() if p.name.startswith("rank_"))
