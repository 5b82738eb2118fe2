"""examples/by_feature: each script, written against `accelerate`, prints the same metrics with
its import lines changed to `retarget`, on 1 process and on 2 (torchrun, gloo).

Both copies run from a temporary folder beside common.py; the retarget copy differs from the
original only in lines `from accelerate... import` -> `from retarget... import`. The metric
lines (`METRIC <label> {...}`, floats in full) must be equal exactly: same seed, same loader
order, same dropout masks, same arithmetic.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import free_port
from tests.paths import REPO as ROOT

EXAMPLES = ROOT / "examples" / "by_feature"

#: Each script's invocations, in order; "{out}" is a folder of the library's own.
INVOCATIONS: dict[str, list[list[str]]] = {
    "automatic_gradient_accumulation.py": [[]],
    "checkpointing.py": [
        ["--output_dir", "{out}/run"],
        ["--output_dir", "{out}/resumed", "--resume_from_checkpoint", "{out}/run/step_3"],
    ],
    "cross_validation.py": [[]],
    "ddp_comm_hook.py": [["--comm_hook", "fp16"]],
    "early_stopping.py": [[]],
    "gradient_accumulation.py": [[]],
    "local_sgd.py": [[]],
    "memory.py": [[]],
    "multi_process_metrics.py": [[]],
    "profiler.py": [["--output_dir", "{out}/traces"]],
    "tracking.py": [["--output_dir", "{out}/runs"]],
}
IMPORT_LINE = re.compile(r"^(from|import) accelerate\b", re.MULTILINE)


def swap_imports(source: str) -> str:
    """The script with its library import lines pointing at retarget: nothing else changes."""
    swapped, count = IMPORT_LINE.subn(r"\1 retarget", source)
    assert count, "the script imports nothing from accelerate"
    return swapped


def test_every_script_is_run_here():
    assert sorted(INVOCATIONS) == sorted(
        p.name for p in EXAMPLES.glob("*.py") if p.name != "common.py"
    )


def test_swap_imports_changes_only_import_lines():
    source = "from accelerate import Accelerator\nfrom accelerate.utils import set_seed\nx = 1\n"
    swapped = swap_imports(source)
    assert (
        swapped == "from retarget import Accelerator\nfrom retarget.utils import set_seed\nx = 1\n"
    )
    with pytest.raises(AssertionError, match="imports nothing"):
        swap_imports("import torch\n")


def _copy(script: str, folder: Path, swap: bool) -> Path:
    folder.mkdir(parents=True)
    (folder / "common.py").write_text((EXAMPLES / "common.py").read_text())
    source = (EXAMPLES / script).read_text()
    (folder / script).write_text(swap_imports(source) if swap else source)
    return folder / script


def _command(path: Path, processes: int) -> list[str]:
    if processes == 1:
        return [sys.executable, str(path)]
    launch = ["-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    return [sys.executable, *launch, "--master_port", str(free_port()), str(path)]


def _start(path: Path, processes: int, args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [a.format(out=path.parent / "out") for a in args]
    # A session of its own, so that a timed-out run can be killed with what it started.
    return subprocess.Popen(
        _command(path, processes) + args,
        start_new_session=True,
        cwd=path.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _metric_lines(process: subprocess.Popen, who: str) -> list[str]:
    try:
        output, _ = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        # torchrun starts each rank in a session of its own: SIGTERM makes it stop them; a
        # launcher that does not (or a plain run) is then killed with its process group.
        process.terminate()
        try:
            output, _ = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate(timeout=10)
        raise AssertionError(f"{who} ran over 300 s:\n{output[-4000:]}") from None
    assert process.returncode == 0, f"{who} failed:\n{output[-4000:]}"
    lines = [line for line in output.splitlines() if line.startswith("METRIC ")]
    assert lines, f"{who} printed no metrics:\n{output[-4000:]}"
    return lines


def run_both(script: str, processes: int, tmp_path: Path) -> list[tuple[list[str], list[str]]]:
    """Each invocation's metric lines under accelerate and under retarget (run side by side)."""
    originals = _copy(script, tmp_path / "accelerate", swap=False)
    migrated = _copy(script, tmp_path / "retarget", swap=True)
    results = []
    for args in INVOCATIONS[script]:
        runs = [_start(path, processes, args) for path in (originals, migrated)]
        who = f"{script} {' '.join(args)} on {processes} process(es)"
        results.append(
            tuple(
                _metric_lines(run, f"{lib}: {who}")
                for run, lib in zip(runs, ("accelerate", "retarget"), strict=True)
            )
        )
    return results


def _parsed(line: str) -> tuple[str, dict]:
    label, _, metrics = line.removeprefix("METRIC ").partition(" {")
    return label, ast.literal_eval("{" + metrics)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
@pytest.mark.parametrize("script", sorted(INVOCATIONS))
def test_script_prints_accelerates_metrics_with_the_import_changed(script, processes, tmp_path):
    results = run_both(script, processes, tmp_path)
    for accelerate_lines, retarget_lines in results:
        assert retarget_lines == accelerate_lines
    if script == "checkpointing.py":
        assert_resume_continues_the_run(*(lines for lines, _ in results))


def assert_resume_continues_the_run(run: list[str], resumed: list[str]) -> None:
    """The resumed run's epochs print what the uninterrupted run printed; in its first epoch,
    which it joins part way through, the eval metrics and the last step's loss."""
    uninterrupted = dict(map(_parsed, run))
    first, *later = map(_parsed, resumed)
    assert len(later) >= 1 and first[0] in uninterrupted
    expected = dict(uninterrupted[first[0]])
    assert first[1].pop("train_losses")[-1] == expected.pop("train_losses")[-1]
    assert first[1] == expected
    assert dict(later) == {label: uninterrupted[label] for label, _ in later}
