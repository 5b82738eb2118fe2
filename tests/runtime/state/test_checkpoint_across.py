"""A checkpoint meets a run unlike the one that saved it: another target (loads, DCP reshards),
another number of processes (refused, or resharded with reshard=True), another model (refused
naming the tensors, before DCP's planner fails deep inside)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import retarget
from retarget.execution.process import ProcessState
from retarget.runtime.state.checkpoint import load_state, save_state
from retarget.runtime.state.folder import CheckpointError
from retarget.runtime.state.save_model import get_state_dict
from tests.distributed import run_ranks


def _build(target: str, width: int = 4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.Linear(16, width)
    )
    compiled = retarget.compile_for(model, target, example_inputs=(torch.randn(2, 8),))
    return compiled, torch.optim.AdamW(compiled.parameters(), lr=0.05)


def _step(model, opt, step: int, rank: int) -> None:
    data = torch.Generator().manual_seed(100 * step + rank)
    model(torch.randn(4, 8, generator=data)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _full(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in get_state_dict(model).items()}


def _save_then_continue(rank: int, world: int, folder: str, target: str) -> dict | None:
    """Two steps, a save, a third step: the weights after the third step (rank 0)."""
    ProcessState.current()
    model, opt = _build(target)
    for step in range(2):
        _step(model, opt, step, rank)
    save_state(folder, model=model, optimizers=[opt], step=2)
    saved = _full(model)
    _step(model, opt, 2, rank)
    after = _full(model)  # a collective under FSDP: every rank gathers
    return {"saved": saved, "next": after} if rank == 0 else None


def _load_then_continue(rank: int, world: int, folder: str, target: str) -> dict | None:
    ProcessState.current()
    model, opt = _build(target)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        point = load_state(folder, model=model, optimizers=[opt], reshard=world == 1)
    loaded = _full(model)
    _step(model, opt, 2, rank)
    after = _full(model)
    if rank != 0:
        return None
    return {"loaded": loaded, "next": after, "step": point.step, "warned": caught}


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("across")
    return root, {
        target: run_ranks(_save_then_continue, 2, str(root / target), target, timeout=240)[0]
        for target in ("ddp", "fsdp")
    }


@pytest.mark.distributed
@pytest.mark.parametrize(("saved_by", "loaded_by"), [("ddp", "fsdp"), ("fsdp", "ddp")])
def test_a_checkpoint_of_another_target_loads_model_and_optimizer(saved_runs, saved_by, loaded_by):
    root, saved = saved_runs
    got = run_ranks(_load_then_continue, 2, str(root / saved_by), loaded_by, timeout=240)[0]
    expected = saved[saved_by]
    assert got["step"] == 2
    for key, value in expected["saved"].items():
        assert torch.equal(value, got["loaded"][key]), key
    # The next step matches the saving run's only if the AdamW moments and step count came
    # along (a fresh optimizer's first step is several times larger).
    for key, value in expected["next"].items():
        torch.testing.assert_close(got["next"][key], value, rtol=1e-6, atol=1e-7, msg=key)


@pytest.mark.distributed
@pytest.mark.parametrize("saved_by", ["ddp", "fsdp"])
def test_another_number_of_processes_loads_with_reshard_and_warns(saved_runs, saved_by):
    root, saved = saved_runs
    got = run_ranks(_load_then_continue, 1, str(root / saved_by), "single", timeout=240)[0]
    for key, value in saved[saved_by]["saved"].items():
        assert torch.equal(value, got["loaded"][key]), key
    messages = [str(w.message) for w in got["warned"]]
    assert any("saved by 2 processes and this run has 1" in m for m in messages), messages


@pytest.mark.distributed
def test_another_number_of_processes_without_reshard_says_what_to_do(saved_runs):
    root, _ = saved_runs
    model, opt = _build("single")
    with pytest.raises(CheckpointError, match=r"checkpoint of 2 processes.*reshard=True"):
        load_state(root / "ddp", model=model, optimizers=[opt])


@pytest.mark.parametrize(
    ("width", "extra", "message"),
    [
        (5, False, r"other shapes \(models/0/model/3.bias saved \[4\], here \[5\]"),
        (4, True, r"not in the checkpoint: models/0/model/4.bias"),
    ],
)
def test_a_checkpoint_of_another_model_is_refused_naming_the_tensors(
    tmp_path, width, extra, message
):
    model, opt = _build("single")
    _step(model, opt, 0, 0)
    save_state(tmp_path / "ck", model=model, optimizers=[opt], step=1)
    other, other_opt = _build("single", width)
    if extra:
        other = torch.nn.Sequential(*other.unwrap(), torch.nn.Linear(4, 4))
        other_opt = torch.optim.AdamW(other.parameters())
    _step(other, other_opt, 0, 0)
    with pytest.raises(CheckpointError, match=message):
        load_state(tmp_path / "ck", model=other, optimizers=[other_opt])


def test_the_folder_is_named_in_every_refusal(tmp_path):
    model, opt = _build("single")
    save_state(tmp_path / "ck", model=model, step=0)
    other, _ = _build("single", 6)
    with pytest.raises(CheckpointError) as caught:
        load_state(tmp_path / "ck", model=other)
    assert str(caught.value).startswith(str(Path(tmp_path / "ck")))
