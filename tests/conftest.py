"""Shared test helpers: run a model on zoo inputs and compare outputs and gradients exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.memory_report import MemoryReport  # noqa: E402
from tests.zoo import call, loss_of  # noqa: E402


def step(model: torch.nn.Module, inputs, *, seed: int = 1, backward: bool = True):
    """One forward (and backward) from a fixed RNG state; returns (loss, grads by name)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_of(call(model, inputs))
    if backward:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def assert_same_step(a: torch.nn.Module, b: torch.nn.Module, inputs, *, backward=True) -> None:
    """Loss and every gradient of `a` and `b` are bitwise equal."""
    loss_a, grads_a = step(a, inputs, backward=backward)
    loss_b, grads_b = step(b, inputs, backward=backward)
    assert torch.equal(loss_a, loss_b), f"loss {loss_a.item()} != {loss_b.item()}"
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), f"grad of {name} differs"


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models (`pytestmark = pytest.mark.usefixtures(
    "one_thread")`): on a shared 2-core machine OpenMP threads spinning against each other make
    them up to 100x slower than one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_rng():
    state = torch.random.get_rng_state()
    yield
    torch.random.set_rng_state(state)


#: torchrun's variables and the target `retarget launch` exports: a test process is a world of
#: one unless a test sets them itself (run_ranks sets them in the processes it spawns).
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RETARGET_TARGET")


@pytest.fixture(autouse=True)
def world_of_one(monkeypatch):
    """Every test starts and ends with no cached ProcessState and no launch environment."""
    from retarget.execution.process import ProcessState

    for name in _LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    ProcessState.reset()
    yield
    ProcessState.reset()


_memory: MemoryReport | None = None


def pytest_sessionstart(session):
    global _memory
    _memory = MemoryReport()


def pytest_runtest_setup(item):
    if _memory is not None:
        _memory.enter(str(item.path))


def pytest_sessionfinish(session, exitstatus):
    if _memory is None:
        return
    _memory.close()
    if _memory.over_limits() and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _memory is None:
        return
    for line in _memory.lines():
        terminalreporter.write_line(line)
    for line in _memory.over_limits():
        terminalreporter.write_line(f"memory over its limit: {line}", red=True)
