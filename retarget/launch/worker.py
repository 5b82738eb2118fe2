"""Run a training script in one rank as `python script.py args` would, recording how it failed.

`retarget launch` starts every rank as `python -u worker.py script.py args...` under
torchrun. The script runs as `__main__` with its own `sys.argv` and its directory first on
`sys.path`, exactly as a direct run. When it raises, the exception is written to torchrun's
per-rank error file (`$TORCHELASTIC_ERROR_FILE`, the JSON that `@record` writes), with a
nanosecond timestamp so the launcher can tell which rank failed first even within one second;
the traceback is printed from the script's own frames, and the rank exits 1. When it finishes,
a process group it left initialised is destroyed (see `release_process_group`).

This file is run by path, not imported as `retarget.runtime...`: it uses only the standard
library, so a rank pays for nothing but the script's own imports.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys
import threading
import time
import traceback
from types import TracebackType

#: extraInfo key of the error file holding time.time_ns() at the failure.
TIME_NS_KEY = "retarget_time_ns"
#: Where `retarget launch` asks each rank to report where its main thread is (launch/progress.py).
PROGRESS_DIR_ENV = "RETARGET_PROGRESS_DIR"
#: Seconds between two reports.
PROGRESS_EVERY_S = 0.5
#: Frames from these parts of torch mean "inside torch": computing or waiting in a collective.
_TORCH_PARTS = (os.sep + "torch" + os.sep,)


def report_progress(folder: str, rank: str, main_thread: int) -> None:
    """Forever (a daemon thread): write where the main thread is to `folder/rank_<rank>.json`.

    The innermost Python frame tells a rank waiting inside torch (a collective, a backward)
    from one stuck in its own code (a sleep, an endless loop, a lock): when a collective times
    out, the launcher names the ranks that were not in it.

    Only frames of the script's run are reported: once it has returned or raised (the main
    thread handling the failure, running atexit handlers or tearing down the process group),
    the last report stays as it was, else a rank that failed waiting inside a collective would
    read as stuck in its own code while it exits.
    """
    path = os.path.join(folder, f"rank_{rank}.json")
    while True:
        frame = sys._current_frames().get(main_thread)
        if frame is None:
            return
        if not _inside(frame, run_script.__code__):
            del frame
            time.sleep(PROGRESS_EVERY_S)
            continue
        inner = frame
        in_torch = any(part in inner.f_code.co_filename for part in _TORCH_PARTS)
        record = {
            "rank": int(rank),
            "time": time.time(),
            "where": f"{inner.f_code.co_filename}:{inner.f_lineno} in {inner.f_code.co_name}",
            "in_torch": in_torch,
        }
        del frame, inner
        with open(path + ".tmp", "w", encoding="utf-8") as stream:
            json.dump(record, stream)
        os.replace(path + ".tmp", path)
        time.sleep(PROGRESS_EVERY_S)


def _inside(frame, code) -> bool:
    """Whether `code` runs in `frame` or in one of its callers."""
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def run_script(script: str, module: bool) -> None:
    """Run the script (or `-m` module) as `__main__`; the reporter reports only inside this call."""
    if module:
        runpy.run_module(script, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(script, run_name="__main__")


def record_failure(error: BaseException, error_file: str | None) -> None:
    """Write `error` to `error_file` in torch.distributed.elastic's format (no-op when None)."""
    if not error_file:
        return
    now = time.time_ns()
    data = {
        "message": {
            "message": f"{type(error).__name__}: {error}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(error)),
                "timestamp": str(now // 10**9),
                TIME_NS_KEY: str(now),
            },
        }
    }
    with open(error_file, "w", encoding="utf-8") as stream:
        json.dump(data, stream)


def _from_script(tb: TracebackType | None, script: str) -> TracebackType | None:
    """The traceback from the script's first frame on (this file's and runpy's frames dropped)."""
    start = tb
    while start is not None and os.path.abspath(start.tb_frame.f_code.co_filename) != script:
        start = start.tb_next
    return start or tb


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: worker.py [-m MODULE | SCRIPT] [ARGS...]")
    module = argv[0] == "-m"  # `-m pkg.mod args`: run as `python -m` (the cwd first on sys.path)
    if module:
        argv = argv[1:]
    script = argv[0] if module else os.path.abspath(argv[0])
    sys.argv = list(argv)
    sys.path[0] = os.getcwd() if module else os.path.dirname(script)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    folder = os.environ.get(PROGRESS_DIR_ENV)
    if folder:
        reporter = threading.Thread(
            target=report_progress,
            args=(folder, os.environ.get("RANK", "0"), threading.main_thread().ident),
            daemon=True,
        )
        reporter.start()
    try:
        run_script(script, module)
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            record_failure(exit_, error_file)
        else:
            release_process_group()
        raise
    except KeyboardInterrupt as interrupt:
        record_failure(interrupt, error_file)
        raise
    except BaseException as error:  # noqa: BLE001 - every failure is recorded, then the rank exits
        record_failure(error, error_file)
        # The hook prints the exception's own traceback: trim it to the script's frames first.
        # sys.excepthook, not print_exception: torch's process group prefixes lines with [rankN].
        error = error.with_traceback(_from_script(error.__traceback__, script))
        sys.excepthook(type(error), error, error.__traceback__)
        sys.exit(1)
    release_process_group()


def release_process_group() -> None:
    """Destroy the process group a finished script left initialised (most scripts do).

    With torch 2.13 a gloo group still alive at interpreter exit aborts the process now and then
    ("terminate called without an active exception", SIGABRT; a third of 2-rank runs on a
    loaded 2-core machine, plain torchrun included), turning a finished run into a failed one.
    Garbage is collected first: a DDP wrapper kept alive by a reference cycle holds the group.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
