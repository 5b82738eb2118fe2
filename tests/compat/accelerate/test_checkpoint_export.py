"""The way back to Accelerate: a retarget checkpoint, converted with `retarget convert-checkpoint`,
loads into accelerate 1.15's own Accelerator, which continues to retarget's final weights bit
for bit (1 process, and 2 under DDP over gloo); what has no place in Accelerate's layout is
refused by name before anything is written."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from retarget import Accelerator
from retarget.compat.accelerate.checkpoint_export import write_accelerate_checkpoint
from retarget.compat.accelerate.utils import set_seed
from retarget.runtime.state.folder import CheckpointError
from tests.distributed import free_port, run_ranks
from tests.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
from accelerate_resume_run import Counter, batches, make_training, train  # noqa: E402

STEPS, SAVE_AT = 8, 3


def _retarget_run(rank: int, world: int, folder: str) -> dict:
    """Train under retarget's Accelerator, save_state at SAVE_AT, go on to STEPS."""
    accelerator = Accelerator(cpu=True)
    set_seed(0, device_specific=True)
    model, optimizer, scheduler = make_training()
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    data = batches(STEPS, rank)
    train(accelerator, model, optimizer, scheduler, counter, data[:SAVE_AT])
    accelerator.save_state(folder)
    drawn = [random.random(), float(np.random.rand())]
    train(accelerator, model, optimizer, scheduler, counter, data[SAVE_AT:])
    weights = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return {"weights": weights, "drawn": drawn, "counter": counter.n, "step": accelerator.step}


def _accelerate_resume(converted: Path, final: Path, processes: int) -> list[dict]:
    """accelerate.Accelerator loads `converted` and trains to STEPS, in its own process(es)."""
    launcher = [sys.executable]
    if processes > 1:
        launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={processes}"]
        launcher += [f"--master_port={free_port()}"]
    subprocess.run(
        [
            *launcher,
            str(SCRIPTS / "accelerate_resume_writer.py"),
            f"--resume={converted}",
            f"--final={final}",
            f"--steps={STEPS}",
            f"--save-at={SAVE_AT}",
        ],
        check=True,
        timeout=300,
    )
    return [torch.load(str(final).format(rank=r), weights_only=True) for r in range(processes)]


def _convert(source: Path, destination: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "retarget", "convert-checkpoint", str(source), str(destination)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _assert_continues(ours: list[dict], theirs: list[dict]) -> None:
    for rank, (got, expected) in enumerate(zip(theirs, ours, strict=True)):
        assert got["drawn"] == expected["drawn"], rank  # the rank's own RNG file
        assert got["counter"] == expected["counter"] and got["step"] == expected["step"]
        torch.testing.assert_close(got["weights"], expected["weights"], rtol=0, atol=0)


@pytest.mark.distributed
def test_one_process_checkpoint_continues_under_accelerate(tmp_path):
    ours = [_retarget_run(0, 1, str(tmp_path / "ours"))]
    printed = _convert(tmp_path / "ours", tmp_path / "theirs")
    assert "model.safetensors, optimizer.bin, scheduler.bin, custom_checkpoint_0.pkl" in printed
    assert "random_states_0.pkl" in printed
    theirs = _accelerate_resume(tmp_path / "theirs", tmp_path / "final_{rank}.pt", 1)
    _assert_continues(ours, theirs)


@pytest.mark.distributed
def test_two_process_checkpoint_continues_under_accelerate_ddp(tmp_path):
    ours = run_ranks(_retarget_run, 2, str(tmp_path / "ours"), timeout=240)
    _convert(tmp_path / "ours", tmp_path / "theirs")
    assert sorted(p.name for p in (tmp_path / "theirs").glob("random_states_*")) == [
        "random_states_0.pkl",
        "random_states_1.pkl",
    ]
    theirs = _accelerate_resume(tmp_path / "theirs", tmp_path / "final_{rank}.pt", 2)
    _assert_continues(ours, theirs)
    assert ours[0]["drawn"] != ours[1]["drawn"]  # seeded per process: the files are not alike


def _saved(tmp_path: Path, optimizers: int, steps: int) -> Path:
    """A one-process checkpoint of a model with `optimizers` optimizers after `steps` steps."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    accelerator = Accelerator(cpu=True)
    groups = [model[i].parameters() for i in range(2)] if optimizers == 2 else [model.parameters()]
    opts = [torch.optim.SGD(params, lr=0.1) for params in groups]
    model, *opts = accelerator.prepare(model, *opts)
    for _ in range(steps):
        accelerator.backward(model(torch.ones(2, 4)).sum())
        for opt in opts:
            opt.step()
    folder = tmp_path / f"saved_{optimizers}_{steps}"
    accelerator.save_state(folder)
    return folder


@pytest.mark.distributed
@pytest.mark.distributed
def test_an_optimizer_without_state_is_written_with_its_hyperparameters(tmp_path):
    """Plain SGD (no momentum) keeps no state; Accelerate's optimizer.bin still needs its
    param groups, which load_state_dict checks against the live optimizer."""
    written = write_accelerate_checkpoint(_saved(tmp_path, 1, 1), tmp_path / "out")
    assert "optimizer.bin" in written.written
    saved = torch.load(tmp_path / "out" / "optimizer.bin", weights_only=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    optimizer.load_state_dict(saved)
    assert saved["state"] == {} and optimizer.param_groups[0]["lr"] == 0.1
    assert saved["param_groups"][0]["params"] == [0, 1, 2, 3]


def test_what_has_no_place_in_accelerate_is_refused_before_writing(tmp_path):
    with pytest.raises(CheckpointError, match="model 0 has 2 optimizers"):
        write_accelerate_checkpoint(_saved(tmp_path, 2, 1), tmp_path / "two")
    assert not (tmp_path / "two").exists()
    stepped = _saved(tmp_path, 1, 1)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="exists and is not an empty folder"):
        write_accelerate_checkpoint(stepped, tmp_path / "full")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["notes.txt"]
    with pytest.raises(
        CheckpointError, match="no checkpoint at .*missing; complete checkpoints next to it"
    ):
        write_accelerate_checkpoint(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    assert "model.safetensors" in write_accelerate_checkpoint(stepped, tmp_path / "empty").written
    assert not list(tmp_path.glob(".empty.*"))  # the staging folder became the result


def _fsdp_saved(rank: int, world: int, folder: str) -> dict:
    """A tiny Llama sharded by FSDP2 over 2 ranks, one AdamW step, save_state (each rank writes
    its shards); rank 0 returns the whole model and optimizer state at the save."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from retarget.runtime.state.checkpoint import save_state
    from tests.zoo import lm_inputs, tiny_llama

    model = tiny_llama()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(**lm_inputs(2)).loss.backward()
    optimizer.step()
    save_state(folder, model=model, optimizers=optimizer, step=1)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights, optim = get_state_dict(model, optimizer, options=full)  # empty on rank 1
    if rank != 0:
        return {}
    order = [name for group in optim["param_groups"] for name in group["params"]]
    return {"weights": weights, "state": optim["state"], "order": order}


@pytest.mark.distributed
def test_fsdp_shards_are_joined_into_accelerate_s_whole_files(tmp_path):
    from safetensors.torch import load_file

    (whole, _) = run_ranks(_fsdp_saved, 2, str(tmp_path / "ours"), timeout=240)
    write_accelerate_checkpoint(tmp_path / "ours", tmp_path / "theirs")
    weights = load_file(tmp_path / "theirs" / "model.safetensors")
    torch.testing.assert_close(weights, whole["weights"], rtol=0, atol=0)
    optimizer = torch.load(tmp_path / "theirs" / "optimizer.bin", weights_only=True)
    assert optimizer["param_groups"][0]["params"] == list(range(len(whole["order"])))
    for position, name in enumerate(whole["order"]):
        torch.testing.assert_close(
            optimizer["state"][position], whole["state"][name], rtol=0, atol=0
        )
    assert sorted(p.name for p in (tmp_path / "theirs").glob("random_states_*")) == [
        "random_states_0.pkl",
        "random_states_1.pkl",
    ]
