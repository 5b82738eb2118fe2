"""Preemption: SIGTERM or SIGUSR1 ends the run after the current step, with a checkpoint.

Clusters warn before they take machines back: SLURM sends SIGUSR1 (`--signal=USR1@120`) or
SIGTERM before its time limit, spot instances and Kubernetes send SIGTERM. Opt in with one call,
then ask once per step; every rank sees the same answer (the flag is all-reduced), so they all
stop after the same step and save one checkpoint together:

    >>> preemption = retarget.watch_preemption()
    >>> for step in range(start, steps):
    ...     train_step()
    ...     if preemption.should_stop():
    ...         preemption.exit_after(lambda: save_state(..., step=step + 1, project=project))

`exit_after` saves, records that this rank stopped cleanly (so `retarget launch` exits 0, see
launch/signals.py) and exits with status 0; the next launch resumes from that checkpoint.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from retarget.core.world import STOPPED_DIR_ENV

#: The signals that ask for a stop after the current step.
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionWatch:
    """Signal handlers that note a preemption request; `should_stop` agrees on it."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous = {sig: signal.signal(sig, self._note) for sig in PREEMPTION_SIGNALS}

    def _note(self, signum: int, frame: Any) -> None:
        self.received = signal.Signals(signum)

    def should_stop(self) -> bool:
        """True on every rank when any rank received a preemption signal (a collective: call it
        on every rank at the same point, once per step)."""
        flag = torch.tensor([1 if self.received is not None else 0])
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            if dist.get_backend() == "nccl":
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def exit_after(self, save: Callable[[], Any]) -> NoReturn:
        """Run `save` (a save_state call, on every rank), record a clean stop, exit 0."""
        save()
        folder = os.environ.get(STOPPED_DIR_ENV)
        if folder:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            Path(folder, f"rank_{rank}").touch()
        sys.stdout.flush()
        sys.exit(0)

    def close(self) -> None:
        """Give the signals their previous handlers back."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def watch_preemption() -> PreemptionWatch:
    """Start noting SIGTERM/SIGUSR1 (call it in the main thread, before the training loop)."""
    return PreemptionWatch()
