"""The test device switch (`RETARGET_TEST_DEVICE`, tests/conftest.py): which tests run under a GPU
device and why the others skip; and a few device-parametric checks small enough for the dry run
of bench/gpu/run.sh (on CPU in CI, on cuda:0 when a GPU is there)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import retarget
from tests.conftest import (
    DEVICE_ENV,
    NOT_DEVICE_PARAMETRIC,
    assert_same_step,
    device_skip_reason,
    selected_device,
    step,
    to_device,
)
from tests.paths import REPO
from tests.zoo import ZOO


def test_the_variable_names_the_device(monkeypatch):
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    assert selected_device() == torch.device("cpu")
    for name, expected in (("cuda", "cuda:0"), ("cuda:1", "cuda:1"), ("cpu", "cpu")):
        monkeypatch.setenv(DEVICE_ENV, name)
        assert selected_device() == torch.device(expected)
    for bad in ("tpu", "meta", "cuda:x"):
        monkeypatch.setenv(DEVICE_ENV, bad)
        with pytest.raises(pytest.UsageError, match=f"{DEVICE_ENV}='{bad}'"):
            selected_device()


def test_under_a_gpu_only_device_parametric_and_gpu_tests_run():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert device_skip_reason(cpu, ["tmp_path"], None, gpu=False) is None  # CPU: as today
    assert device_skip_reason(cuda, ["device", "tmp_path"], None, gpu=False) is None
    assert device_skip_reason(cuda, [], None, gpu=True) is None
    reason = device_skip_reason(cuda, ["tmp_path"], None, gpu=False)
    assert reason == f"{DEVICE_ENV}=cuda:0: runs on CPU only: {NOT_DEVICE_PARAMETRIC}"
    own = pytest.mark.cpu_only("gloo collectives").mark
    assert device_skip_reason(cuda, [], own, gpu=False).endswith(
        "runs on CPU only: gloo collectives"
    )


@pytest.mark.distributed  # a pytest of its own, in a fresh process
@pytest.mark.one_process
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine with no GPU")
def test_a_gpu_device_without_a_gpu_stops_before_any_test():
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_layout.py"],
        cwd=REPO,
        env={**os.environ, DEVICE_ENV: "cuda"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert f"{DEVICE_ENV}=cuda:0: torch sees no CUDA device" in done.stderr


# -- device-parametric: what the dry run of bench/gpu/run.sh runs ---------------------------------
def test_single_is_bitwise_equal_to_eager_on_the_device(device):
    entry = ZOO["tiny_llama"]
    model = to_device(entry.factory(), device)
    inputs = to_device(entry.inputs(2), device)
    compiled = retarget.compile_for(model, "single", example_inputs=inputs)
    assert compiled.program.regions[0].frontend == "export"
    assert next(compiled.parameters()).device == device
    assert_same_step(model, compiled, inputs)


def test_bf16_step_on_the_device_is_close_to_fp32(device):
    entry = ZOO["tiny_llama"]
    model = to_device(entry.factory(), device)
    inputs = to_device(entry.inputs(2), device)
    compiled = retarget.compile_for(
        to_device(entry.factory(), device), "bf16", example_inputs=inputs
    )
    loss, _ = step(model, inputs)
    loss_bf16, grads = step(compiled, inputs)
    assert loss_bf16.device == device and loss_bf16.dtype == torch.float32
    assert 0 < abs(loss_bf16 - loss).item() <= 3e-3
    assert all(g.device == device for g in grads.values())
