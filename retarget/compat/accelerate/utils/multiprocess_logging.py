"""get_logger: a logger for N processes, as Accelerate's (`main_process_only=`, `in_order=`).

    >>> logger = get_logger(__name__, log_level="INFO")
    >>> logger.info("loaded")                              # once, from the main process
    >>> logger.info("my shard", main_process_only=False)   # from every process
    >>> logger.info(f"rank {rank}", in_order=True)         # every process, rank 0 first

Each message is prefixed "[RANK r] ". Unlike Accelerate's, it needs no Accelerator first: the
process state comes from the torchrun environment (the process group starts on first use).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from retarget.execution.process import ProcessState


class MultiProcessAdapter(logging.LoggerAdapter):
    """A LoggerAdapter whose calls take `main_process_only=True` and `in_order=False`.

    `in_order=True` logs from every process one after the other (a barrier between
    processes), whatever `main_process_only` says.
    """

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        msg, kwargs = super().process(msg, kwargs)
        kwargs.setdefault("stacklevel", 2)  # report the caller, not this adapter
        return f"[RANK {ProcessState.current().rank}] {msg}", kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        if not self.isEnabledFor(level):
            return
        state = ProcessState.current()
        msg, kwargs = self.process(msg, kwargs)
        if in_order:
            for rank in range(state.world_size):
                if rank == state.rank:
                    self.logger.log(level, msg, *args, **kwargs)
                state.wait_for_everyone()
        elif not main_process_only or state.is_main_process:
            self.logger.log(level, msg, *args, **kwargs)

    @functools.lru_cache(None)  # noqa: B019 - one warning per message for the process' life
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """`warning`, emitted once per distinct arguments."""
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """The logger `name` wrapped for several processes; `log_level` (else the
    ACCELERATE_LOG_LEVEL variable) sets its level and the root logger's."""
    if log_level is None:
        log_level = os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper())
        logging.getLogger().setLevel(log_level.upper())
    return MultiProcessAdapter(logger, {})
