"""Whether a region is being captured right now: a process-wide flag that swapped-in modules read.

Set by `retarget.ir.region.Region.capture` around a capture; read by FP8 modules (compute what
the Linear they replaced computed), FSDP's hooks (stand aside) and checkpointing (step aside).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_capture_depth = 0


def capturing() -> bool:
    """Whether a region is being captured (traced and checked against eager) right now.

    Modules that a pass swapped in (FP8 Linears) then compute what the module they replaced
    computed, so a later capture records the user's computation and its eager check compares like
    with like; the pass's graph rewrite, replayed on the new graph, routes the call back to them.
    """
    return _capture_depth > 0


@contextlib.contextmanager
def capturing_originals() -> Iterator[None]:
    """Mark the duration of a capture for `capturing()`."""
    global _capture_depth
    _capture_depth += 1
    try:
        yield
    finally:
        _capture_depth -= 1
