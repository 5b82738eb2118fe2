"""launch/progress.py and the worker's reporter: which rank stopped making progress.

The reporter (launch/worker.py) writes twice a second where a rank's main thread is; the
launcher (launch/progress.py) reads the last reports after a collective timed out. A rank that
failed while waiting inside torch must still read as waiting after it failed: its exit (error
handling, atexit handlers, the process group's teardown) runs outside torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from retarget.launch.launcher import WORKER
from retarget.launch.progress import PROGRESS_DIR_ENV, last_reports, stalled_lines


def report(folder: Path, rank: int, where: str, in_torch: bool) -> None:
    record = {"rank": rank, "time": 0.0, "where": where, "in_torch": in_torch}
    (folder / f"rank_{rank}.json").write_text(json.dumps(record))


def test_the_rank_outside_torch_is_named_while_the_others_wait(tmp_path):
    report(tmp_path, 0, "/site/torch/autograd/graph.py:979 in _engine_run_backward", True)
    report(tmp_path, 1, "/run/train.py:12 in <module>", False)
    report(tmp_path, 2, "/site/torch/distributed/c10d.py:4 in all_reduce", True)
    (line,) = stalled_lines(tmp_path)
    assert line == (
        "rank 1 stopped making progress: it was at /run/train.py:12 in <module> (its own code, "
        "outside any collective) while ranks 0, 2 waited inside torch"
    )


def test_no_rank_is_named_when_all_wait_or_none_does(tmp_path):
    report(tmp_path, 0, "/site/torch/a.py:1 in f", True)
    report(tmp_path, 1, "/site/torch/a.py:1 in f", True)
    assert stalled_lines(tmp_path) == []
    report(tmp_path, 0, "/run/train.py:3 in <module>", False)
    report(tmp_path, 1, "/run/train.py:3 in <module>", False)
    assert stalled_lines(tmp_path) == []
    (tmp_path / "rank_2.json").write_text("{half a rec")  # a torn file is skipped
    assert sorted(last_reports(tmp_path)) == [0, 1]


@pytest.mark.distributed
def test_a_rank_failing_inside_torch_still_reads_as_inside_torch_after_it_exits(tmp_path):
    # A stand-in for torch: a module under a `torch` folder that waits, then fails as a timed-out
    # collective does. Its exit then spends 1.5 s in an atexit handler, outside torch (as the
    # process group's teardown does): the last report must still be the wait inside torch.
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "collective.py").write_text(
        "import time\n\n\ndef all_reduce():\n"
        "    time.sleep(1.5)\n"
        "    raise RuntimeError('Timed out')\n"
    )
    train = tmp_path / "train.py"
    train.write_text(
        textwrap.dedent(
            f"""
            import atexit, sys, time
            sys.path.insert(0, {str(fake)!r})
            import collective
            atexit.register(lambda: time.sleep(1.5))
            collective.all_reduce()
            """
        )
    )
    folder = tmp_path / "progress"
    folder.mkdir()
    env = {PROGRESS_DIR_ENV: str(folder), "RANK": "3", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, str(WORKER), str(train)], capture_output=True, text=True, env=env,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 1 and "Timed out" in done.stderr
    record = last_reports(folder)[3]
    assert record["in_torch"], record
    assert record["where"].startswith(f"{fake / 'collective.py'}:5 in all_reduce")
