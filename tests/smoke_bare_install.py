"""Smoke test of an install with no extras: `pip install .` into a fresh venv, then
`python tests/smoke_bare_install.py` with that venv's python (.ci/run does both).

It exercises the features every user gets (compile_for and a training step, Accelerator
checkpoints, `retarget inspect`), so a module they import that `[project] dependencies` does not
declare fails here with ModuleNotFoundError instead of on a user's machine. The file name keeps
pytest from collecting it: the test environment has every extra installed, which is what hides a
missing dependency.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import retarget
from retarget.models import synthetic_batch, tiny_lm

#: `retarget inspect` imports this file by module name, from its own directory.
INPUTS = f"{Path(__file__).stem}:example_inputs"


def example_inputs() -> dict[str, torch.Tensor]:
    """One fixed batch for the built-in model (also `retarget inspect --inputs`)."""
    return synthetic_batch(tiny_lm().config, generator=torch.Generator().manual_seed(0))


def check_installed_copy() -> None:
    """The copy under test is the venv's, not a checkout on the path."""
    installed = Path(retarget.__file__).resolve()
    if not installed.is_relative_to(Path(sys.prefix).resolve()):
        raise AssertionError(f"retarget imported from {installed}, not from the venv {sys.prefix}")


def check_compile_and_train() -> None:
    """compile_for on the built-in model for bf16+ac, then one optimizer step."""
    torch.manual_seed(0)
    compiled = retarget.compile_for(tiny_lm(), "bf16+ac", example_inputs=example_inputs())
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in compiled.parameters()]
    loss = compiled(**example_inputs())["loss"]
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss), f"loss is {loss.item()}"
    assert any(not torch.equal(b, p) for b, p in zip(before, compiled.parameters(), strict=True)), (
        "the optimizer step changed no weight"
    )


def check_accelerator_state(folder: Path) -> None:
    """Accelerator save_state, weights changed, load_state restores them (needs safetensors)."""
    torch.manual_seed(0)
    accelerator = retarget.Accelerator()
    model = tiny_lm()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    saved = {name: p.detach().clone() for name, p in model.named_parameters()}
    accelerator.save_state(folder)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    accelerator.load_state(folder)
    for name, p in model.named_parameters():
        assert torch.equal(p, saved[name]), f"load_state did not restore {name}"


def check_utils(folder: Path) -> None:
    """retarget.utils imports with no extras; save_model writes Accelerate's single file."""
    from retarget.utils import find_executable_batch_size, set_seed

    set_seed(0)

    @find_executable_batch_size(starting_batch_size=4)
    def fits(batch_size: int) -> int:
        if batch_size > 2:
            torch.empty(2**46, dtype=torch.uint8)  # the CPU allocator's out-of-memory error
        return batch_size

    assert fits() == 2, "find_executable_batch_size did not shrink the batch"
    retarget.Accelerator().save_model(tiny_lm(), folder)
    assert (folder / "model.safetensors").is_file(), sorted(p.name for p in folder.iterdir())


def check_inspect_text() -> None:
    """`retarget inspect` (the venv's console script) prints the pipeline's passes."""
    command = Path(sys.executable).parent / "retarget"
    result = subprocess.run(
        [str(command), "inspect", "retarget.models:tiny_lm", "--target", "bf16+ac"]
        + ["--inputs", INPUTS],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    for name in ("capture_regions", "insert_autocast", "checkpoint_blocks"):
        assert name in result.stdout, f"`retarget inspect` names no {name}:\n{result.stdout}"


def check_trackers(folder: Path) -> None:
    """log_with="all" is the JSON lines tracker alone; wandb is refused with what to install."""
    accelerator = retarget.Accelerator(log_with="all", project_dir=folder)
    accelerator.init_trackers("run", config={"lr": 0.1})
    accelerator.log({"loss": 1.0}, step=1)
    accelerator.end_training()
    assert accelerator.log_with == ["jsonl"], accelerator.log_with
    assert (folder / "run" / "log.jsonl").read_text().count("\n") == 1
    try:
        retarget.Accelerator(log_with="wandb")
    except ValueError as err:
        assert "pip install 'retarget[trackers]'" in str(err), err
    else:
        raise AssertionError("log_with='wandb' was accepted without the wandb package")


def main() -> None:
    check_installed_copy()
    check_compile_and_train()
    with tempfile.TemporaryDirectory() as folder:
        check_accelerator_state(Path(folder) / "state")
        check_utils(Path(folder) / "weights")
        check_trackers(Path(folder) / "logs")
    check_inspect_text()
    print(f"bare install smoke: ok (retarget {retarget.__version__}, torch {torch.__version__})")


if __name__ == "__main__":
    main()
