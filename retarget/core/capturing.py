"""Whether this thread is capturing a region right now: the context that swapped-in modules read.

`Region.capture` runs a capture inside `capturing_originals()`; `capturing()` is then true in
that thread. Readers: FP8 modules (compute what the Linear they replaced computed), FSDP's hooks
(stand aside), checkpointing and autocast wrappers (step aside, so the trace sees the block).

Why not a plain `threading.local`: torch.compile guards on module globals, not on thread-local
attributes. A compiled region that read a thread-local flag would keep the value it saw when
traced (measured: a stale result, no recompile), and a ContextVar breaks the graph. So the count
of captures in progress (`_depth`, any thread) is a module global that compiled code guards on,
and only while it is non-zero is the calling thread looked up; that look-up is marked constant
for torch.compile (installed at the first capture, so importing retarget does not import
dynamo). A graph compiled inside a capture can serve another thread's call made while that
capture is still running; eager code always sees its own thread's answer.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

_depth = 0
"""Captures in progress in any thread (the global torch.compile guards on)."""
_threads: dict[int, int] = {}
"""Thread ident -> captures that thread has in progress."""


def _this_thread_captures() -> bool:
    return threading.get_ident() in _threads


_owned: Callable[[], bool] = _this_thread_captures


def capturing() -> bool:
    """Whether a region is being captured (traced and checked against eager) in this thread.

    Modules that a pass swapped in (FP8 Linears) then compute what the module they replaced
    computed, so a later capture records the user's computation and its eager check compares like
    with like; the pass's graph rewrite, replayed on the new graph, routes the call back to them.
    """
    return _depth > 0 and _owned()


@contextlib.contextmanager
def capturing_originals() -> Iterator[None]:
    """`capturing()` is true in this thread meanwhile (captures nest)."""
    global _depth, _owned
    if _owned is _this_thread_captures:
        import torch

        _owned = torch.compiler.assume_constant_result(_this_thread_captures)
    ident = threading.get_ident()
    _threads[ident] = _threads.get(ident, 0) + 1
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _threads[ident] == 1:
            del _threads[ident]
        else:
            _threads[ident] -= 1
