"""Member parity with accelerate.Accelerator 1.15: every public name exists on ours with
Accelerate's parameters, or raises an error naming it (never AttributeError); simple values
agree with Accelerate's in a world of one; the members added for parity do what they say.

The member lists are read from the installed accelerate (skipped without it), so a name
Accelerate adds later fails here until it is handled.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retarget import Accelerator, GradScalerKwargs, ProjectConfiguration
from retarget.compat.accelerate.arguments import _REFUSED
from retarget.execution.process import ProcessState

accelerate = pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def theirs():
    """accelerate's own Accelerator in a world of one (its singletons reset afterwards)."""
    from accelerate.state import AcceleratorState

    yield accelerate.Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def pairs(n=10, batch_size=4):
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 4, generator=generator), torch.arange(n) % 2)
    return DataLoader(data, batch_size=batch_size)


def public(obj) -> list[str]:
    return sorted(name for name in dir(obj) if not name.startswith("_"))


def assert_readable(ours, name: str) -> None:
    """`ours.name` is readable, or raises an error (not AttributeError) naming `name`."""
    try:
        getattr(ours, name)
    except AttributeError as error:
        pytest.fail(f"{name}: AttributeError ({error})")
    except Exception as error:  # noqa: BLE001 - any other error must name the member
        assert name in str(error), f"{name}: {type(error).__name__} does not name it: {error}"


# ------------------------------------------------------------------------------ names


def test_every_public_member_of_accelerates_accelerator_is_here(theirs):
    ours = Accelerator()
    names = set(public(accelerate.Accelerator)) | set(public(theirs))  # class and instance
    assert len(names) > 100
    for name in sorted(names):
        assert_readable(ours, name)


def test_our_signatures_take_every_parameter_of_accelerates():
    for name in public(accelerate.Accelerator) + ["__init__"]:
        member = inspect.getattr_static(accelerate.Accelerator, name)
        if isinstance(member, property) or not callable(getattr(accelerate.Accelerator, name)):
            continue
        wanted = inspect.signature(getattr(accelerate.Accelerator, name)).parameters
        have = inspect.signature(getattr(Accelerator, name)).parameters
        refused = _REFUSED if name == "__init__" else {}  # refused by name, with the reason
        for parameter in wanted.values():
            if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                continue
            assert parameter.name in have or parameter.name in refused, f"{name}({parameter.name})"


def test_state_and_gradient_state_answer_to_accelerates_names(theirs):
    ours = Accelerator()
    for name in public(theirs.state):
        assert_readable(ours.state, name)
    for name in public(theirs.gradient_state):
        assert_readable(ours.gradient_state, name)
    assert isinstance(ours.state, ProcessState)  # the runtime still reads it as its state
    for name in ("num_processes", "process_index", "local_process_index", "is_main_process",
                 "is_local_main_process", "is_last_process", "use_distributed", "device",
                 "mixed_precision", "initialized"):  # fmt: skip
        assert getattr(ours.state, name) == getattr(theirs.state, name), name
    assert ours.state.distributed_type.value == theirs.state.distributed_type.value
    for name in ("sync_gradients", "end_of_dataloader", "remainder", "in_dataloader", "num_steps",
                 "adjust_scheduler", "sync_with_dataloader", "active_dataloader"):  # fmt: skip
        assert getattr(ours.gradient_state, name) == getattr(theirs.gradient_state, name), name


SIMPLE = (
    "num_processes", "process_index", "local_process_index", "is_main_process",
    "is_local_main_process", "is_last_process", "use_distributed", "mixed_precision",
    "split_batches", "even_batches", "gradient_accumulation_steps", "sync_gradients",
    "optimizer_step_was_skipped", "non_blocking", "use_stateful_dataloader",
    "use_seedable_sampler", "is_fsdp2", "is_composable_parallelism_enabled", "multi_device",
    "parallelism_config", "torch_device_mesh", "should_save_model", "save_iteration", "step",
    "device_placement", "has_lomo_optimizer", "fp8_enabled", "native_amp", "has_fp8_handler",
    "delayed_fp8_autocast", "flag_tensor", "deepspeed_plugin", "project_dir", "logging_dir",
    "scaler", "trackers", "device",
)  # fmt: skip


def test_values_agree_with_accelerates_in_a_world_of_one(theirs):
    ours = Accelerator()
    for name in SIMPLE:
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.distributed_type.value == theirs.distributed_type.value
    assert ours.fp8_backend == theirs.fp8_backend.value == "NO"
    assert list(ours.rng_types) == theirs.rng_types
    # printed as transformers' examples log them: logger.info(accelerator.state)
    assert repr(ours.state) == str(ours.state) == repr(theirs.state)
    assert repr(ours.gradient_state) == repr(theirs.gradient_state)


@pytest.mark.parametrize("n,drop_last", [(10, False), (8, False), (10, True)])
def test_gather_for_metrics_cuts_the_last_batch_as_accelerates_in_a_world_of_one(
    theirs, n, drop_last
):
    """Values with a row per batch slot (an eval loss as `loss.repeat(batch_size)`) keep only
    the real samples' rows at a short last batch; a full or dropped one stays whole."""

    def gathered(accelerator):
        loader = accelerator.prepare(
            DataLoader(TensorDataset(torch.arange(float(n))), batch_size=4, drop_last=drop_last)
        )
        rows = []
        for (x,) in loader:
            loss = x.mean()
            out = accelerator.gather_for_metrics({"loss": loss.repeat(4), "x": x})
            rows.append((out["loss"].shape[0], out["x"].tolist()))
            assert accelerator.gather_for_metrics(loss).dim() == 0  # a scalar passes whole
        return rows

    assert gathered(Accelerator()) == gathered(theirs)


# ------------------------------------------------------------------------------ behaviour


def test_one_object_prepare_methods():
    accelerator = Accelerator()
    model = accelerator.prepare_model(Net())
    optimizer = accelerator.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scheduler = accelerator.prepare_scheduler(
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    )
    loader = accelerator.prepare_data_loader(pairs())
    assert accelerator._models == [model] and accelerator._schedulers == [scheduler]
    assert accelerator._optimizers == [optimizer] and accelerator._dataloaders == [loader]
    assert model.module is model  # DDP's `.module`, for scripts that reach through it
    assert not accelerator.prepare_model(Net(), evaluation_mode=True).training
    with pytest.raises(ValueError, match="slice_fn_for_dispatch"):
        accelerator.prepare_data_loader(pairs(), slice_fn_for_dispatch=lambda b, i: b)
    with pytest.raises(Exception, match="device_placement"):
        accelerator.prepare_optimizer(torch.optim.SGD(model.parameters()), device_placement=False)


def test_unscale_gradients_divides_by_the_loss_scale_once():
    scale = 2.0**10
    accelerator = Accelerator(
        mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=scale)]
    )
    with pytest.raises(RuntimeError, match="scaler"):
        _ = accelerator.scaler
    net = Net()
    model, optimizer, loader = accelerator.prepare(net, torch.optim.SGD(net.parameters()), pairs())
    assert accelerator.scaler is model.runtime.scaler.grad_scaler
    assert (
        isinstance(accelerator.scaler, torch.amp.GradScaler)
        and accelerator.scaler.get_scale() == scale
    )
    x, y = next(iter(loader))
    accelerator.backward(F.cross_entropy(model(x), y))
    scaled = [p.grad.clone() for p in model.parameters()]
    accelerator.unscale_gradients()
    accelerator.unscale_gradients(optimizer)  # once per step: a second call changes nothing
    for before, param in zip(scaled, model.parameters(), strict=True):
        torch.testing.assert_close(param.grad, before / scale)
    assert Accelerator().scaler is None


def test_save_and_load_pre_hooks(tmp_path):
    accelerator = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=str(tmp_path), automatic_checkpoint_naming=True
        )
    )
    model = accelerator.prepare(Net())
    calls = []
    handle = accelerator.register_save_state_pre_hook(
        lambda models, weights, out: calls.append((models, sorted(weights[0]), out))
    )
    accelerator.register_load_state_pre_hook(lambda models, d: calls.append((models, d)))
    assert accelerator.save_iteration == 0
    accelerator.save_state()
    assert accelerator.save_iteration == 1
    first = str(tmp_path / "checkpoints" / "checkpoint_0")
    assert calls == [([model], sorted(model.state_dict()), first)]
    handle.remove()
    accelerator.save_state()
    accelerator.load_state()
    assert calls[1:] == [([model], str(tmp_path / "checkpoints" / "checkpoint_1"))]
    accelerator.register_save_state_pre_hook(lambda models, weights, out: weights.pop())
    with pytest.raises(NotImplementedError, match="register_save_state_pre_hook"):
        accelerator.save_state()


def test_load_state_keywords(tmp_path):
    accelerator = Accelerator()
    accelerator.prepare(Net())
    accelerator.save_state(tmp_path / "c")
    accelerator.load_state(tmp_path / "c", strict=True)
    with pytest.raises(ValueError, match="strict=False"):
        accelerator.load_state(tmp_path / "c", strict=False)
    with pytest.raises(ValueError, match="load_kwargs"):
        accelerator.load_state(tmp_path / "c", load_kwargs={"map_location": "cpu"})


def test_triggers_join_and_sync_in_a_world_of_one():
    accelerator = Accelerator()
    assert not accelerator.check_trigger()
    accelerator.set_trigger()
    assert accelerator.check_trigger() and not accelerator.check_trigger()  # reset once seen
    model, loader = accelerator.prepare(Net(), pairs())
    with accelerator.join_uneven_inputs([model], even_batches=False):
        pass  # one process: nothing to join, as in Accelerate
    with accelerator.trigger_sync_in_backward(model):
        model(torch.ones(1, 4)).sum().backward()
    accelerator.gradient_accumulation_steps = 2
    with accelerator.accumulate(model):
        assert not accelerator.gradient_state.sync_gradients
        with pytest.raises(NotImplementedError, match="trigger_sync_in_backward"):
            with accelerator.trigger_sync_in_backward(model):
                pass


def test_gradient_state_follows_the_loop():
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, loader = accelerator.prepare(Net(), pairs(n=10, batch_size=4))
    state = accelerator.gradient_state
    assert not state.in_dataloader and state.remainder == -1 and state.num_steps == 2
    seen = []
    for _batch in loader:
        with accelerator.accumulate(model):
            seen.append((state.in_dataloader, state.end_of_dataloader, state.sync_gradients))
            assert state.active_dataloader is loader and state.dataloader_references[-1] is loader
            assert state.remainder == 2  # the real samples of the last batch
    assert seen == [(True, False, False), (True, False, True), (True, True, True)]
    assert not state.in_dataloader and state.active_dataloader is None


def test_unwrap_model_fp32_wrapper_and_torch_compile():
    accelerator = Accelerator(mixed_precision="bf16")
    original = Net()
    model = accelerator.prepare(original)
    x = torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = Net.forward(original, x).float()
    unwrapped = accelerator.unwrap_model(model)
    assert unwrapped is original and unwrapped(x).dtype == torch.float32
    assert torch.equal(unwrapped(x), expected)
    plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    assert torch.equal(plain(x), Net.forward(original, x))  # float32 all through
    compiling = Accelerator(target="single+compile")
    compiled = compiling.prepare(Net())
    assert isinstance(compiling.unwrap_model(compiled), torch._dynamo.eval_frame.OptimizedModule)
    assert not isinstance(
        compiling.unwrap_model(compiled, keep_torch_compile=False),
        torch._dynamo.eval_frame.OptimizedModule,
    )


def test_get_state_dict_unwrap_false_and_device_maps():
    accelerator = Accelerator()
    model = accelerator.prepare(Net())
    wrapped = accelerator.get_state_dict(model, unwrap=False)
    assert wrapped.keys() == model.state_dict().keys()
    params = dict(model.named_parameters())
    assert all(wrapped[k].data_ptr() == p.data_ptr() for k, p in params.items())  # no copies
    assert not accelerator.verify_device_map(Net())
    dispatched = Net()
    dispatched.hf_device_map = {"fc1": "cpu", "fc2": "disk"}
    assert accelerator.verify_device_map(dispatched)


def test_members_of_features_retarget_lacks_name_themselves():
    accelerator = Accelerator()
    with pytest.raises(NotImplementedError, match="lomo_backward"):
        accelerator.lomo_backward(torch.tensor(1.0), 0.1)
    with pytest.raises(RuntimeError, match="tensor_parallel_rank"):
        _ = accelerator.tensor_parallel_rank
    with accelerator.maybe_context_parallel():
        pass  # off, as in Accelerate without context parallelism
    with pytest.raises(ValueError, match="destroy_process_group"):
        accelerator.state.destroy_process_group(group=object())
    with pytest.raises(ValueError, match="select_deepspeed_plugin"):
        accelerator.state.select_deepspeed_plugin("other")


# ------------------------------------------------------------------------------ two processes

STATE_NAMES = (
    "num_processes", "process_index", "local_process_index", "is_main_process",
    "is_local_main_process", "is_last_process", "use_distributed", "mixed_precision",
)  # fmt: skip


def _state_of(rank: int, world: int, front_door: str) -> dict:
    if front_door == "accelerate":
        from accelerate import Accelerator as FrontDoor
    else:
        FrontDoor = Accelerator  # noqa: N806
    accelerator = FrontDoor(cpu=True)
    facts = {name: getattr(accelerator.state, name) for name in STATE_NAMES}
    facts["distributed_type"] = accelerator.state.distributed_type.value
    facts["accelerator"] = {name: getattr(accelerator, name) for name in STATE_NAMES}
    facts["printed"] = repr(accelerator.state)
    if front_door == "accelerate":
        return facts
    if rank == 1:
        accelerator.set_trigger()
    facts["trigger"] = [accelerator.check_trigger(), accelerator.check_trigger()]
    model = accelerator.prepare(Net())
    with model.no_sync():  # DDP's method on the prepared model: gradients stay local
        model(torch.full((1, 4), float(rank + 1))).sum().backward()
    facts["local"] = model.fc1.weight.grad.clone()
    model.zero_grad()
    model(torch.full((1, 4), float(rank + 1))).sum().backward()
    facts["synced"] = model.fc1.weight.grad.clone()
    model.zero_grad()
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    loader = accelerator.prepare(pairs(n=10, batch_size=2))  # 5 batches: 3 and 2 when uneven
    steps = 0
    with accelerator.join_uneven_inputs([model], even_batches=False):
        for x, _ in loader:
            accelerator.backward(model(x).sum())
            optimizer.step(), optimizer.zero_grad()
            steps += 1
    facts["joined"] = (steps, len(loader), model.fc1.weight.detach().clone())
    try:
        with accelerator.join_uneven_inputs([nn.Linear(1, 1)]):
            pass
    except NotImplementedError as error:
        facts["refused"] = str(error)
    return facts


@pytest.mark.distributed
def test_two_ranks_state_triggers_no_sync_and_join():
    from tests.distributed import run_ranks

    theirs = run_ranks(_state_of, 2, "accelerate", timeout=180)
    ours = run_ranks(_state_of, 2, "retarget", timeout=180)
    for rank in range(2):
        shared = {k: ours[rank][k] for k in theirs[rank]}
        assert shared == theirs[rank], f"rank {rank}"
        assert ours[rank]["distributed_type"] == "MULTI_CPU"
        assert ours[rank]["trigger"] == [True, False], "rank 1's trigger seen by every rank"
        assert "join_uneven_inputs" in ours[rank]["refused"]
    assert not torch.equal(ours[0]["local"], ours[1]["local"])
    assert torch.equal(ours[0]["synced"], ours[1]["synced"])
    torch.testing.assert_close(ours[0]["synced"], (ours[0]["local"] + ours[1]["local"]) / 2)
    (steps_0, even_length, weights_0), (steps_1, _, weights_1) = (
        ours[0]["joined"],
        ours[1]["joined"],
    )
    assert (steps_0, steps_1, even_length) == (3, 2, 3)  # uneven inside, even_batches after
    assert torch.equal(weights_0, weights_1), "Join leaves the ranks' weights equal"
