"""The `xla` part on torch-xla's CPU PJRT: one device, and SPMD over 4 virtual devices.

Runs in the xla environment (constraints-xla.txt: torch 2.9 + torch-xla 2.9) with
PJRT_DEVICE=CPU CPU_NUM_DEVICES=4; skipped elsewhere, where one test checks the refusal instead.
SPMD is a process-wide switch, so each case runs in a fresh process (run_ranks with one rank).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import retarget
from retarget.core.errors import TargetNotSupportedError
from retarget.execution import xla_device as xla
from tests.distributed import run_ranks

HAS_XLA = xla.available()
needs_xla = pytest.mark.skipif(not HAS_XLA, reason="torch_xla is not importable here")
pytestmark = pytest.mark.xla
STEPS = 10  # the issue: loss within 1e-5 relative of CPU eager over 10 steps


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU()) for _ in range(3)]
    return torch.nn.Sequential(torch.nn.Linear(8, 32), *blocks, torch.nn.Linear(32, 4))


def _model_and_batches(name: str):
    from tests import zoo

    if name == "tiny_llama":
        model = zoo.tiny_llama()
        batches = [zoo.lm_inputs(4) for _ in range(STEPS)]  # one fixed batch, as the zoo seeds
        return model, batches, lambda m, b: m(**b).loss
    gen = torch.Generator().manual_seed(0)
    xs = torch.randn(4, 8, generator=gen)
    ys = torch.randn(4, 4, generator=gen)
    batches = [{"x": xs, "y": ys}] * STEPS

    def loss(m, b):
        out = m(b["x"])
        return torch.nn.functional.mse_loss(out, b["y"].to(out.device))

    return _mlp(), batches, loss


def _train(rank: int, world: int, name: str, target: str) -> dict:
    """STEPS AdamW steps under `target` and on CPU eager: both loss curves and XLA's counters."""
    from retarget.execution.xla_placement import xla_steps

    model, batches, loss_of = _model_and_batches(name)
    reference = copy.deepcopy(model)
    compiled = retarget.compile_for(model, target, example_inputs=_first_inputs(name, batches))
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    losses, ref_losses = [], []
    for batch in batches:
        for m, o, out in ((compiled, opt, losses), (reference, ref_opt, ref_losses)):
            loss = loss_of(m, batch)
            loss.backward()
            o.step()
            o.zero_grad()
            out.append(loss.item())
    before = xla.compile_count()
    unwrapped = compiled.unwrap()  # right after a step: the weights are pending computations
    unwrap_compiles = xla.compile_count() - before
    plan = compiled.program.plan.xla
    params = dict(compiled.named_parameters())
    shards = {n: xla.local_shard_shapes(params[n]) for n in plan.shards}  # after unwrap's sync
    steps = xla_steps(compiled)
    probe = steps._place(torch.ones(8, 3))
    return {
        "losses": losses,
        "reference": ref_losses,
        "device": str(next(compiled.parameters()).device),
        "unwrapped_equal": all(
            torch.equal(a.detach().cpu(), b.detach().cpu())
            for a, b in zip(compiled.parameters(), unwrapped.parameters(), strict=True)
        ),
        "unwrap_compiles": unwrap_compiles,
        "shapes": {n: tuple(params[n].shape) for n in plan.shards},
        "shards": shards,
        "replicated": list(plan.replicated),
        "devices": plan.devices,
        "recompiles": steps.recompiles_after(3),
        "batch_spec": xla.sharding_spec(probe),
        "report": str(compiled.report),
    }


def _first_inputs(name: str, batches: list) -> object:
    return batches[0] if name == "tiny_llama" else (batches[0]["x"],)


def _close(got: list[float], expected: list[float], rtol: float) -> None:
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: {a} vs {b}"


@pytest.mark.distributed
@needs_xla
@pytest.mark.parametrize("name", ["tiny_llama", "mlp"])
def test_one_device_trains_like_cpu_eager(name):
    (got,) = run_ranks(_train, 1, name, "xla[spmd=false]", timeout=600, fresh=True)
    _close(got["losses"], got["reference"], 1e-5)
    assert got["device"].startswith("xla") and got["unwrapped_equal"]
    assert got["shards"] == {} and got["devices"] == 1
    assert got["recompiles"] == 0  # a fixed shape compiles nothing after warm-up
    assert got["unwrap_compiles"] <= 1  # one sync, not a graph per tensor read out


@pytest.mark.distributed
@needs_xla
def test_spmd_shards_each_block_weight_to_a_quarter_and_trains_like_eager():
    assert os.environ.get("CPU_NUM_DEVICES") == "4", "run the xla tests with CPU_NUM_DEVICES=4"
    (got,) = run_ranks(_train, 1, "tiny_llama", "xla", timeout=600, fresh=True)
    _close(got["losses"], got["reference"], 1e-5)
    assert got["devices"] == 4 and got["shards"]
    for name, pieces in got["shards"].items():
        full = got["shapes"][name]
        assert pieces == [(full[0] // 4, *full[1:])] * 4, name
    assert "model.embed_tokens.weight" in got["replicated"]  # glue stays whole
    assert all(".layers." in n for n in got["shards"])  # only the repeated blocks shard
    assert "devices=[4,1]" in got["batch_spec"]  # inputs are split on the batch dim
    assert got["recompiles"] == 0
    assert "place_xla" in got["report"] and "sharded on dim 0" in got["report"]


@pytest.mark.distributed
@needs_xla
def test_sharding_replicate_keeps_every_parameter_whole():
    (got,) = run_ranks(_train, 1, "mlp", "xla[sharding=replicate]", timeout=600, fresh=True)
    _close(got["losses"], got["reference"], 1e-5)
    assert got["shards"] == {} and "devices=[4,1]" in got["batch_spec"]


@pytest.mark.distributed
@needs_xla
def test_bf16_on_xla_trains_within_bf16_tolerance():
    (got,) = run_ranks(_train, 1, "tiny_llama", "xla[spmd=false]+bf16", timeout=600, fresh=True)
    _close(got["losses"], got["reference"], 2e-2)
    assert got["losses"][-1] < got["losses"][0]


def _save_resume(rank: int, world: int, folder: str) -> dict:
    """4 steps straight (saving after step 2) and resumed from that checkpoint, under SPMD."""
    from retarget.runtime.state.checkpoint import load_state, save_state

    runs: dict = {"weights": [], "losses": [], "specs": [], "save_compiles": []}
    for resume in (False, True):
        model, batches, loss_of = _model_and_batches("mlp")
        compiled = retarget.compile_for(model, "xla", example_inputs=_first_inputs("mlp", batches))
        opt = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
        start, losses = 0, {}
        if resume:
            start = load_state(folder, model=compiled, optimizers=[opt]).step
        sharded = next(iter(compiled.program.plan.xla.shards))
        runs["specs"].append(xla.sharding_spec(dict(compiled.named_parameters())[sharded]))
        for step in range(start, 4):
            loss = loss_of(compiled, batches[step])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[step] = loss.item()
            if step == 1 and not resume:  # right after a step: weights and moments pending
                before = xla.compile_count()
                save_state(folder, model=compiled, optimizers=[opt], step=2)
                runs["save_compiles"].append(xla.compile_count() - before)
        runs["losses"].append(losses)
        runs["weights"].append([p.detach().cpu().flatten().tolist() for p in compiled.parameters()])
    return runs


@pytest.mark.distributed
@needs_xla
def test_checkpoint_round_trip_from_xla_tensors(tmp_path):
    got = run_ranks(_save_resume, 1, str(tmp_path / "ck"), timeout=600, fresh=True)[0]
    (straight, resumed) = got["weights"]
    assert len(straight) == len(resumed)
    for a, b in zip(straight, resumed, strict=True):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-6, atol=1e-7)
    # the resumed run continues with the losses the uninterrupted one had, steps 3 and 4
    assert got["losses"][1] == pytest.approx({2: got["losses"][0][2], 3: got["losses"][0][3]})
    # and its parameters keep the layout the plan gave them (loaded into, not replaced)
    assert got["specs"] == ["{devices=[4,1]0,1,2,3}"] * 2
    # one sync (the pending update, compiled once) before the state is read out, not a graph
    # per tensor read (63 for a 2-layer Llama)
    assert got["save_compiles"] in ([0], [1]), got["save_compiles"]


@pytest.mark.skipif(HAS_XLA, reason="checks the refusal where torch_xla is missing")
def test_without_torch_xla_the_target_is_refused_saying_how_to_install():
    with pytest.raises(TargetNotSupportedError, match=r"xla: torch_xla cannot be imported.*"):
        retarget.compile_for(_mlp(), "xla", example_inputs=(torch.randn(2, 8),))
    with pytest.raises(TargetNotSupportedError, match=r"constraints-xla\.txt"):
        retarget.compile_for(_mlp(), "xla[spmd=false]+bf16", example_inputs=(torch.randn(2, 8),))


@needs_xla
def test_retarget_env_lists_the_xla_devices():
    from retarget.launch.env import env_report

    lines = env_report().splitlines()
    assert "- XLA devices: 4 (CPU)" in lines, lines
    assert any(line.startswith("- torch-xla: 2.") for line in lines)


def _accelerator_trains(rank: int, world: int) -> dict:
    import retarget as rt

    accelerator = rt.Accelerator()
    model, batches, loss_of = _model_and_batches("tiny_llama")
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built before prepare, as scripts do
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    losses, ref_losses = [], []
    for batch in batches[:3]:
        loss = loss_of(model, batch)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        ref_loss = loss_of(reference, batch)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    return {
        "target": str(accelerator.target),
        "type": str(accelerator.distributed_type.value),
        "device": str(next(model.parameters()).device),
        "losses": losses,
        "reference": ref_losses,
    }


@pytest.mark.distributed
@needs_xla
def test_the_accelerator_under_pjrt_trains_on_xla():
    (got,) = run_ranks(_accelerator_trains, 1, timeout=600, fresh=True)
    assert (got["target"], got["type"]) == ("xla", "XLA")
    assert got["device"].startswith("xla")
    _close(got["losses"], got["reference"], 1e-5)


def _cpu_backward_first(rank: int, world: int) -> str:
    """A CPU backward, then compile_for for xla: the refusal's message (or "trained")."""
    x = torch.ones(3, requires_grad=True)
    (x * 2).sum().backward()
    try:
        retarget.compile_for(_mlp(), "xla[spmd=false]", example_inputs=torch.randn(4, 8))
    except TargetNotSupportedError as error:
        return str(error)
    return "trained"


@pytest.mark.distributed
@needs_xla
def test_a_cpu_backward_before_xla_is_refused_saying_what_to_do():
    """torch's autograd engine sizes its device queues at its first backward; after a CPU one
    the first XLA backward would die on an internal assert (torch_xla alone does the same)."""
    (message,) = run_ranks(_cpu_backward_first, 1, timeout=300, fresh=True)
    assert "ran a backward on the CPU before torch_xla's runtime started" in message
    assert "before any other backward in the process, or train it in a fresh process" in message
