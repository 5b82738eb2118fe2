"""retarget.Accelerator: every member in a world of one, bad input, and Accelerate's tutorial
scripts under `retarget launch --num_processes 2` (only their import line is ours)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retarget import (
    Accelerator,
    AutocastKwargs,
    CompiledModule,
    DistributedDataParallelKwargs,
    DistributedType,
    GradScalerKwargs,
    ProfileKwargs,
    ProjectConfiguration,
)
from retarget.compat.accelerate.kwargs_base import KwargsHandlerError
from retarget.runtime.state.checkpoint import NotCheckpointableError
from retarget.runtime.state.folder import CheckpointError
from tests.paths import REPO
from tests.zoo import bert_inputs, tiny_bert

SCRIPTS = REPO / "tests" / "scripts"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def pairs(n=12, batch_size=4, shuffle=False):
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 4, generator=generator), torch.arange(n) % 2)
    return DataLoader(data, batch_size=batch_size, shuffle=shuffle)


# ------------------------------------------------------------------------------ who and where


def test_process_members_in_a_world_of_one(capsys):
    accelerator = Accelerator()
    assert (accelerator.num_processes, accelerator.process_index) == (1, 0)
    assert accelerator.local_process_index == 0 and accelerator.device == torch.device("cpu")
    assert accelerator.is_main_process and accelerator.is_local_main_process
    assert accelerator.is_last_process and not accelerator.use_distributed
    assert accelerator.distributed_type is DistributedType.NO
    assert accelerator.mixed_precision == "no" and str(accelerator.target) == "single"
    accelerator.print("from main")
    accelerator.wait_for_everyone()
    calls = []
    accelerator.on_main_process(lambda: calls.append("main"))()
    accelerator.on_local_main_process(lambda: calls.append("local"))()
    accelerator.on_last_process(lambda: calls.append("last"))()
    accelerator.on_process(lambda: calls.append("p0"), process_index=0)()
    accelerator.on_process(process_index=1)(lambda: calls.append("p1"))()
    accelerator.on_local_process(local_process_index=0)(lambda: calls.append("l0"))()
    with accelerator.main_process_first(), accelerator.local_main_process_first():
        calls.append("first")
    with accelerator.split_between_processes([1, 2, 3]) as share:
        calls.append(share)
    assert calls == ["main", "local", "last", "p0", "l0", "first", [1, 2, 3]]
    assert capsys.readouterr().out == "from main\n"


def test_target_from_arguments_and_launch(monkeypatch):
    assert str(Accelerator(mixed_precision="bf16").target) == "bf16"
    assert str(Accelerator(target="single", mixed_precision="fp16").target) == "fp16"
    monkeypatch.setenv("RETARGET_TARGET", "bf16")
    accelerator = Accelerator()
    assert str(accelerator.target) == "bf16" and accelerator.target_origin == "$RETARGET_TARGET"
    assert "bf16" in repr(accelerator)


def accelerate_project(**fields):
    """What Accelerate's ProjectConfiguration offers (its own class is not needed here)."""
    defaults = dict(project_dir="p", logging_dir=None, automatic_checkpoint_naming=False)
    defaults.update(total_limit=None, iteration=0, save_on_each_node=False)
    return types.SimpleNamespace(**{**defaults, **fields})


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"rng_types": ["torch"]}, KwargsHandlerError, "rng_types=\\['torch'\\]\\) cannot be"),
        ({"device_placement": False}, KwargsHandlerError, "places the model and every batch"),
        ({"gradient_accumulation_plugin": object()}, KwargsHandlerError, "gradient_accumulation_"),
        ({"log_with": "clearml"}, ValueError, "log_with='clearml' is not supported"),
        ({"log_with": "tensorboard"}, ValueError, "writes files but no logging directory"),
        ({"gradient_accumulation_steps": 0}, ValueError, "must be an integer >= 1"),
        (
            {"mixed_precision": "bf16", "kwargs_handlers": [AutocastKwargs(enabled=False)]},
            KwargsHandlerError,
            "would turn off the bf16 autocast",
        ),
        ({"project_config": accelerate_project(iteration=3)}, KwargsHandlerError, "iteration=3"),
        (
            {"project_config": accelerate_project(save_on_each_node=True)},
            KwargsHandlerError,
            "save_on_each_node=True",
        ),
        ({"no_such_argument": 1}, TypeError, "unexpected argument 'no_such_argument'"),
    ],
)
def test_arguments_that_cannot_be_honoured(kwargs, error, message):
    with pytest.raises(error, match=message):
        Accelerator(**kwargs)


# ------------------------------------------------------------------------------ prepare


def test_prepare_compiles_models_with_a_loader_batch_as_example_inputs():
    accelerator = Accelerator()
    samples = bert_inputs(8)
    rows = [{k: v[i] for k, v in samples.items()} for i in range(8)]
    model, loader = accelerator.prepare(tiny_bert(), DataLoader(rows, batch_size=4))
    assert isinstance(model, CompiledModule)
    report = model.report.to_dict()
    assert report["target"] == "single"
    # fp32 "single" reads no graph: the blocks run their own forward (capture="auto")
    assert not report["lazy"] and report["regions"][0]["frontend"] == "own forward"
    bf16 = Accelerator(mixed_precision="bf16")
    loader16 = DataLoader(rows, batch_size=4)
    report = bf16.prepare(tiny_bert(), loader16)[0].report.to_dict()
    assert not report["lazy"] and report["regions"][0]["frontend"] == "export"
    # (inputs, labels) batches do not say what the model takes: capture waits for the call.
    net = accelerator.prepare(Net(), pairs())[0]
    assert net.report.to_dict()["lazy"]
    assert len(list(loader)) == 2


def test_prepare_returns_one_object_alone_and_refuses_what_it_does_not_know():
    accelerator = Accelerator()
    assert isinstance(accelerator.prepare(Net()), CompiledModule)
    with pytest.raises(TypeError, match="argument 1 is a dict; prepare takes models"):
        accelerator.prepare(Net(), {"lr": 1})
    compiled = accelerator.prepare(Net())
    assert accelerator.prepare(compiled) is compiled
    with pytest.raises(ValueError, match="compiled for 'single' but the Accelerator trains for"):
        Accelerator(mixed_precision="bf16").prepare(compiled)


def test_ddp_settings_and_plugins_in_a_world_of_one_are_planned_and_reported():
    handler = DistributedDataParallelKwargs(comm_hook="bf16", bucket_cap_mb=5)
    accelerator = Accelerator(kwargs_handlers=[handler])
    assert str(accelerator.target) == "ddp[bucket_cap_mb=5]+bf16-comm"
    model = accelerator.prepare(Net())
    assert "plan not applied: world size is 1" in str(model.report)
    fsdp = Accelerator(fsdp_plugin={"reshard_after_forward": False}, mixed_precision="bf16")
    assert str(fsdp.prepare(Net()).program.target) == "zero2+bf16"


def test_fp16_steps_through_the_loss_scaler_and_the_scheduler_follows():
    accelerator = Accelerator(
        mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=2.0**10)]
    )
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, prepared, loader, scheduler = accelerator.prepare(model, optimizer, pairs(), scheduler)
    assert prepared.optimizer is optimizer  # the runtime's loss-scaling wrapper
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "lr_scheduler.step() before optimizer"
        for x, y in loader:
            accelerator.backward(F.cross_entropy(model(x), y))
            prepared.step(), scheduler.step(), prepared.zero_grad()
    assert not accelerator.optimizer_step_was_skipped
    assert scheduler.get_last_lr() == [0.1 * 0.5**3]
    assert model.runtime.scaler.scale_value == 2.0**10


# ------------------------------------------------------------------------------ collectives


def test_collectives_in_a_world_of_one():
    accelerator = Accelerator()
    data = {"a": torch.arange(3), "b": [torch.ones(2)]}
    assert accelerator.gather(data) is data
    assert accelerator.gather_for_metrics(data) is data  # outside a loader's last batch
    assert torch.equal(accelerator.reduce(torch.tensor([2.0]), scale=0.5), torch.tensor([1.0]))
    assert accelerator.pad_across_processes(data, dim=0) is data


def test_skip_first_batches_on_prepared_and_plain_loaders():
    accelerator = Accelerator()
    loader = accelerator.prepare(pairs())
    skipped = accelerator.skip_first_batches(loader, 2)
    assert skipped is loader and len(skipped) == 1
    (only,) = list(skipped)
    assert torch.equal(only[1], torch.tensor([0, 1, 0, 1]))
    assert len(list(loader)) == 3  # the next epoch is whole again
    plain = accelerator.skip_first_batches(pairs(), 1)
    assert [batch[0].shape[0] for batch in plain] == [4, 4]


# ------------------------------------------------------------------------------ contexts


def test_autocast_follows_the_target():
    with Accelerator().autocast():
        assert not torch.is_autocast_enabled("cpu")
    accelerator = Accelerator(mixed_precision="bf16")
    with accelerator.autocast():
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    with accelerator.autocast(AutocastKwargs(enabled=False)):
        assert not torch.is_autocast_enabled("cpu")


def test_profile_writes_a_chrome_trace(tmp_path):
    handler = ProfileKwargs(activities=["cpu"], output_trace_dir=str(tmp_path))
    accelerator = Accelerator(kwargs_handlers=[handler])
    with accelerator.profile() as profiler:
        torch.ones(8, 8) @ torch.ones(8, 8)
    assert any(event.key == "aten::mm" for event in profiler.key_averages())
    assert json.loads((tmp_path / "profile_0.json").read_text())["traceEvents"]


# ------------------------------------------------------------------------------ files


def test_trackers_through_the_accelerator(tmp_path):
    accelerator = Accelerator(log_with="jsonl", project_dir=tmp_path)
    accelerator.init_trackers("run", config={"lr": 0.5})
    accelerator.log({"loss": torch.tensor(1.25)}, step=1)
    assert accelerator.get_tracker("jsonl").name == "jsonl"
    assert [t.name for t in accelerator.trackers] == ["jsonl"]
    accelerator.end_training()
    (line,) = (tmp_path / "run" / "log.jsonl").read_text().splitlines()
    assert json.loads(line)["values"] == {"loss": 1.25}


def test_save_unwrap_get_state_dict_and_save_model(tmp_path):
    accelerator = Accelerator()
    original = Net()
    model = accelerator.prepare(original)
    assert accelerator.unwrap_model(model) is original
    state = accelerator.get_state_dict(model)
    assert list(state) == list(original.state_dict())
    accelerator.save(state, tmp_path / "weights.pt")
    reloaded = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert all(torch.equal(reloaded[k], v) for k, v in state.items())
    accelerator.save(state, tmp_path / "weights.safetensors", safe_serialization=True)
    from safetensors.torch import load_file

    assert set(load_file(tmp_path / "weights.safetensors")) == set(state)
    accelerator.save_model(model, tmp_path / "model", max_shard_size=64)
    index = json.loads((tmp_path / "model" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state) and len(set(index["weight_map"].values())) > 1


def test_register_for_checkpointing_refuses_objects_without_state():
    accelerator = Accelerator()
    with pytest.raises(NotCheckpointableError, match="has no state_dict\\(\\)"):
        accelerator.register_for_checkpointing(object())


def test_free_memory_forgets_prepared_objects():
    accelerator = Accelerator()
    model, loader = accelerator.prepare(Net(), pairs())
    assert accelerator.free_memory(model, loader) == [None, None]
    with pytest.raises(RuntimeError, match="prepare a model first"):
        accelerator.backward(torch.ones(()))


# ------------------------------------------------------------------------------ training step


def plain_run(steps: int, accumulation: int):
    """The same training written with plain torch: the reference for the facade's.

    As in Accelerate, every loss is divided by `accumulation`, also in the last partial window
    (the runtime alone would average that window's own micro-steps).
    """
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, norms = [], []
    for i, (x, y) in enumerate(pairs(n=4 * steps)):
        loss = F.cross_entropy(model(x), y)
        (loss / accumulation).backward()
        losses.append(loss.item())
        if (i + 1) % accumulation == 0 or i + 1 == steps:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
            optimizer.step()
            optimizer.zero_grad()
    return losses, norms, [p.detach().clone() for p in model.parameters()]


def facade_run(steps: int, accumulation: int):
    torch.manual_seed(0)
    accelerator = Accelerator(gradient_accumulation_steps=accumulation)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, pairs(n=4 * steps))
    losses, norms = [], []
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            losses.append(loss.item())
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0).item())
            optimizer.step()
            optimizer.zero_grad()
    return losses, norms, [p.detach().clone() for p in model.parameters()]


def test_accumulated_training_equals_plain_torch_with_a_last_partial_window():
    # 5 micro-batches in windows of 2: the last window has one, still steps, and its loss is
    # divided by 2 as Accelerate does.
    expected, got = plain_run(5, 2), facade_run(5, 2)
    assert got[0] == expected[0] and got[1] == expected[1]
    assert all(torch.equal(a, b) for a, b in zip(got[2], expected[2], strict=True))


def test_save_and_load_state_with_numbered_folders(tmp_path):
    config = ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2
    )
    accelerator = Accelerator(project_config=config)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, pairs(), scheduler)
    accelerator.register_for_checkpointing(counter := Counter())
    for x, y in loader:
        accelerator.backward(F.cross_entropy(model(x), y))
        optimizer.step(), scheduler.step(), optimizer.zero_grad()
        counter.n += 1
        accelerator.save_state()
    folders = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert folders == ["checkpoint_1", "checkpoint_2"]  # total_limit=2 removed checkpoint_0
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    counter.n, lr = 0, scheduler.get_last_lr()
    accelerator.load_state()  # the latest: checkpoint_2
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert counter.n == 3 and scheduler.get_last_lr() == lr
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        accelerator.load_state(tmp_path / "missing")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="not a retarget checkpoint"):
        accelerator.load_state(tmp_path / "foreign")


def test_accelerates_logging_works_when_only_the_accelerator_is_swapped(caplog):
    """Every transformers example logs through accelerate.logging.get_logger, which needs
    Accelerate's state: retarget.Accelerator sets it up when accelerate was imported."""
    from accelerate.logging import get_logger
    from accelerate.state import PartialState

    PartialState._reset_state()
    try:
        with pytest.raises(RuntimeError, match="initialize the accelerate state"):
            get_logger("swapped").info("before", main_process_only=False)
        Accelerator()
        logger = get_logger("swapped")
        with caplog.at_level("INFO"):
            logger.info("on every process", main_process_only=False)
            logger.info("on the main process")
        assert "on every process" in caplog.text and "on the main process" in caplog.text
        assert PartialState().process_index == 0 and PartialState().num_processes == 1
    finally:
        PartialState._reset_state()


def test_save_state_writes_into_a_folder_that_exists_as_accelerate_does(tmp_path):
    """An empty folder (a TemporaryDirectory, a makedirs'd output dir) is written; one holding
    other files (a save hook's, the user's) is written into with a warning, its files kept."""
    accelerator = Accelerator()
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    with tempfile.TemporaryDirectory() as empty:
        accelerator.save_state(empty)
        assert (Path(empty) / "manifest.json").is_file()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("keep me")
    with pytest.warns(UserWarning, match="holds notes.txt.*written beside those files"):
        accelerator.save_state(tmp_path / "out")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    accelerator.load_state(tmp_path / "out")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert (tmp_path / "out" / "notes.txt").read_text() == "keep me"


class Counter:
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


# ------------------------------------------------------------------------------ scripts


def launch(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`retarget launch --num_processes 2 tests/scripts/<script> args` (about 6 s + training)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(cwd)}
    for name in ("RETARGET_TARGET", "RANK", "WORLD_SIZE", "RETARGET_CONFIG"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-m", "retarget", "launch", "--num_processes", "2"]
        + [str(SCRIPTS / script), *args],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_scripts_differ_from_accelerates_only_in_the_import_line():
    for script in ("accelerate_mnist.py", "accelerate_nlp.py", "accelerate_tracking.py"):
        body = ast.parse((SCRIPTS / script).read_text()).body[1:]  # after the docstring
        ours = [ast.unparse(node) for node in body if "retarget" in ast.unparse(node)]
        assert ours == ["from retarget import Accelerator"], script


@pytest.mark.distributed
def test_mnist_script_equals_the_compile_for_version(tmp_path):
    facade = launch("accelerate_mnist.py", cwd=tmp_path).stdout
    direct = launch("accelerate_mnist_compile_for.py", cwd=tmp_path).stdout
    numbers = re.findall(r"(?:loss|accuracy|checksum) = (\S+)", facade)
    assert len(numbers) == 5  # 2 epochs x (loss, accuracy) + weights
    assert facade == direct  # printed on the main process only, number for number
    assert re.findall(r"on (\d+)", facade) == ["250", "250"]  # no padding duplicates
    # learns: well above chance (0.1) after 16 steps; the shuffle is Accelerate's (seed 1)
    assert float(re.findall(r"accuracy = (\S+)", facade)[-1]) > 0.3


@pytest.mark.distributed
def test_nlp_script_resumes_from_a_checkpoint_exactly(tmp_path):
    full = launch("accelerate_nlp.py", "--output_dir", str(tmp_path), cwd=tmp_path).stdout
    steps = dict(re.findall(r"step (\d+) loss (\S+)", full))
    assert list(steps) == [str(i) for i in range(1, 13)]  # 2 epochs x 6 batches per process
    assert (tmp_path / "step_4" / "manifest.json").is_file()
    resumed = launch(
        "accelerate_nlp.py", "--output_dir", str(tmp_path / "again"),
        "--resume_from_checkpoint", str(tmp_path / "step_4"), cwd=tmp_path,
    ).stdout  # fmt: skip
    after = dict(re.findall(r"step (\d+) loss (\S+)", resumed))
    assert list(after) == [str(i) for i in range(5, 13)]
    assert after == {k: v for k, v in steps.items() if int(k) > 4}  # bitwise: same repr
    tail = [line for line in full.splitlines() if line.startswith(("epoch 1", "lr "))]
    assert tail == [line for line in resumed.splitlines() if line.startswith(("epoch 1", "lr "))]


@pytest.mark.distributed
def test_tracking_script_logs_to_tensorboard_and_uses_process_helpers(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    done = launch("accelerate_tracking.py", "--with_tracking", "--project_dir", str(tmp_path),
                  cwd=tmp_path)  # fmt: skip
    out = done.stdout
    assert "process 0 created the dataset" in out and "process 1 loaded the dataset" in out
    assert "process 0 takes ['a', 'b', 'c']" in out and "process 1 takes ['d', 'e']" in out
    # Two ranks share stdout: another rank's line may start right after a number, so match numbers.
    number = r"([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"
    printed = re.findall(rf"epoch (\d): accuracy {number} loss {number}", out)
    assert [epoch for epoch, _, _ in printed] == ["0", "1", "2"]
    events = EventAccumulator(str(tmp_path / "tracking"))
    events.Reload()
    accuracy = [(e.step, e.value) for e in events.Scalars("accuracy")]
    assert accuracy == [(int(e), pytest.approx(float(a))) for e, a, _ in printed]
    losses = [e.value for e in events.Scalars("train_loss")]
    assert losses == [pytest.approx(float(loss)) for _, _, loss in printed]
    lines = (tmp_path / "tracking" / "log.jsonl").read_text().splitlines()
    assert [json.loads(line)["values"]["epoch"] for line in lines] == [0, 1, 2]
    assert len((tmp_path / "summary.json").read_text().splitlines()) == 1  # main process only
