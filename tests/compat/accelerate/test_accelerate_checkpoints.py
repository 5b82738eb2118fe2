"""Accelerate's checkpoints in retarget: a folder written by accelerate 1.15's save_state loads
into retarget.Accelerator and the run continues to Accelerate's own final weights; pickles
holding more than tensors and plain data are refused."""

from __future__ import annotations

import json
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
from retarget.compat.accelerate.checkpoint_folder import UnsafeCheckpointFileError
from retarget.runtime.state.folder import CheckpointError
from tests.distributed import free_port, run_ranks
from tests.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
from accelerate_resume_run import Counter, batches, make_training, train  # noqa: E402

from tests.paths import SCRIPTS

STEPS, SAVE_AT = 8, 3


def _write(tmp_path: Path, safe: bool, processes: int = 1) -> tuple[Path, dict]:
    """Run the Accelerate script in its own process(es), under torchrun for several: its
    checkpoint and its final state (rank 0's; all ranks' under "ranks")."""
    folder, final = tmp_path / "checkpoint", tmp_path / "final_{rank}.pt"
    launcher = [sys.executable]
    if processes > 1:
        launcher += [
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={processes}",
            f"--master_port={free_port()}",
        ]
    subprocess.run(
        [
            *launcher,
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
    ranks = [torch.load(str(final).format(rank=r), weights_only=True) for r in range(processes)]
    return folder, {**ranks[0], "ranks": ranks}


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


@pytest.mark.distributed
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


def _resume_ranks(rank: int, world: int, folder: str) -> dict:
    accelerator, model, optimizer, scheduler, counter, resumed = _resume(Path(folder))
    drawn = [random.random(), float(np.random.rand())]
    data = batches(STEPS, rank)[SAVE_AT:]
    train(accelerator, model, optimizer, scheduler, counter, data)
    weights = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return {
        "weights": weights,
        "drawn": drawn,
        "step": resumed.step,
        "counter": counter.n,
        "target": str(accelerator.target),
    }


@pytest.mark.distributed
def test_a_two_process_accelerate_checkpoint_continues_on_two_ranks(tmp_path):
    """DDP over gloo under Accelerate (torchrun, cpu=True), continued under retarget's ddp:
    each rank takes its own random_states file; the final weights are Accelerate's."""
    folder, expected = _write(tmp_path, True, processes=2)
    assert sorted(p.name for p in folder.glob("random_states_*")) == [
        "random_states_0.pkl",
        "random_states_1.pkl",
    ]
    results = run_ranks(_resume_ranks, 2, str(folder), timeout=240)
    for rank, (got, theirs) in enumerate(zip(results, expected["ranks"], strict=True)):
        assert got["drawn"] == theirs["drawn"], rank  # this rank's own RNG file
        assert got["step"] == SAVE_AT and got["counter"] == theirs["counter"]
        torch.testing.assert_close(got["weights"], theirs["weights"], rtol=0, atol=0)
    assert results[0]["target"] == "ddp"
    assert results[0]["drawn"] != results[1]["drawn"]  # seeded per process by the writer


@pytest.mark.distributed
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


@pytest.mark.distributed
def test_pickles_with_other_types_are_refused(tmp_path, safetensors_run):
    folder = shutil.copytree(safetensors_run[0], tmp_path / "copy")
    (folder / "scheduler.bin").write_bytes(pickle.dumps({"last_epoch": 3, "x": _Payload()}))
    with pytest.raises(UnsafeCheckpointFileError, match=r"scheduler\.bin holds builtins\.print"):
        _resume(folder)
    torch.save({"n": 1, "total": torch.zeros(()), "c": Counter()}, folder / "scheduler.bin")
    with pytest.raises(UnsafeCheckpointFileError, match=r"scheduler\.bin holds .*Counter"):
        _resume(folder)


@pytest.mark.distributed
def test_other_objects_than_saved_are_refused(safetensors_run):
    folder, _ = safetensors_run
    model, optimizer, _ = make_training()
    accelerator = Accelerator()
    model, optimizer = accelerator.prepare(model, optimizer)  # no scheduler, no counter
    with pytest.raises(CheckpointError, match="schedulers: saved 1, given 0"):
        accelerator.load_state(folder)


# ---------------------------------------------------------------- save_model's files


def _big_in_the_middle() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.Linear(64, 64), torch.nn.Linear(8, 8)
    )


def _tied() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 16)
    )
    model[2].weight = model[0].weight
    return model


def _files(folder: Path) -> dict[str, object]:
    """Every file of a save_model folder: its name and what it holds."""
    from safetensors.torch import load_file

    found: dict[str, object] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix == ".json":
            found[path.name] = path.read_text()
        elif path.suffix == ".safetensors":
            found[path.name] = load_file(path)
        else:
            found[path.name] = torch.load(path, weights_only=True)
    return found


@pytest.mark.parametrize(
    ("make", "max_shard_size", "safe"),
    [
        (_big_in_the_middle, "10GB", True),  # one file: model.safetensors, no index
        (_big_in_the_middle, "10GB", False),  # pytorch_model.bin
        (_big_in_the_middle, 1000, True),  # the 16 KB weight alone, before the shard filling
        (_big_in_the_middle, 1000, False),
        (_big_in_the_middle, "20KB", True),
        (_tied, "10GB", True),  # the tied copy dropped
        (_tied, 600, True),
    ],
)
def test_save_model_writes_the_files_accelerate_writes(tmp_path, make, max_shard_size, safe):
    import accelerate

    ours, theirs = tmp_path / "retarget", tmp_path / "accelerate"
    Accelerator().save_model(make(), ours, max_shard_size=max_shard_size, safe_serialization=safe)
    accelerate.Accelerator(cpu=True).save_model(
        make(), theirs, max_shard_size=max_shard_size, safe_serialization=safe
    )
    expected = _files(theirs)
    got = _files(ours)
    if make is _tied and len(got) > 1:  # our index also records the tie, for load_model
        index = json.loads(got.pop("model.safetensors.index.json"))
        assert index["metadata"].pop("tied_weights") == {"2.weight": "0.weight"}
        assert index == json.loads(expected.pop("model.safetensors.index.json"))
    assert list(got) == list(expected)
    for name, held in expected.items():
        if isinstance(held, dict):
            torch.testing.assert_close(got[name], held, rtol=0, atol=0)
        else:
            assert got[name] == held, name


# ---------------------------------------------------------------- the other files


@pytest.mark.distributed
def test_loss_scaler_rng_file_and_samplers(tmp_path, safetensors_run):
    """scaler.pt as accelerate's own save_accelerator_state writes it (Accelerate makes no
    GradScaler on the CPU, so its Accelerator cannot be the writer here); sampler files are
    skipped with a warning; this process's random_states file must be there."""
    from accelerate import PartialState
    from accelerate.checkpointing import save_accelerator_state

    PartialState(cpu=True)  # accelerate's logging needs its state
    folder = shutil.copytree(safetensors_run[0], tmp_path / "copy")
    model, optimizer, scheduler = make_training()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=7)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    scaler._growth_tracker.fill_(5)
    save_accelerator_state(str(folder), [], [], [], [], 0, 0, scaler=scaler)
    (folder / "random_states_0.pkl").write_bytes(
        (safetensors_run[0] / "random_states_0.pkl").read_bytes()
    )
    (folder / "sampler.bin").write_bytes(b"never read")

    accelerator = Accelerator(mixed_precision="fp16")
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    accelerator.prepare(model, optimizer, scheduler)
    with pytest.warns(UserWarning, match=r"sampler\.bin not loaded"):
        accelerator.load_state(folder)
    loss_scaler = accelerator._runtimes()[0].scaler
    assert loss_scaler.grad_scaler.state_dict() == scaler.state_dict()
    assert counter.n == SAVE_AT

    (folder / "random_states_0.pkl").rename(folder / "random_states_1.pkl")
    with pytest.raises(CheckpointError, match="has no random_states_0.pkl"):
        accelerator.load_state(folder)


@pytest.mark.distributed
def test_fsdp_targets_are_refused(safetensors_run):
    model, optimizer, scheduler = make_training()
    accelerator = Accelerator(target="fsdp")
    accelerator.register_for_checkpointing(Counter())
    accelerator.prepare(model, optimizer, scheduler)
    with pytest.raises(NotImplementedError, match="holds full parameters"):
        accelerator.load_state(safetensors_run[0])
