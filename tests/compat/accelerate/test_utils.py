"""retarget.utils: Accelerate's helpers, against Accelerate 1.15 where it runs here, on 2 gloo
ranks where they are distributed."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate.utils import find_executable_batch_size as accelerate_find_batch_size

from retarget.execution.process import ProcessState
from retarget.utils import (
    LocalSGD,
    broadcast_object_list,
    debug_launcher,
    find_executable_batch_size,
    gather_object,
    get_logger,
    load_checkpoint_in_model,
    notebook_launcher,
    release_memory,
    set_seed,
)
from tests.distributed import free_port, run_ranks

# ---------------------------------------------------------------- find_executable_batch_size


def _oom(kind: str) -> BaseException:
    if kind == "cpu":  # the real error the CPU allocator raises for an impossible allocation
        try:
            torch.empty(2**46, dtype=torch.uint8)
        except RuntimeError as error:
            return error
        raise AssertionError("a 64 TiB allocation succeeded")
    if kind == "cuda":  # torch.OutOfMemoryError, with the message the CUDA allocator writes
        return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0)")


@pytest.mark.parametrize("kind", ["cpu", "cuda", "runtime"])
def test_batch_size_shrinks_on_oom_as_accelerate(kind):
    error = _oom(kind)
    tried = {"retarget": [], "accelerate": []}

    def trainer(who):
        def train(batch_size, scale):
            tried[who].append(batch_size)
            if batch_size > 100:  # a few retries: each one runs a full gc.collect()
                raise error
            return batch_size * scale

        return train

    ours = find_executable_batch_size(trainer("retarget"), starting_batch_size=128)
    theirs = accelerate_find_batch_size(trainer("accelerate"), starting_batch_size=128)
    assert ours(2) == theirs(2) == tried["retarget"][-1] * 2
    assert tried["retarget"] == tried["accelerate"]
    assert tried["retarget"] == [128, 115, 103, 92]  # x0.9 each time, as Accelerate
    assert ours(3) == tried["retarget"][-1] * 3  # the size found is kept: no retry
    assert len(tried["retarget"]) == len(tried["accelerate"]) + 1


def test_batch_size_other_errors_and_zero():
    @find_executable_batch_size(starting_batch_size=8, reduce_batch_size_fn=lambda: 0)
    def always_oom(batch_size):
        raise _oom("cpu")

    with pytest.raises(RuntimeError, match="reached zero"):
        always_oom()

    @find_executable_batch_size(starting_batch_size=8)
    def broken(batch_size):
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        broken()
    with pytest.raises(TypeError, match="as the first argument"):
        find_executable_batch_size(lambda batch_size: batch_size)(16)


# ---------------------------------------------------------------- one process


def test_set_seed_and_release_memory():
    set_seed(3)
    drawn = (random.random(), np.random.rand(), torch.rand(2))
    set_seed(3)
    assert (random.random(), np.random.rand()) == drawn[:2]
    assert torch.equal(torch.rand(2), drawn[2])
    try:
        set_seed(3, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    a, b = release_memory(torch.ones(3), torch.ones(3))
    assert a is None and b is None
    assert gather_object(["x"]) == ["x"]  # a world of one: unchanged, as in Accelerate
    assert broadcast_object_list([1, 2]) == [1, 2]


def test_load_checkpoint_in_model_is_the_bigmodel_loader(tmp_path):
    from safetensors.torch import save_file

    source, target = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    save_file(source.state_dict(), tmp_path / "model.safetensors")
    load_checkpoint_in_model(target, tmp_path)
    torch.testing.assert_close(target.state_dict(), source.state_dict(), rtol=0, atol=0)


# ---------------------------------------------------------------- 2 gloo ranks


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _helpers_ranks(rank: int, world: int, shared_log: str) -> dict:
    import time

    from retarget import Accelerator

    out: dict = {}
    set_seed(10, device_specific=True)
    torch.manual_seed(10 + rank)
    expected = torch.rand(1)
    set_seed(10, device_specific=True)
    out["device_specific"] = torch.equal(torch.rand(1), expected)
    out["gather"] = gather_object([f"r{rank}", rank])
    out["broadcast"] = broadcast_object_list([rank, {"from": rank}], from_process=1)

    records = _Records()
    logger = get_logger(f"retarget.test.rank{rank}", log_level="INFO")
    logger.logger.addHandler(records)
    logger.info("main only")
    logger.info("everyone", main_process_only=False)
    logger.debug("below the level", main_process_only=False)
    logger.info("in order", in_order=True)
    out["logged"] = list(records.messages)
    logger.logger.addHandler(logging.FileHandler(shared_log))  # both processes append
    if rank == 0:
        time.sleep(1.0)  # rank 1 would write first, were it not made to wait
    logger.info("rank first", in_order=True)

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)  # the same initial weights on both ranks
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    inputs = torch.full((8, 4), float(rank + 1))  # each rank its own data: the models drift
    equal_after: list[bool] = []
    with LocalSGD(accelerator, model, local_sgd_steps=3) as local_sgd:
        for _ in range(7):
            loss = model(inputs).square().mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            local_sgd.step()
            flat = torch.cat([p.detach().flatten() for p in model.parameters()])
            both = accelerator.gather(flat.unsqueeze(0))
            equal_after.append(torch.equal(both[0], both[1]))
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    both = accelerator.gather(flat.unsqueeze(0))
    out["local_sgd"] = (str(accelerator.target), equal_after, torch.equal(both[0], both[1]))
    return out


@pytest.mark.distributed
def test_helpers_on_two_ranks(tmp_path):
    shared_log = tmp_path / "shared.log"
    zero, one = run_ranks(_helpers_ranks, 2, str(shared_log))
    assert shared_log.read_text().splitlines() == ["[RANK 0] rank first", "[RANK 1] rank first"]
    assert zero["device_specific"] and one["device_specific"]
    assert zero["gather"] == one["gather"] == ["r0", 0, "r1", 1]
    assert zero["broadcast"] == one["broadcast"] == [1, {"from": 1}]
    assert zero["logged"] == ["[RANK 0] main only", "[RANK 0] everyone", "[RANK 0] in order"]
    assert one["logged"] == ["[RANK 1] everyone", "[RANK 1] in order"]
    target, equal_after, equal_at_exit = zero["local_sgd"]
    assert target == "ddp"
    # averaged after steps 3 and 6 only (no gradient all-reduce between), and on leaving
    assert equal_after == [False, False, True, False, False, True, False]
    assert equal_at_exit and one["local_sgd"] == zero["local_sgd"]


def _launched(folder: str) -> None:
    state = ProcessState.current()
    total = torch.tensor([float(state.rank + 1)])
    torch.distributed.all_reduce(total)
    seen = f"{state.world_size} {state.backend} {total.item()}"
    Path(folder, f"rank{state.rank}").write_text(seen)


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["debug", "notebook"])
def test_launchers_run_two_gloo_processes(launcher, tmp_path):
    if launcher == "debug":
        debug_launcher(_launched, args=(str(tmp_path),), num_processes=2)
    else:
        notebook_launcher(_launched, (str(tmp_path),), num_processes=2, use_port=free_port())
    for rank in range(2):
        assert (tmp_path / f"rank{rank}").read_text() == "2 gloo 3.0"
    assert not torch.distributed.is_initialized()  # the launching process stays alone


def _fails(_: str) -> None:
    if ProcessState.current().rank == 1:
        raise ValueError("rank 1 broke")


@pytest.mark.distributed
def test_launcher_reports_a_failing_process(tmp_path):
    with pytest.raises(Exception, match="rank 1 broke"):
        debug_launcher(_fails, args=(str(tmp_path),), num_processes=2)
    with pytest.raises(NotImplementedError, match="one machine only"):
        notebook_launcher(_fails, num_processes=2, num_nodes=2)


def test_logger_level_and_warning_once(monkeypatch):
    monkeypatch.setenv("ACCELERATE_LOG_LEVEL", "warning")
    logger = get_logger("retarget.test.once")
    records = _Records()
    logger.logger.addHandler(records)
    logger.info("below the level")
    logger.warning_once("said once")
    logger.warning_once("said once")
    assert records.messages == ["[RANK 0] said once"]
    assert logging.getLogger("retarget.test.once").level == logging.WARNING


def test_local_sgd_in_a_world_of_one_and_its_refusals():
    from retarget import Accelerator

    model = torch.nn.Linear(2, 1)
    before = model.weight.detach().clone()
    with LocalSGD(Accelerator(), model, local_sgd_steps=1) as local_sgd:
        local_sgd.step()
    assert not local_sgd.enabled and local_sgd.num_steps == 1
    assert torch.equal(model.weight, before)
    with pytest.raises(ValueError, match="local_sgd_steps=0"):
        LocalSGD(Accelerator(), model, local_sgd_steps=0)
    with pytest.raises(NotImplementedError, match="FSDP shards the parameters"):
        LocalSGD(Accelerator(target="fsdp"), model, local_sgd_steps=2)


@pytest.mark.distributed
def test_launchers_in_process_and_refusals(tmp_path):
    ran = []
    notebook_launcher(ran.append, ("here",))  # no num_processes: this process, as Accelerate
    assert ran == ["here"]
    with pytest.raises(NotImplementedError, match="Accelerator"):
        notebook_launcher(ran.append, ("x",), num_processes=2, mixed_precision="fp16")
    with pytest.raises(NotImplementedError, match="rdzv_backend"):
        notebook_launcher(ran.append, ("x",), num_processes=2, rdzv_backend="c10d")
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="a process group already exists"):
            debug_launcher(_launched, args=(str(tmp_path),))
    finally:
        torch.distributed.destroy_process_group()
    assert ran == ["here"]


@pytest.mark.distributed
def test_accelerates_import_paths_reach_the_same_helpers():
    # Scripts migrate by changing `accelerate` to `retarget` in their import lines.
    import retarget
    from retarget.local_sgd import LocalSGD as FromModule
    from retarget.utils import debug_launcher, find_executable_batch_size, notebook_launcher

    assert FromModule is LocalSGD
    assert retarget.find_executable_batch_size is find_executable_batch_size
    assert retarget.debug_launcher is debug_launcher
    assert retarget.notebook_launcher is notebook_launcher


def test_every_shared_name_of_accelerate_utils_is_in_retarget_utils():
    """A script whose `from accelerate.utils import ...` lines are switched to retarget.utils
    finds every class and helper retarget offers under Accelerate's names (the by_feature
    examples import ProjectConfiguration, DistributedDataParallelKwargs, ... from there)."""
    import types

    import accelerate.utils

    import retarget
    import retarget.launch  # a subpackage, as a test before this one may have imported
    import retarget.utils

    names = [n for n in dir(retarget) if n[0] != "_" and hasattr(accelerate.utils, n)]
    # not the subpackages both have (retarget.launch, once imported, is an attribute too)
    shared = [n for n in names if not isinstance(getattr(retarget, n), types.ModuleType)]
    assert {"ProjectConfiguration", "TorchDynamoPlugin", "GradScalerKwargs"} <= set(shared)
    assert [n for n in shared if getattr(retarget.utils, n, None) is not getattr(retarget, n)] == []
