"""Accelerate's checkpoints in retarget: a folder written by accelerate 1.15's save_state loads
into retarget.Accelerator and the run continues to Accelerate's own final weights; pickles
holding more than tensors and plain data are refused."""

from __future__ import annotations

import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from retarget import Accelerator
from retarget.runtime.state.accelerate_folder import UnsafeCheckpointFileError
from retarget.runtime.state.folder import CheckpointError

SCRIPTS = Path(__file__).resolve().parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from accelerate_resume_run import Counter, batches, make_training, train  # noqa: E402

STEPS, SAVE_AT = 8, 3


def _write(tmp_path: Path, safe: bool) -> tuple[Path, dict]:
    """Run the Accelerate script in its own process: its checkpoint and its final state."""
    folder, final = tmp_path / "checkpoint", tmp_path / "final.pt"
    subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "accelerate_resume_writer.py"),
            f"--checkpoint={folder}",
            f"--final={final}",
            f"--steps={STEPS}",
            f"--save-at={SAVE_AT}",
            f"--safe={int(safe)}",
        ],
        check=True,
        timeout=300,
    )
    return folder, torch.load(final, weights_only=True)


def _resume(folder: Path):
    torch.manual_seed(99)  # another initialisation: everything must come from the checkpoint
    model, optimizer, scheduler = make_training()
    accelerator = Accelerator()
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    resumed = accelerator.load_state(folder)
    return accelerator, model, optimizer, scheduler, counter, resumed


@pytest.fixture(scope="module")
def safetensors_run(tmp_path_factory) -> tuple[Path, dict]:
    return _write(tmp_path_factory.mktemp("accelerate"), True)


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pytorch_model.bin"])
def test_accelerate_checkpoint_continues_to_accelerate_final_weights(
    tmp_path, safe, safetensors_run
):
    folder, expected = safetensors_run if safe else _write(tmp_path, safe)
    assert (folder / ("model.safetensors" if safe else "pytorch_model.bin")).is_file()
    accelerator, model, optimizer, scheduler, counter, resumed = _resume(folder)
    assert resumed.step == accelerator.step == SAVE_AT and counter.n == SAVE_AT
    assert scheduler.get_last_lr() == [1e-2 * 0.5]  # StepLR after 3 steps of size 2
    assert [random.random(), float(np.random.rand())] == expected["drawn"]
    train(accelerator, model, optimizer, scheduler, counter, batches(STEPS)[SAVE_AT:])
    got = accelerator.unwrap_model(model).state_dict()
    torch.testing.assert_close(got, expected["weights"], rtol=0, atol=0)
    assert counter.n == expected["counter"] and accelerator.step == expected["step"]


def test_resume_without_the_checkpoint_differs(safetensors_run):
    """The comparison above can fail: skipping load_state ends elsewhere."""
    _, expected = safetensors_run
    torch.manual_seed(0)
    model, optimizer, scheduler = make_training()
    accelerator = Accelerator()
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    train(accelerator, model, optimizer, scheduler, Counter(), batches(STEPS)[SAVE_AT:])
    got = accelerator.unwrap_model(model).state_dict()
    assert not torch.equal(got["0.weight"], expected["weights"]["0.weight"])


class _Payload:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_pickles_with_other_types_are_refused(tmp_path, safetensors_run):
    folder = shutil.copytree(safetensors_run[0], tmp_path / "copy")
    (folder / "scheduler.bin").write_bytes(pickle.dumps({"last_epoch": 3, "x": _Payload()}))
    with pytest.raises(UnsafeCheckpointFileError, match=r"scheduler\.bin holds builtins\.print"):
        _resume(folder)
    torch.save({"n": 1, "total": torch.zeros(()), "c": Counter()}, folder / "scheduler.bin")
    with pytest.raises(UnsafeCheckpointFileError, match=r"scheduler\.bin holds .*Counter"):
        _resume(folder)


def test_other_objects_than_saved_are_refused(safetensors_run):
    folder, _ = safetensors_run
    model, optimizer, _ = make_training()
    accelerator = Accelerator()
    model, optimizer = accelerator.prepare(model, optimizer)  # no scheduler, no counter
    with pytest.raises(CheckpointError, match="schedulers: saved 1, given 0"):
        accelerator.load_state(folder)
