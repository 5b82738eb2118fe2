"""examples/by_feature: each script, written against `accelerate`, prints the same metrics with
its import lines changed to `retarget`, on 1 process and on 2 (gloo).

Both copies run from a temporary folder beside common.py; the retarget copy differs from the
original only in lines `from accelerate... import` -> `from retarget... import`. The metric
lines (`METRIC <label> {...}`, floats in full) must be equal exactly: same seed, same loader
order, same dropout masks, same arithmetic.

How a script runs. checkpointing.py runs as a user runs it, in new interpreters: `python
checkpointing.py` on 1 process, `python -m torch.distributed.run --nproc_per_node 2 ...` on 2,
the two copies side by side, so the real launcher path (torchrun's environment and rendezvous,
an interpreter's exit after training, a second launch reading the first one's checkpoint) stays
covered. Every other script (profiler, tracking and find_executable_batch_size included) runs
as `__main__` (runpy) in the suite's pooled gloo worlds (tests/distributed.py): on 1 process
the two copies side by side, one on each rank of a world of 2, on 2 processes the Accelerate
copy then the retarget copy: a new interpreter spends ~4-5 s importing torch, transformers and
accelerate, about half of a case's time when every case started 2 interpreters (1 process) or
6 (2 processes). A pooled rank sees what the launch would give it: torchrun's variables on 2
processes and none on 1 (as under `python script.py`), the script's folder as working folder
and first on sys.path, its own argv; the harness seeds it anew and, between the two copies,
destroys the process group and resets Accelerate's state singletons.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import runpy
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import free_port, run_ranks
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
#: The scripts run in new interpreters (python / torchrun), not in a pooled world: see above.
LAUNCHED = frozenset({"checkpointing.py"})
#: The bound on one run of one copy (both copies side by side, when launched).
TIMEOUT_S = 300
#: What torchrun sets in a rank's environment (with TORCHELASTIC_*): none of it under `python`.
TORCHRUN_ENV = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_NAME",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)
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


def _arguments(path: Path, args: list[str]) -> list[str]:
    return [a.format(out=path.parent / "out") for a in args]


# -- in new interpreters (LAUNCHED) ------------------------------------------------------------


def _command(path: Path, processes: int) -> list[str]:
    if processes == 1:
        return [sys.executable, str(path)]
    launch = ["-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    return [sys.executable, *launch, "--master_port", str(free_port()), str(path)]


def _start(path: Path, processes: int, args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # A session of its own, so that a timed-out run can be killed with what it started.
    return subprocess.Popen(
        _command(path, processes) + _arguments(path, args),
        start_new_session=True,
        cwd=path.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _launched_output(process: subprocess.Popen, who: str) -> str:
    """What the launch printed (every rank's stdout and stderr, merged), once it succeeded."""
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # torchrun starts each rank in a session of its own: SIGTERM makes it stop them; a
        # launcher that does not (or a plain run) is then killed with its process group.
        process.terminate()
        try:
            output, _ = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate(timeout=10)
        raise AssertionError(f"{who} ran over {TIMEOUT_S} s:\n{output[-4000:]}") from None
    assert process.returncode == 0, f"{who} failed:\n{output[-4000:]}"
    return output


# -- in a pooled world -------------------------------------------------------------------------


def _run_script(rank: int, world_size: int, path: str, args: list[str]) -> str:
    """One rank of `python path *args` (a world of 1) or of its torchrun launch, run as
    `__main__` in this pooled rank; what it printed, stdout and stderr together as the
    launcher's merged pipe had them.

    The harness sets each case's environment and folder anew (so changing them here lasts one
    case), seeds it anew and leaves no process group behind; what the script changes in sys is
    put back here. Each copy has its own common.py beside it, so a `common` cached by the other
    copy (or an earlier case) is dropped before and after the run."""
    if world_size == 1:
        for name in [n for n in os.environ if n in TORCHRUN_ENV or n.startswith("TORCHELASTIC_")]:
            del os.environ[name]
    os.environ["OMP_NUM_THREADS"] = "1"
    folder = os.path.dirname(path)
    os.chdir(folder)
    saved_path, saved_argv = list(sys.path), sys.argv
    sys.path.insert(0, folder)
    sys.argv = [path, *args]
    sys.modules.pop("common", None)
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (0, None):
            tail = output.getvalue()[-4000:]
            raise AssertionError(f"rank {rank} exited with {stop.code}:\n{tail}") from None
    except Exception as error:
        raise AssertionError(f"rank {rank} raised:\n{output.getvalue()[-4000:]}") from error
    finally:
        sys.path[:], sys.argv = saved_path, saved_argv
        sys.modules.pop("common", None)
    return output.getvalue()


def _one_copy_a_rank(rank: int, world_size: int, runs: list[tuple[str, list[str]]]) -> str:
    """Rank r of a world of 2 runs copy r as `python script.py` alone (a world of 1 as far as
    the script can tell): the two 1-process runs side by side, one a core, as when launched."""
    path, args = runs[rank]
    return _run_script(0, 1, path, args)


def _pooled_alone(copies: dict[str, Path], args: list[str], who: dict[str, str]) -> dict:
    """Each copy's output on 1 process, the two run at once in a pooled world of 2."""
    runs = [(str(path), _arguments(path, args)) for path in copies.values()]
    try:
        outputs = run_ranks(_one_copy_a_rank, 2, runs, timeout=TIMEOUT_S)
    except (AssertionError, TimeoutError) as error:
        raise AssertionError(f"{' / '.join(who.values())} failed: {error}") from None
    return dict(zip(copies, outputs, strict=True))


def _pooled_output(path: Path, processes: int, args: list[str], who: str) -> str:
    """What every rank printed, rank by rank, once the run succeeded on all of them. Only the
    main process prints metric lines (`accelerator.print`); a copy that printed some on rank 1
    too would differ, as it did in torchrun's merged output."""
    args = _arguments(path, args)
    try:
        outputs = run_ranks(_run_script, processes, str(path), args, timeout=TIMEOUT_S)
    except (AssertionError, TimeoutError) as error:
        raise AssertionError(f"{who} failed: {error}") from None
    return "\n".join(outputs)


# -- the cases ---------------------------------------------------------------------------------


def _metric_lines(output: str, who: str) -> list[str]:
    lines = [line for line in output.splitlines() if line.startswith("METRIC ")]
    assert lines, f"{who} printed no metrics:\n{output[-4000:]}"
    return lines


def run_both(script: str, processes: int, tmp_path: Path) -> list[tuple[list[str], list[str]]]:
    """Each invocation's metric lines under accelerate and under retarget: a LAUNCHED script's
    two launches side by side; any other's in the pooled worlds, on 1 process side by side (a
    rank each), on 2 one after the other."""
    copies = {
        "accelerate": _copy(script, tmp_path / "accelerate", swap=False),
        "retarget": _copy(script, tmp_path / "retarget", swap=True),
    }
    results = []
    for args in INVOCATIONS[script]:
        case = f"{script} {' '.join(args)} on {processes} process(es)"
        who = {lib: f"{lib}: {case}" for lib in copies}
        if script in LAUNCHED:
            runs = {lib: _start(path, processes, args) for lib, path in copies.items()}
            outputs = {lib: _launched_output(run, who[lib]) for lib, run in runs.items()}
        elif processes == 1:
            outputs = _pooled_alone(copies, args, who)
        else:
            outputs = {
                lib: _pooled_output(path, processes, args, who[lib]) for lib, path in copies.items()
            }
        results.append(tuple(_metric_lines(outputs[lib], who[lib]) for lib in copies))
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
