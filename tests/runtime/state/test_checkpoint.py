"""save_state / load_state: a resumed run repeats the uninterrupted one bit for bit.

Resume: a tiny Llama with attention dropout trains 6 steps on a shuffled loader, saving at step
3 (mid-epoch; an epoch is 4 batches), under a single process, DDP and FSDP2 (2 gloo ranks). A
fresh process loads the checkpoint and trains steps 4-6: losses and final weights must equal
the uninterrupted run's exactly. The step also draws from Python's and NumPy's generators (a
token swap), uses a loss scaler whose scale changes, an LR schedule and a registered counter,
so every piece of saved state is needed for the equality.

Fault: a process killed (SIGKILL) in the middle of save_state leaves the previous checkpoint
loadable and the half-written one refused.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from retarget.execution.process import ProcessState
from retarget.runtime.data.resumable_loader import ResumableLoader
from retarget.runtime.scaler import LossScaler
from retarget.runtime.state.checkpoint import (
    CheckpointRegistry,
    NotCheckpointableError,
    ProjectConfig,
    load_state,
    numbered_checkpoints,
    save_state,
)
from retarget.runtime.state.codec import UnsupportedStateError
from retarget.runtime.state.folder import CheckpointError, IncompleteCheckpointError
from retarget.runtime.state.save_model import get_state_dict
from tests.distributed import run_ranks

# tests.zoo (and transformers) are imported where a model is built: the killed child of the
# fault test starts faster without them.

STEPS, SAVE_AT, BATCH = 6, 3, 2


class Counter:
    """A registered object: counts the steps it has seen."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def _llama_with_dropout():
    from transformers import LlamaForCausalLM

    from tests.zoo import tiny_llama

    config = tiny_llama().config
    config.attention_dropout = 0.1
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


def _setup(mode: str, rank: int, world: int):
    """Model, optimizer, schedule, loader, scaler, registry: all as a fresh process builds them."""
    from tests.zoo import SEQ, VOCAB

    model = _llama_with_dropout()
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    tokens = torch.randint(
        0, VOCAB, (4 * BATCH * world, SEQ), generator=torch.Generator().manual_seed(1)
    )
    data = TensorDataset(tokens)
    if world > 1:
        loader = DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, shuffle=True))
    else:  # shuffled from the global torch generator, the hardest case to resume
        loader = DataLoader(data, batch_size=BATCH, shuffle=True)
    # fp32 needs no scaler; one runs under single and DDP to check its state is resumed.
    scaler = None if mode == "fsdp" else LossScaler("cpu", init_scale=2.0**10, growth_interval=2)
    registry = CheckpointRegistry()
    registry.register_for_checkpointing(Counter())
    # Ranks draw different dropout masks and token swaps, as in real training.
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    return model, opt, sched, ResumableLoader(loader), scaler, registry


def _train(mode: str, root: str, phase: str, rank: int, world: int) -> dict:
    from tests.zoo import SEQ, VOCAB

    model, opt, sched, loader, scaler, registry = _setup(mode, rank, world)
    parts = dict(
        model=model,
        optimizers=[opt],
        schedulers=[sched],
        dataloaders=[loader],
        scaler=scaler,
        custom_objects=registry,
    )
    folder = Path(root) / mode
    step, losses = 0, []
    if phase == "resume":
        resumed = load_state(folder, **parts)
        step = resumed.step
        assert resumed.accumulation_step == 1 and resumed.path == folder
        assert next(iter(registry)).count == SAVE_AT
    while step < STEPS:
        for (tokens,) in loader:
            tokens = tokens.clone()
            tokens[0, random.randrange(SEQ)] = int(np.random.randint(VOCAB))  # "augmentation"
            loss = model(input_ids=tokens, labels=tokens).loss
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            sched.step()
            opt.zero_grad(set_to_none=True)
            next(iter(registry)).count += 1
            step += 1
            losses.append(loss.item())
            if phase == "full" and step == SAVE_AT:
                save_state(folder, step=step, accumulation_step=1, **parts)
            if step == STEPS:
                break
    weights = get_state_dict(model)  # full, gathered on rank 0 under FSDP
    # As bytes: tensors sent through run_ranks' queue would share memory with an exited process.
    return {
        "losses": losses,
        "weights": safetensors.torch.save(weights) if rank == 0 else None,
        # A power-of-two loss scale does not change fp32 numerics: compare the scaler itself.
        "scaler": None if scaler is None else scaler.state_dict(),
    }


def _train_modes(rank: int, world: int, modes: tuple, root: str, phase: str) -> dict:
    ProcessState.current()
    return {mode: _train(mode, root, phase, rank, world) for mode in modes}


def _dropout_is_active() -> bool:
    model = _llama_with_dropout()
    tokens = torch.randint(0, 100, (1, 16))
    return model(input_ids=tokens).logits.ne(model(input_ids=tokens).logits).any().item()


def _assert_resumed_exactly(full: dict, resumed: dict, mode: str) -> None:
    assert len(full["losses"]) == STEPS and len(resumed["losses"]) == STEPS - SAVE_AT
    assert resumed["losses"] == full["losses"][SAVE_AT:], mode
    assert resumed["scaler"] == full["scaler"], mode
    if full["weights"] is not None:
        expected = safetensors.torch.load(full["weights"])
        got = safetensors.torch.load(resumed["weights"])
        assert expected.keys() == got.keys() and len(expected) > 10
        for key, value in expected.items():
            assert torch.equal(value, got[key]), f"{mode}: {key} differs"


@pytest.fixture(scope="module")
def ranks_run(tmp_path_factory):
    """DDP and FSDP on 2 ranks: the uninterrupted run, which saved at step 3."""
    root = tmp_path_factory.mktemp("ranks")
    return root, run_ranks(_train_modes, 2, ("ddp", "fsdp"), str(root), "full", timeout=240)


@pytest.mark.distributed
def test_resume_single_process_is_exact(tmp_path):
    assert _dropout_is_active()
    (full,) = run_ranks(_train_modes, 1, ("single",), str(tmp_path), "full")
    (resumed,) = run_ranks(_train_modes, 1, ("single",), str(tmp_path), "resume")
    _assert_resumed_exactly(full["single"], resumed["single"], "single")


@pytest.mark.distributed
def test_resume_ddp_and_fsdp_on_two_ranks_is_exact(ranks_run):
    root, full = ranks_run
    resumed = run_ranks(_train_modes, 2, ("ddp", "fsdp"), str(root), "resume", timeout=240)
    for mode in ("ddp", "fsdp"):
        for rank in range(2):
            _assert_resumed_exactly(full[rank][mode], resumed[rank][mode], f"{mode} rank {rank}")
        # Ranks drew different dropout masks and data: their losses differ.
        assert full[0][mode]["losses"] != full[1][mode]["losses"]
    # FSDP wrote one shard file per rank; DDP's replicated tensors are written once.
    assert sorted(p.name for p in (root / "fsdp" / "model").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]


@pytest.mark.distributed
def test_sharded_checkpoint_of_two_ranks_is_refused_by_one_process(ranks_run):
    root, _ = ranks_run
    model, opt, *_ = _setup("single", 0, 1)
    with pytest.raises(CheckpointError, match=r"sharded \(FSDP\) checkpoint of 2 processes"):
        load_state(root / "fsdp", model=model, optimizers=[opt])


# ------------------------------------------------------------------------------ fault


class StallingState:
    """A registered object whose state_dict signals, then hangs: the save is killed there."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def state_dict(self) -> dict:
        Path(self.marker).touch()
        time.sleep(120)
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _tiny():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _one_step(model, opt) -> None:
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def _save_then_stall(project_dir: str, reference: str, marker: str) -> None:
    torch.set_num_threads(1)
    model, opt = _tiny()
    project = ProjectConfig(project_dir=project_dir)
    _one_step(model, opt)
    save_state(model=model, optimizers=[opt], project=project)
    save_file(model.state_dict(), reference)
    _one_step(model, opt)
    registry = CheckpointRegistry()
    registry.register_for_checkpointing(StallingState(marker))
    save_state(model=model, optimizers=[opt], custom_objects=registry, project=project)


@pytest.mark.distributed
def test_kill_during_save_keeps_the_previous_checkpoint_and_refuses_the_partial_one(tmp_path):
    marker, reference = tmp_path / "stalled", tmp_path / "reference.safetensors"
    child = mp.get_context("spawn").Process(
        target=_save_then_stall, args=(str(tmp_path), str(reference), str(marker))
    )
    child.start()
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert child.is_alive() and time.monotonic() < deadline, "the save never stalled"
        time.sleep(0.05)
    os.kill(child.pid, 9)
    child.join()
    checkpoints = tmp_path / "checkpoints"
    partial = checkpoints / ".checkpoint_1.incomplete"
    assert (partial / "model").is_dir()  # the kill did land in the middle of the save
    project = ProjectConfig(project_dir=tmp_path)
    assert numbered_checkpoints(project) == [checkpoints / "checkpoint_0"]

    model, opt = _tiny()
    resumed = load_state(model=model, optimizers=[opt], project=project)
    assert resumed.path == checkpoints / "checkpoint_0"
    expected = load_file(reference)
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    assert opt.state  # the momentum buffers came back too

    with pytest.raises(IncompleteCheckpointError, match="interrupted before manifest.json"):
        load_state(partial, model=model, optimizers=[opt])
    with pytest.raises(CheckpointError, match="checkpoint_1.incomplete, which is incomplete"):
        load_state(checkpoints / "checkpoint_1", model=model, optimizers=[opt])
    # The next save takes the interrupted one's number and clears its leftovers.
    assert save_state(model=model, optimizers=[opt], project=project).name == "checkpoint_1"
    assert not partial.exists()


def test_sharded_dataloader_resumes_with_the_next_unseen_batch(tmp_path):
    from retarget.runtime.data.sharded_loader import shard_dataloader

    def loader():
        data = TensorDataset(torch.arange(12))
        return shard_dataloader(DataLoader(data, batch_size=3, shuffle=True), ProcessState())

    model, opt = _tiny()
    first = loader()
    batches = iter(first)
    seen = [next(batches)[0].tolist() for _ in range(2)]
    save_state(tmp_path / "c", model=model, dataloaders=[first])
    rest = [b.tolist() for (b,) in batches]
    resumed = loader()
    load_state(tmp_path / "c", model=model, dataloaders=[resumed])
    assert [b.tolist() for (b,) in resumed] == rest and len(rest) == 2
    assert sorted(sum(seen + rest, [])) == list(range(12)) != sum(seen + rest, [])


def test_several_models_each_with_its_optimizers(tmp_path):
    def build():
        (a, opt_a), (b, opt_b) = _tiny(), _tiny()
        return a, b, opt_a, opt_b

    a, b, opt_a, opt_b = build()
    _one_step(a, opt_a)
    _one_step(b, opt_b)
    _one_step(b, opt_b)
    # Optimizers are matched to their model by parameters, whatever order they come in.
    save_state(tmp_path / "c", model=[a, b], optimizers=[opt_b, opt_a])
    a2, b2, opt_a2, opt_b2 = build()
    load_state(tmp_path / "c", model=[a2, b2], optimizers=[opt_b2, opt_a2])
    for before, after in ((a, a2), (b, b2)):
        assert all(
            torch.equal(x, y) for x, y in zip(before.parameters(), after.parameters(), strict=True)
        )
    for before, after in ((opt_a, opt_a2), (opt_b, opt_b2)):
        old, new = before.state_dict()["state"], after.state_dict()["state"]
        assert all(torch.equal(old[k]["momentum_buffer"], new[k]["momentum_buffer"]) for k in old)
    assert not torch.equal(a2[0].weight, b2[0].weight)  # the two were not mixed up


def test_a_stateless_optimizer_resumes_at_its_scheduled_learning_rate(tmp_path, device):
    """Plain SGD keeps no state, so torch's state-dict helpers have nothing to save for it; the
    learning rate a scheduler lowered lives in its param groups and must come back all the same
    (a resume trained at the initial rate, ahead of the uninterrupted run)."""

    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1, device=device)
        opt = torch.optim.SGD(
            [{"params": [model.weight]}, {"params": [model.bias], "lr": 0.2}], lr=0.1
        )
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step(model, opt, sched):
        model(torch.ones(2, 4, device=device)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()

    model, opt, sched = build()
    for _ in range(3):
        step(model, opt, sched)
    save_state(tmp_path / "c", model=model, optimizers=opt, schedulers=sched)
    step(model, opt, sched)
    again, opt2, sched2 = build()
    load_state(tmp_path / "c", model=again, optimizers=opt2, schedulers=sched2)
    assert [g["lr"] for g in opt2.param_groups] == [0.1 * 0.5**3, 0.2 * 0.5**3]
    step(again, opt2, sched2)
    assert torch.equal(again.weight, model.weight) and torch.equal(again.bias, model.bias)
    fresh = build()[0]
    other = torch.optim.SGD(fresh.parameters(), lr=0.1)  # one group, not two
    with pytest.raises(CheckpointError, match=r"param groups hold \[2\] parameters here"):
        load_state(
            tmp_path / "c",
            model=fresh,
            optimizers=other,
            schedulers=torch.optim.lr_scheduler.StepLR(other, step_size=1),
        )


# ------------------------------------------------------------------------------ project, bad input


def test_numbered_checkpoints_respect_total_limit(tmp_path):
    model, opt = _tiny()
    steps = []
    opt.register_step_post_hook(lambda *args: steps.append(1))
    project = ProjectConfig(project_dir=tmp_path, total_limit=2)
    names = [
        save_state(model=model, optimizers=opt, step=i, project=project).name for i in range(4)
    ]
    assert names == ["checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_3"]
    assert [p.name for p in numbered_checkpoints(project)] == ["checkpoint_2", "checkpoint_3"]
    assert load_state(model=model, optimizers=opt, project=project).step == 3
    # Saved before its first step, it was not stepped to be saved and comes back empty.
    assert not steps and not opt.state
    with pytest.raises(ValueError, match="output_dir=.* and automatic checkpoint naming"):
        save_state(tmp_path / "x", model=model, project=project)
    with pytest.raises(ValueError, match="total_limit=0"):
        ProjectConfig(project_dir=tmp_path, total_limit=0)


def test_missing_and_foreign_folders_are_refused(tmp_path):
    model, opt = _tiny()
    with pytest.raises(CheckpointError, match="no checkpoint at .*nowhere"):
        load_state(tmp_path / "nowhere", model=model)
    with pytest.raises(CheckpointError, match="no complete checkpoint under"):
        load_state(model=model, project=ProjectConfig(project_dir=tmp_path))
    foreign = tmp_path / "hf"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    (foreign / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="not a retarget checkpoint.*config.json"):
        load_state(foreign, model=model)


def test_objects_that_cannot_be_saved_are_refused_before_writing(tmp_path):
    model, opt = _tiny()
    registry = CheckpointRegistry()
    with pytest.raises(NotCheckpointableError, match=r"register_for_checkpointing\[0\] .a list."):
        registry.register_for_checkpointing([1, 2])
    loader = DataLoader(TensorDataset(torch.ones(4)))
    with pytest.raises(NotCheckpointableError, match="dataloaders.0. .*ResumableLoader"):
        save_state(tmp_path / "c", model=model, dataloaders=[loader])
    assert not (tmp_path / "c").exists() and not list(tmp_path.iterdir())
    bad = Counter()
    bad.state_dict = lambda: {"fn": print}
    with pytest.raises(UnsupportedStateError, match="'custom_objects/0/fn'.*builtin_function"):
        save_state(tmp_path / "c", model=model, custom_objects=[bad])
    assert not list(tmp_path.iterdir())  # the failed save left nothing behind


def test_load_with_other_objects_than_saved_is_refused(tmp_path):
    model, opt = _tiny()
    save_state(tmp_path / "c", model=model, optimizers=[opt], step=5)
    with pytest.raises(CheckpointError, match=r"optimizers: saved \[1\], given \[0\]"):
        load_state(tmp_path / "c", model=model)
    other = torch.nn.Linear(4, 2)
    with pytest.raises(
        CheckpointError, match="does not match .*not in the checkpoint: models/0/model/bias"
    ):
        load_state(tmp_path / "c", model=other, optimizers=[torch.optim.SGD(other.parameters())])
    stranger = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1)
    with pytest.raises(ValueError, match=r"optimizers\[0\] updates parameters that are not"):
        load_state(tmp_path / "c", model=model, optimizers=[stranger])
