"""ProcessState: world of one without torchrun's environment; ranks, helpers over 2 gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch

from retarget.execution.process import ProcessState
from tests.distributed import run_ranks


def test_single_process_without_environment(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    state = ProcessState.current(cpu=True)
    assert (state.rank, state.world_size, state.distributed) == (0, 1, False)
    assert state.is_main_process and state.is_local_main_process and state.is_last_process
    assert state.device == torch.device("cpu")
    state.wait_for_everyone()  # no group: a no-op, not an error
    with state.split_between_processes([1, 2, 3]) as share:
        assert share == [1, 2, 3]


def test_rank_env_without_rendezvous_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(RuntimeError, match="MASTER_ADDR, MASTER_PORT is not"):
        ProcessState.current(cpu=True)


def _two_ranks(rank, world):
    state = ProcessState.current()
    seen = {
        "rank": state.rank,
        "world": state.world_size,
        "backend": state.backend,
        "main": state.is_main_process,
        "last": state.is_last_process,
    }
    calls = []
    state.on_main_process(lambda: calls.append("main"))()
    state.on_process(1)(lambda: calls.append("one"))()
    state.on_local_process(0)(lambda: calls.append("local0"))()
    seen["calls"] = calls
    with state.split_between_processes(list(range(5))) as share:
        seen["share"] = share
    with state.split_between_processes(torch.arange(5), apply_padding=True) as padded:
        seen["padded"] = padded.tolist()
    with state.split_between_processes({"a": [1, 2, 3], "b": "xy"}) as shares:
        seen["dict"] = shares
    order = os.path.join(os.environ["ORDER_DIR"], "order.txt")
    with state.main_process_first():
        with open(order, "a") as f:
            f.write(f"{rank}\n")
    state.wait_for_everyone()
    with open(order) as f:
        seen["order"] = f.read().split()
    return seen


@pytest.mark.distributed
def test_two_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("ORDER_DIR", str(tmp_path))
    zero, one = run_ranks(_two_ranks, 2)
    assert (zero["rank"], one["rank"], zero["world"], zero["backend"]) == (0, 1, 2, "gloo")
    assert zero["main"] and not one["main"] and one["last"] and not zero["last"]
    assert zero["calls"] == ["main", "local0"] and one["calls"] == ["one"]
    assert zero["share"] == [0, 1, 2] and one["share"] == [3, 4]
    assert zero["padded"] == [0, 1, 2] and one["padded"] == [3, 4, 4]
    assert zero["dict"] == {"a": [1, 2], "b": "x"} and one["dict"] == {"a": [3], "b": "y"}
    assert zero["order"] == ["0", "1"] == one["order"]


def _return_tensor(rank, world):
    return {"t": torch.full((2,), float(rank))}


@pytest.mark.distributed
def test_ranks_can_return_tensors():
    zero, one = run_ranks(_return_tensor, 2)
    assert torch.equal(zero["t"], torch.zeros(2)) and torch.equal(one["t"], torch.ones(2))


def _rank1_dies(rank, world):
    if rank == 1:
        os.kill(os.getpid(), 9)
    return rank


@pytest.mark.distributed
def test_a_rank_killed_by_a_signal_fails_fast():
    import time

    # Noticed by the dead rank's exit code, not by waiting the timeout out: the bound is 0.3 of
    # the timeout, as it was at 30 of 100 s, with room for a loaded machine's slower start.
    start = time.monotonic()
    with pytest.raises(AssertionError, match="died without a result"):
        run_ranks(_rank1_dies, 2, timeout=600)
    assert time.monotonic() - start < 180
