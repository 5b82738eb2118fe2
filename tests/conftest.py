"""Shared test helpers: run a model on zoo inputs and compare outputs and gradients exactly; the
test device switch (`RETARGET_TEST_DEVICE`, see `device`); the suite's run in two xdist workers
(distributed tests alone: tests/core_share.py), its time and memory report
(tests/memory_report.py), and what each finished test module leaves released."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_map_only

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.core_share import SHARED_CORES_ENV, CoreShare  # noqa: E402
from tests.memory_report import MemoryReport, cpu_seconds  # noqa: E402
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


#: The device the device-parametric tests run on: `cpu` (the default) or `cuda` (`cuda:0`).
#: `RETARGET_TEST_DEVICE=cuda python -m pytest -m "not distributed" tests` runs on a GPU every
#: test that takes the `device` fixture and the `gpu`-marked ones, and skips the others, each
#: saying why (bench/gpu/run.sh does this).
DEVICE_ENV = "RETARGET_TEST_DEVICE"
#: Why a test that takes no `device` fixture skips under a GPU device, unless its
#: `@pytest.mark.cpu_only("...")` says a reason of its own.
NOT_DEVICE_PARAMETRIC = "builds its tensors on the CPU itself (it takes no `device` fixture)"


def selected_device() -> torch.device:
    """The device `RETARGET_TEST_DEVICE` names (cuda means cuda:0); a UsageError otherwise."""
    name = os.environ.get(DEVICE_ENV) or "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise pytest.UsageError(f"{DEVICE_ENV}={name!r}: the test devices are cpu and cuda[:N]")
    return torch.device("cuda", 0) if device.type == "cuda" and device.index is None else device


def device_skip_reason(device: torch.device, fixtures: Any, cpu_only: Any, gpu: bool) -> str | None:
    """Why a test does not run on `device` (None: it runs): on a GPU device only the tests that
    take the `device` fixture and the `gpu`-marked ones run."""
    if device.type == "cpu" or gpu or "device" in fixtures:
        return None
    reason = cpu_only.args[0] if cpu_only is not None and cpu_only.args else NOT_DEVICE_PARAMETRIC
    return f"{DEVICE_ENV}={device}: runs on CPU only: {reason}"


def pytest_configure(config):
    device = selected_device()
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise pytest.UsageError(f"{DEVICE_ENV}={device}: torch sees no CUDA device")
        # Bitwise comparisons need the same kernels run to run (cuBLAS's workspace too).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


def pytest_collection_modifyitems(config, items):
    device = selected_device()
    for item in items:
        reason = device_skip_reason(
            device,
            getattr(item, "fixturenames", ()),
            item.get_closest_marker("cpu_only"),
            item.get_closest_marker("gpu") is not None,
        )
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device of a device-parametric test (`RETARGET_TEST_DEVICE`, cpu by default)."""
    return selected_device()


def to_device(value: Any, device: torch.device) -> Any:
    """A model moved to `device` (in place, returned), or a tree of tensors copied there."""
    if isinstance(value, torch.nn.Module):
        return value.to(device)
    return tree_map_only(torch.Tensor, lambda t: t.to(device), value)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models (`pytestmark = pytest.mark.usefixtures(
    "one_thread")`): on a shared 2-core machine OpenMP threads spinning against each other make
    them up to 100x slower than one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="module")
def release_what_the_module_left():
    """After each test module: dynamo's caches reset and garbage collected. A compiled graph
    sits in dynamo's cache on the code object it was compiled for, with the fake tensors (and
    their autograd graphs) of its node meta, long after the test that made it ended: without
    this the suite held ~1,500 such tensors mid-run, growing with the number of tests."""
    yield
    torch._dynamo.reset()
    gc.collect()


def graph_tensors_alive() -> int:
    """Tensors with an autograd graph (`grad_fn`) still alive in this process, after a gc."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.grad_fn)


@pytest.fixture
def reference_fp8_gemm():
    """The test's float8 GEMMs run torch's `_scaled_mm` on the CPU too, not the CPU's default
    emulation (retarget/kernels/fp8/layout.py): for the tests that check which GEMM runs."""
    from retarget.kernels.fp8.layout import cpu_fp8_gemm

    with cpu_fp8_gemm("scaled_mm"):
        yield


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


pytest_plugins = ["pytester"]  # tests/test_memory_report.py runs pytest on small modules

_memory: MemoryReport | None = None
#: Under pytest-xdist, the lock that runs distributed tests alone (tests/core_share.py).
_cores: CoreShare | None = None
#: The intra-op threads torch starts with here (one per core).
_cores_here = torch.get_num_threads()
#: What gives a process started by a `one_process` test one intra-op thread (torch reads it).
ONE_THREAD_ENV = ("OMP_NUM_THREADS",)
#: The key a worker's memory and time figures travel under to the controller.
_WORKER_FIGURES = "retarget_suite_figures"


def pytest_sessionstart(session):
    global _memory, _cores
    _memory = MemoryReport()
    # Only a real xdist worker has `workerinput`: a pytest started inside a test (the GPU
    # script's dry run) inherits the worker's PYTEST_XDIST_* variables, and taking the lock
    # there would wait for the very test that started it.
    workerinput = getattr(session.config, "workerinput", None)
    if workerinput is not None:
        _cores = CoreShare.for_run(workerinput["testrunuid"])
        # Nor should a test's subprocess see them: pytest-benchmark, started by `retarget
        # bench`, takes them for xdist and disables itself. Under the workers, ranks may start
        # only in a test holding the lock alone (tests/distributed.py reads this).
        for name in [n for n in os.environ if n.startswith("PYTEST_XDIST_")]:
            del os.environ[name]
        os.environ[SHARED_CORES_ENV] = "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _cores is None:
        yield
        return
    alone = _runs_alone(item)
    one_process = item.get_closest_marker("one_process") is not None
    # Beside the other worker a test gets one intra-op thread (two workers of two OpenMP
    # threads on two cores spin against each other); alone, every core, as without xdist. A
    # `one_process` test's processes get one thread too, through the environment they inherit.
    torch.set_num_threads(_cores_here if alone else 1)
    threads = {name: os.environ.get(name) for name in ONE_THREAD_ENV}
    if one_process:
        os.environ.update(dict.fromkeys(ONE_THREAD_ENV, "1"))
    try:
        # The lock stays held alone into the next test when that one runs alone too.
        keep = alone and nextitem is not None and _runs_alone(nextitem)
        with _cores.hold(alone=alone, keep=keep):
            before = cpu_seconds() if alone else None
            yield
            if alone and _memory is not None:
                _memory.record_alone(item.nodeid, before, cpu_seconds())
    finally:
        torch.set_num_threads(1)
        for name, value in threads.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _runs_alone(item) -> bool:
    """A distributed test not marked `one_process` has the cores to itself."""
    return (
        item.get_closest_marker("distributed") is not None
        and item.get_closest_marker("one_process") is None
    )


def pytest_runtest_setup(item):
    if _memory is not None:
        _memory.enter(str(item.path))


def pytest_runtest_logreport(report):
    # In the controller this sees every worker's reports too: per-test times are kept there.
    if _memory is not None:
        _memory.record_test(report.nodeid, report.duration)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown without it
def pytest_testnodedown(node, error):
    figures = getattr(node, "workeroutput", {}).get(_WORKER_FIGURES)
    if _memory is not None and figures is not None:
        _memory.merge(node.gateway.id, figures)


def pytest_sessionfinish(session, exitstatus):
    # The pooled gloo worlds end with the session: an xdist worker leaves by os._exit, which
    # runs no atexit handler (tests/distributed.py's would close them), and their ranks would
    # outlive the run, each holding an interpreter with torch loaded.
    distributed = sys.modules.get("tests.distributed")
    if distributed is not None:
        distributed.close_worlds()
    if _cores is not None:
        _cores.close()
        if _memory is not None:
            _memory.waited = dict(_cores.waited)
    if _memory is None:
        return
    _memory.close()
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller reports and checks
        workeroutput[_WORKER_FIGURES] = _memory.to_dict()
        return
    if _memory.over_limits() and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _memory is None:
        return
    for line in [*_memory.lines(), *_memory.slowest_tests(), *_memory.idle_lines()]:
        terminalreporter.write_line(line)
    for line in _memory.over_limits():
        terminalreporter.write_line(f"memory over its limit: {line}", red=True)
